"""Lifecycle logic without Docker: diagnosis, guards, the wait loop, rendering, runtime detection."""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from vllmstack.config.profiles import resolve
from vllmstack.config.vllm_args import build_serve_argv
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.runtime import compose, compose_files, engine_env
from vllmstack.runtime.base import EngineState
from vllmstack.runtime.gpu import GIB, AmdSysfsProbe, GpuMemory
from vllmstack.serve import diagnosis, lifecycle, watch
from vllmstack.serve.guards import check_guards, print_guards, wait_gpu_release

DATA = Path(__file__).parent / "data"


# --- diagnosis against real vLLM logs ---------------------------------------------------------


def test_kv_memory_failure_is_found_above_the_generic_line() -> None:
    lines = (DATA / "fail-no-kv-memory.log").read_text().splitlines()
    found = diagnosis.diagnose(lines, exit_code=1)
    assert found.code == "kv-cache-oom"
    assert "No available memory for the cache blocks" in (found.line or "")
    # The generic line is below the real cause and must not win.
    assert "Failed core proc" not in (found.line or "")
    assert "VLLM_GPU_MEM_UTIL" in found.fix


def test_max_model_len_and_unknown_flag_failures() -> None:
    found = diagnosis.diagnose((DATA / "fail-max-model-len.log").read_text().splitlines())
    assert found.code == "max-len-over-model" and "100000" in found.cause
    found = diagnosis.diagnose((DATA / "fail-unknown-flag.log").read_text().splitlines(), 2)
    assert found.code == "unknown-flag" and "--bogus-flag 1" in found.cause


@pytest.mark.parametrize(("line", "code", "in_fix"), [
    ("ValueError: max_num_seqs (256) exceeds available Mamba cache blocks (249). Each decode sequence "
     "requires one Mamba cache block", "mamba-blocks", "VLLM_MAX_NUM_SEQS=249"),
    ("ValueError: Free memory on device cuda:0 (10.5/31.86 GiB) on startup is less than desired GPU "
     "memory utilization (0.95, 30.27 GiB).", "free-memory-below-util", "stop the other GPU user"),
    ("ValueError: To serve at least one request with the model's max seq len (262144), (16.0 GiB KV "
     "cache is needed, which is larger than the available KV cache memory (9.1 GiB). Based on the "
     "available memory, the estimated maximum model length is 148000.", "kv-too-small-for-max-len",
     "VLLM_MAX_MODEL_LEN=148000"),
    ("RuntimeError: HIP error: hipErrorNoBinaryForGpu", "missing-gfx-kernels",
     "HSA_OVERRIDE_GFX_VERSION"),
    ("TimeoutError: Timed out waiting for engine core processes to start.", "engine-start-timeout",
     "VLLM_ENGINE_READY_TIMEOUT_S"),
])
def test_known_signatures(line: str, code: str, in_fix: str) -> None:
    found = diagnosis.diagnose(["INFO something", line,
                                "RuntimeError: Engine core initialization failed. See root cause "
                                "above. Failed core proc(s): {}"])
    assert found.code == code and in_fix in found.fix


def test_silent_engine_death_falls_back_to_the_generic_line_and_native_crash() -> None:
    generic = ["INFO loading", "RuntimeError: Engine core initialization failed. See root cause "
               "above. Failed core proc(s): {}"]
    assert diagnosis.diagnose(generic).code == "engine-core-died"
    assert diagnosis.diagnose(["INFO loading"], exit_code=139).code == "native-crash"
    assert diagnosis.diagnose(["INFO loading"], exit_code=3).code == "unknown"


# --- guards ---------------------------------------------------------------------------------


@dataclass
class FakeProbe:
    missing: list[str] = field(default_factory=list)
    gpus: list[GpuMemory] | None = None

    def missing_devices(self) -> list[str]:
        return self.missing

    def memory(self) -> list[GpuMemory] | None:
        return self.gpus


def test_missing_kfd_fails_at_once_and_cannot_be_forced(project: Project) -> None:
    resolved = resolve(project)
    guards = check_guards(resolved, FakeProbe(missing=["/dev/kfd"]),
                                    own_engine_running=False, port_probe=lambda h, p: False)
    [guard] = guards
    assert guard.code == "no-gpu-devices" and not guard.overridable
    assert "no /dev/kfd found" in guard.message and "--platform cpu" in guard.fix
    with pytest.raises(lifecycle.LifecycleError, match="no /dev/kfd"):
        print_guards(guards, force=True, out=io.StringIO())


def test_other_engine_on_a_configured_port_refuses_unless_forced(project: Project) -> None:
    resolved = resolve(project, overrides=["OTHER_ENGINE_PORTS=8080"])
    guards = check_guards(resolved, FakeProbe(), own_engine_running=False,
                                    port_probe=lambda h, p: p == 8080,
                                    identify=lambda url: "llama.cpp server")
    assert [g.code for g in guards] == ["other-engine"]
    assert "port 8080" in guards[0].message and "llama.cpp server" in guards[0].message
    with pytest.raises(lifecycle.LifecycleError):
        print_guards(guards, force=False, out=io.StringIO())
    out = io.StringIO()
    print_guards(guards, force=True, out=out)
    assert "WARNING --force" in out.getvalue()


def test_free_memory_below_what_the_profile_takes(project: Project) -> None:
    resolved = resolve(project)  # 2xr9700, TP 2, util 0.95
    busy = [GpuMemory(0, 32 * GIB, 1 * GIB), GpuMemory(1, 32 * GIB, 12 * GIB)]
    guards = check_guards(resolved, FakeProbe(gpus=busy), own_engine_running=False,
                                    port_probe=lambda h, p: False)
    assert [g.code for g in guards] == ["gpu-memory-busy"]
    assert guards[0].message.startswith("GPU1: 20.0 GiB free of 32.0 GiB")


def test_amd_sysfs_probe_reads_vram_counters(tmp_path: Path) -> None:
    for i, used in enumerate((1 * GIB, 5 * GIB)):
        dev = tmp_path / f"sys/class/drm/card{i}/device"
        dev.mkdir(parents=True)
        (dev / "mem_info_vram_total").write_text(str(32 * GIB))
        (dev / "mem_info_vram_used").write_text(str(used))
    (tmp_path / "dev").mkdir()
    probe = AmdSysfsProbe(tmp_path)
    assert probe.missing_devices() == ["/dev/kfd", "/dev/dri"]
    gpus = probe.memory()
    assert gpus is not None and [g.used_bytes for g in gpus] == [1 * GIB, 5 * GIB]


# --- the wait loop ----------------------------------------------------------------------------


@dataclass
class FakeEngine:
    states: list[EngineState]
    lines: list[str]
    name: str = "fake"
    flavour: str = "fake"
    stopped: bool = False

    def start(self) -> None: ...

    def state(self) -> EngineState:
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def log_lines(self, tail: int = 400) -> list[str]:
        return self.lines[-tail:]

    def stop(self) -> None:
        self.stopped = True

    def remove(self) -> None: ...

    def members(self) -> list[dict[str, object]]:
        return []


RUNNING = EngineState(True, True, "running")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_exit_is_caught_on_the_next_poll_with_a_diagnosis() -> None:
    lines = (DATA / "fail-no-kv-memory.log").read_text().splitlines()
    engine = FakeEngine([RUNNING, RUNNING, RUNNING, EngineState(True, False, "exited", 0, 1)], lines)
    clock = Clock()
    with pytest.raises(lifecycle.LifecycleError) as err:
        watch.wait_until_healthy(engine, "http://x", 600, watch.Progress(io.StringIO(), False),
                                     health=lambda url: None, clock=clock, sleep=clock.sleep)
    assert clock.now <= 1.5  # three polls, not the 600 s timeout
    assert "exited with code 1" in err.value.cause and "KV cache" in err.value.cause
    assert err.value.fix is not None and "VLLM_GPU_MEM_UTIL" in err.value.fix


def test_restart_is_a_crash_loop() -> None:
    engine = FakeEngine([RUNNING, EngineState(True, True, "running", restart_count=1)], ["boom"])
    with pytest.raises(lifecycle.LifecycleError, match="crash-looping"):
        watch.wait_until_healthy(engine, "http://x", 600, watch.Progress(io.StringIO(), False),
                                     health=lambda url: None, clock=Clock(), sleep=lambda s: None)


def test_hang_ends_at_the_timeout_with_the_log_tail() -> None:
    engine = FakeEngine([RUNNING], ["Loading safetensors checkpoint shards", "still loading"])
    clock = Clock()
    with pytest.raises(lifecycle.LifecycleError) as err:
        watch.wait_until_healthy(engine, "http://x", 10, watch.Progress(io.StringIO(), False),
                                     health=lambda url: None, clock=clock, sleep=clock.sleep)
    assert "within 10 s" in err.value.cause and "loading weights" in err.value.cause
    assert "still loading" in err.value.details


def test_503_after_listening_means_the_engine_died() -> None:
    engine = FakeEngine([RUNNING], ["EngineDeadError: engine core died"])
    with pytest.raises(lifecycle.LifecycleError, match="503"):
        watch.wait_until_healthy(engine, "http://x", 60, watch.Progress(io.StringIO(), False),
                                     health=lambda url: 503, clock=Clock(), sleep=lambda s: None)


def test_healthy_returns_elapsed_time_and_progress_names_the_phase() -> None:
    answers = iter([None, None, 200])
    out = io.StringIO()
    clock = Clock()
    engine = FakeEngine([RUNNING], ["(EngineCore) Capturing CUDA graphs (mixed prefill-decode)"])
    took = watch.wait_until_healthy(engine, "http://x", 60, watch.Progress(out, False),
                                        health=lambda url: next(answers), clock=clock,
                                        sleep=clock.sleep)
    assert took == pytest.approx(1.0)
    assert "capturing graphs" in out.getvalue()


# --- compose rendering and detection --------------------------------------------------------------


def render(project: Project, platform: str, model: str = "qwen3-0.6b", runtime: str = "compose",
           package_dir: str | None = None, *sets: str) -> dict:  # type: ignore[type-arg]
    resolved = resolve(project, platform=platform, model=model, overrides=list(sets))
    command = build_serve_argv(resolved)
    ids = engine_env.HostIds(1000, 1000, 992, 44)
    paths = engine_env.StackPaths(Path("/h/.cache/huggingface"), Path("/h/.cache/vllmstack-engine"), None)
    override, _ = compose_files.build_override(project, resolved, command, runtime=runtime, ids=ids,
                                         paths=paths, package_dir=package_dir)
    return override["services"]["vllm"]  # type: ignore[no-any-return]


def test_rocm_platform_gets_devices_groups_and_its_env(project: Project) -> None:
    service = render(project, "2xr9700", "qwen3.8-27b")
    assert service["devices"] == ["/dev/kfd", "/dev/dri"]
    assert service["group_add"] == ["44", "992"]
    env = service["environment"]
    assert env["HIP_VISIBLE_DEVICES"] == "0,1" and env["VLLM_ROCM_USE_AITER"] == "1"
    assert env["PYTORCH_ROCM_ARCH"] == "gfx1201"
    # Settings that become flags or stay in the stack never leak into the environment.
    assert "VLLM_MAX_NUM_SEQS" not in env and "GPU_VRAM_GIB" not in env
    assert service["command"][0] == "Qwen/Qwen3.8-27B-FP8"
    assert "--no-async-scheduling" in service["command"]


def test_nvidia_gets_a_gpu_reservation_and_podman_cdi(project: Project) -> None:
    service = render(project, "nvidia")
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    assert render(project, "nvidia", runtime="podman")["devices"] == ["nvidia.com/gpu=all"]


def test_cpu_platform_has_no_devices_and_dollar_signs_are_escaped(project: Project) -> None:
    service = render(project, "cpu", "qwen3-0.6b", "compose", None,
                     'VLLM_GENERATION_CONFIG={"stop": "$x"}', "ENGINE_ENV=SIM_FAULT=hang A=b")
    assert "devices" not in service and "deploy" not in service
    assert '{"stop":"$$x"}' in service["command"]
    assert service["environment"]["SIM_FAULT"] == "hang"


def test_overlays_and_fp8_configs_mount_into_the_labelled_package(project: Project) -> None:
    folder = project.root / "fp8_configs"
    folder.mkdir(exist_ok=True)
    mine = "N=7168,K=5120,device_name=AMD_Radeon_R9700,dtype=fp8_w8a8,block_shape=[128,128].json"
    other = "N=7168,K=5120,device_name=NVIDIA_H100,dtype=fp8_w8a8,block_shape=[128,128].json"
    (folder / mine).write_text("{}")
    (folder / other).write_text("{}")
    service = render(project, "2xr9700", "qwen3.8-27b", "compose", "/opt/vllm-package")
    volumes = service.get("volumes", [])
    fp8 = [v for v in volumes if v.startswith(str(folder))]
    assert fp8 == [f"{folder / mine}:/opt/vllm-package/{engine_env.FP8_CONFIG_DIR}/{mine}:ro"]
    from vllmstack.image.patches import load_overlays

    for overlay in load_overlays(project):
        target = overlay.target.removeprefix("vllm/")
        assert any(v.endswith(f":/opt/vllm-package/{target}:ro") for v in volumes)
    # Without our build's label nothing is mounted over the package.
    assert not [v for v in render(project, "2xr9700", "qwen3.8-27b").get("volumes", [])
                if "vllm-package" in v]


def test_written_files_are_readable_and_reproducible(project: Project) -> None:
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b")
    command = build_serve_argv(resolved)
    override = {"services": {"vllm": {"command": command.argv[2:]}}}
    rendered = compose_files.write_rendered(project, resolved, command, override,
                                      {"VLLMSTACK_VLLM_IMAGE": "x/y:1"}, [])
    assert yaml.safe_load(rendered.override.read_text()) == override
    assert "VLLMSTACK_VLLM_IMAGE=x/y:1" in rendered.env_file.read_text()
    assert rendered.argv_file.read_text().startswith("vllm serve Qwen/Qwen3-0.6B")
    assert "# env/models/qwen3-0.6b.env:" in (project.generated / "resolved.env").read_text()


def test_runtime_detection_order_and_override() -> None:
    runner = RecordingRunner()
    runner.respond(["docker", "compose", "version"], Result((), 1, "", "unknown command"))
    cli = compose.detect_compose(runner, "docker")
    assert cli.runtime == "compose-v1" and cli.base == ("docker-compose",)
    assert compose.detect_compose(RecordingRunner(), "docker").runtime == "compose"
    assert compose.detect_compose(RecordingRunner(), "docker", "podman").engine == "podman"
    failing = RecordingRunner()
    for base in (["docker", "compose"], ["docker-compose"], ["podman", "compose"]):
        failing.respond([*base, "version"], Result((), 127, "", "not found"))
    with pytest.raises(compose.ComposeError, match="no working compose"):
        compose.detect_compose(failing, "docker")


def test_dry_run_prints_the_exact_compose_command(project: Project) -> None:
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b")
    runner = RecordingRunner(dry_run=True)
    cli = compose.ComposeCli("compose-v1", ("docker-compose",), "docker")
    engine = compose.ComposeEngine(cli, runner, "vllmstack", compose_files.compose_files(project),
                                   project.generated / "compose.env")
    engine.start()
    assert runner.calls[-1] == (
        "docker-compose", "-p", "vllmstack", "-f", str(project.root / "compose.yaml"),
        "-f", str(project.generated / "compose.override.yaml"),
        "--env-file", str(project.generated / "compose.env"),
        "up", "-d", "--force-recreate", "--no-deps", "vllm")
    del resolved


def test_gpu_release_wait(tmp_path: Path) -> None:
    readings = iter([30 * GIB, 20 * GIB, 1 * GIB])
    probe = FakeProbe(gpus=None)
    probe.memory = lambda: [GpuMemory(0, 32 * GIB, next(readings))]  # type: ignore[method-assign]
    clock = Clock()
    released, used = wait_gpu_release(probe, 512 * 1024**2, 60, clock.sleep, clock)
    assert released and used == 1 * GIB
    stuck = FakeProbe(gpus=[GpuMemory(0, 32 * GIB, 30 * GIB)])
    released, _ = wait_gpu_release(stuck, 0, 5, clock.sleep, clock)
    assert not released


def test_cache_folders_are_made_user_owned_before_compose(tmp_path: Path) -> None:
    paths = engine_env.StackPaths(tmp_path / "hf", tmp_path / "engine", None)
    ids = engine_env.HostIds(4242, 4343, None, None)
    planned = engine_env.ensure_cache_dirs(paths, ids, dry_run=True)
    assert f"mkdir -p {tmp_path / 'engine' / 'aiter/jit'}" in planned
    assert not (tmp_path / "engine").exists()  # a dry run changes nothing
    engine_env.ensure_cache_dirs(paths, ids, dry_run=False)
    for folder in (tmp_path / "hf", tmp_path / "engine" / "triton"):
        assert folder.is_dir()
        if os.geteuid() == 0:
            assert (folder.stat().st_uid, folder.stat().st_gid) == (4242, 4343)


def test_cache_folder_owned_by_someone_else_names_the_chown_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As an ordinary user (root could simply chown) whose uid does not own the folder.
    owner = tmp_path.stat().st_uid
    monkeypatch.setattr(engine_env.os, "geteuid", lambda: owner + 1)
    paths = engine_env.StackPaths(tmp_path, tmp_path / "engine", None)
    ids = engine_env.HostIds(owner + 1, owner + 1, None, None)
    with pytest.raises(engine_env.CacheDirError, match=f"sudo chown -R {owner + 1}:{owner + 1} {tmp_path}"):
        engine_env.ensure_cache_dirs(paths, ids, dry_run=False)


def test_aiter_prewarm_clears_stale_locks_builds_once_per_image(project: Project, tmp_path: Path) -> None:
    resolved = resolve(project)  # 2xr9700: AITER on
    runner = RecordingRunner()
    runner.respond(["docker", "image", "inspect", "--format", "{{.Id}}"],
                   Result((), 0, "sha256:abc\n", ""))
    cli = compose.ComposeCli("compose-v1", ("docker-compose",), "docker")
    engine = compose.ComposeEngine(cli, runner, "vllmstack", compose_files.compose_files(project),
                                   project.generated / "compose.env")
    stack = lifecycle.Stack(project, resolved, {}, runner, engine, FakeProbe(), io.StringIO())
    paths = engine_env.StackPaths(tmp_path / "hf", tmp_path / "engine", None)
    lock = paths.engine_cache / "aiter/jit/build/lock_module_aiter_core"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    engine.prewarm_aiter(paths, "img:1", dry_run=False)
    assert not lock.exists()
    runs = [c for c in runner.calls if "run" in c]
    assert len(runs) == 1 and runs[0][-4:] == ("python3", "vllm", "-c", compose.AITER_PREWARM)
    assert ("--entrypoint" in runs[0]) and ("--no-deps" in runs[0])
    engine.prewarm_aiter(paths, "img:1", dry_run=False)
    assert len([c for c in runner.calls if "run" in c]) == 1  # once per image
    failing = RecordingRunner()
    failing.respond(["docker-compose"], Result((), 1, "", "ModuleNotFoundError: aiter"))
    engine.runner = failing
    stack.runner = failing
    with pytest.raises(compose.ComposeError, match="AITER"):
        engine.prewarm_aiter(paths, "img:2", dry_run=False)


def test_clear_caches_keeps_models_and_refuses_while_running(project: Project, tmp_path: Path) -> None:
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b",
                       overrides=[f"HOST_CACHE_DIR={tmp_path}"])
    paths = engine_env.stack_paths(resolved, {})
    engine_env.ensure_cache_dirs(paths, engine_env.HostIds(os.getuid(), os.getgid(), None, None),
                              dry_run=False)
    (paths.engine_cache / "triton" / "kernel.bin").write_text("x")
    (paths.hf_cache / "model.safetensors").write_text("x")
    engine = FakeEngine([EngineState(True, True, "running")], [])
    stack = lifecycle.Stack(project, resolved, {}, RecordingRunner(), engine, FakeProbe(),
                            io.StringIO())
    with pytest.raises(lifecycle.LifecycleError, match="running"):
        lifecycle.clear_caches(stack)
    engine.states = [EngineState(False, False, "missing")]
    assert lifecycle.clear_caches(stack, dry_run=True)
    assert (paths.engine_cache / "triton" / "kernel.bin").exists()  # a dry run deletes nothing
    lifecycle.clear_caches(stack)
    assert not (paths.engine_cache / "triton").exists()
    assert (paths.hf_cache / "model.safetensors").exists()
