"""Lifecycle logic without Docker: diagnosis, guards, the wait loop, rendering, runtime detection."""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from vllmstack.config.llamacpp_args import build_llamacpp_argv
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
     "HSA_OVERRIDE_GFX_VERSION"),  # the AMD fix (these tests run as an AMD box)
    ("TimeoutError: Timed out waiting for engine core processes to start.", "engine-start-timeout",
     "VLLM_ENGINE_READY_TIMEOUT_S"),
])
def test_known_signatures(line: str, code: str, in_fix: str) -> None:
    found = diagnosis.diagnose(["INFO something", line,
                                "RuntimeError: Engine core initialization failed. See root cause "
                                "above. Failed core proc(s): {}"], vendor="amd")
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


def test_engine_log_lines_shown_by_up_mask_the_api_key() -> None:
    # vLLM logs its non-default args, an --api-key among them; neither the progress line nor the
    # error's log tail and diagnosis may print it.
    key = "sk-local-7f3e9a"
    booting = [f"(APIServer pid=1) INFO non-default args: {{'api_key': ['{key}'], 'model': 'm'}}"]
    out = io.StringIO()
    engine = FakeEngine([RUNNING, RUNNING, EngineState(True, False, "exited", 0, 1)],
                        [*booting, f"ValueError: bad key {key}"])
    with pytest.raises(lifecycle.LifecycleError) as err:
        watch.wait_until_healthy(engine, "http://x", 600, watch.Progress(out, False),
                                 health=lambda url: None, clock=Clock(), sleep=lambda s: None,
                                 secrets=[key])
    shown = out.getvalue() + err.value.render()
    assert key not in shown and "***" in shown


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


def test_resolved_env_leaves_out_the_other_engines_defaults_only(project: Project) -> None:
    """A vLLM profile's record does not list llama-server's defaults, but a llama.cpp key a user
    set is kept with its source; a llama.cpp profile's drops vLLM's flag defaults, not the port."""
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b",
                       overrides=["LLAMACPP_CTX=4096"])
    compose_files.write_rendered(project, resolved, build_serve_argv(resolved), {}, {}, [])
    text = (project.generated / "resolved.env").read_text()
    assert "LLAMACPP_FLASH_ATTN" not in text and "LLAMACPP_REF" not in text
    assert "# --set\nLLAMACPP_CTX=4096\n" in text
    assert "llama.cpp settings at their defaults (this profile runs ENGINE=vllm)" in text
    assert "VLLM_ENFORCE_EAGER=0" in text
    gguf = resolve(project, platform="cpu", model="tiny-gguf", overrides=["MODELS_DIR=/models"])
    compose_files.write_rendered(project, gguf, build_llamacpp_argv(gguf, host="0.0.0.0"), {}, {},
                                 [])
    text = (project.generated / "resolved.env").read_text()
    assert "VLLM_ENFORCE_EAGER" not in text and "VLLM_KV_CACHE_DTYPE" not in text
    assert "VLLM_PORT=" in text and "LLAMACPP_FLASH_ATTN=auto" in text and "LLAMACPP_CTX=8192" in text
    assert "vLLM settings at their defaults (this profile runs ENGINE=llamacpp)" in text


def test_runtime_detection_order_and_override() -> None:
    runner = RecordingRunner()
    runner.respond(["docker", "compose", "version"], Result((), 1, "", "unknown command"))
    cli = compose.detect_compose(runner, "docker")
    assert cli.runtime == "compose-v1" and cli.base == ("docker-compose",)
    assert compose.detect_compose(RecordingRunner(), "docker").runtime == "compose"
    assert compose.detect_compose(RecordingRunner(), "docker", "podman").engine == "podman"
    failing = RecordingRunner()
    for base in (["docker", "compose"], ["docker-compose"], ["podman-compose"], ["podman", "compose"]):
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


# --- the optional dashboard never fails `up` (issue 12 item 11, issue 16 item 5) -------------


@dataclass
class DashboardEngine(FakeEngine):
    """An engine whose dashboard side-car fails until `dashboard_error` is cleared."""

    dashboard_error: Exception | None = None
    dashboard_starts: int = 0

    def prepare(self, command: object, *, dry_run: bool) -> list[str]:
        return []

    def dashboard_up(self) -> None:
        self.dashboard_starts += 1
        if self.dashboard_error is not None:
            raise self.dashboard_error


def test_up_succeeds_when_the_dashboard_fails_and_the_next_up_starts_it(
    project: Project, monkeypatch: pytest.MonkeyPatch
) -> None:
    from helpers import free_port

    resolved = resolve(project, platform="cpu", model="qwen3-0.6b",
                       overrides=["OTHER_ENGINE_PORTS=", f"VLLM_PORT={free_port()}"])
    failure = compose.ComposeError(
        "building the dashboard image localhost/vllmstack-dashboard:latest failed (exit 1)",
        "check that DASHBOARD_BASE_IMAGE has python3 with venv and pip")
    engine = DashboardEngine([EngineState(False, False, "missing")], [], dashboard_error=failure)
    out = io.StringIO()
    stack = lifecycle.Stack(project, resolved, {}, RecordingRunner(), engine, FakeProbe(), out)
    monkeypatch.setattr(lifecycle, "wait_until_healthy", lambda *a, **k: 12.5)
    monkeypatch.setattr(lifecycle, "warm_up", lambda url, name: 0.2)
    monkeypatch.setattr(lifecycle, "health_status", lambda url: 200)
    result = lifecycle.up(stack)  # no exception: the engine is up
    assert result.boot_seconds == 12.5 and engine.dashboard_starts == 1
    text = out.getvalue()
    assert "warning: the engine is up, but the dashboard did not start: building the dashboard" in text
    assert "invoke dashboard-up" in text and "invoke dashboard" in text
    assert any(n.startswith("dashboard not started") for n in result.notes)
    # The same `up` again: the engine is left alone, the dashboard is started this time.
    engine.states = [EngineState(True, True, "running")]
    engine.dashboard_error = None
    out.truncate(0)
    again = lifecycle.up(stack)
    assert "already running" in again.notes and engine.dashboard_starts == 2
    assert "nothing to do for the engine" in out.getvalue() and "warning" not in out.getvalue()
    lifecycle.up(stack, dashboard=False)  # --no-dashboard: not even tried
    assert engine.dashboard_starts == 2


def test_the_dashboard_image_builds_without_buildkit_from_its_own_context(project: Project) -> None:
    import shutil

    from helpers import ROOT

    for name in ("Dockerfile.dashboard", "pyproject.toml"):
        shutil.copy2(ROOT / name, project.root / name)
    shutil.copytree(ROOT / "vllmstack", project.root / "vllmstack")
    runner = RecordingRunner()
    runner.respond(["docker", "image", "inspect"], Result((), 1, "", "No such image"))
    cli = compose.ComposeCli("compose-v1", ("docker-compose",), "docker")
    env_file = project.generated / "compose.env"
    env_file.parent.mkdir(parents=True, exist_ok=True)
    env_file.write_text("")
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b")
    engine = compose.ComposeEngine(cli, runner, "vllmstack", compose_files.compose_files(project),
                                   env_file, project=project, resolved=resolved, out=io.StringIO())
    engine.dashboard_up()
    build = next(c for c in runner.calls if "build" in c)
    context = project.generated / "dashboard-build"
    # No DOCKER_BUILDKIT and no BuildKit-only flags: a client without buildx builds it too.
    assert build[0] == "docker" and "env" not in build and "--secret" not in build
    assert build[-1] == str(context) and (context / "Dockerfile").is_file()
    assert (context / "vllmstack" / "__init__.py").is_file() and (context / "pyproject.toml").is_file()
    assert not list(context.rglob("__pycache__"))
    dockerfile = (context / "Dockerfile").read_text()
    assert "--mount=" not in dockerfile and "# syntax" not in dockerfile
    # The CA bundle stays in the build stage: the final stage copies only the venv.
    final = dockerfile.rsplit("\nFROM ", 1)[1]
    assert "pip-ca" not in final and "COPY --from=build /opt/venv /opt/venv" in final
    assert runner.calls[-1][-4:] == ("up", "-d", "--no-deps", compose_files.DASHBOARD_SERVICE)


# --- the native dashboard: a recorded host process, stopped by `down` (real processes) -------


def native_resolved(project: Project, *sets: str) -> object:
    from helpers import free_port

    return resolve(project, platform="cpu", model="qwen3-0.6b",
                   overrides=[f"DASHBOARD_PORT={free_port()}", *sets])


@pytest.mark.slow  # a real dashboard process: about 3 s
def test_native_dashboard_runs_recorded_answers_and_down_ends_it(project: Project) -> None:
    import requests

    from vllmstack.core.runner import SubprocessRunner
    from vllmstack.runtime.native.dashboard import NativeDashboard
    from vllmstack.runtime.native.engine import NativeEngine
    from vllmstack.runtime.native.procs import ProcTable

    resolved = native_resolved(project)
    out = io.StringIO()
    dashboard = NativeDashboard(project, SubprocessRunner(), dict(os.environ), out=out)
    try:
        dashboard.up(resolved, "http://127.0.0.1:9")
        record = dashboard.running()
        assert record is not None
        port = resolved.get_int("DASHBOARD_PORT")  # type: ignore[attr-defined]
        health = requests.get(f"http://127.0.0.1:{port}/api/health", timeout=5).json()
        assert health["ok"] is True and health["engine_url"] == "http://127.0.0.1:9"
        assert f"dashboard at http://localhost:{port} (native process, pid {record.pid}" in out.getvalue()
        # `invoke status` lists it beside the engine, as compose lists its container.
        [member] = NativeEngine(project, SubprocessRunner()).members()
        assert (member["service"], member["pid"], member["state"]) == ("dashboard", record.pid, "running")
        assert member["status"].startswith("Up ") and "s, dashboard" in member["status"]
        dashboard.up(resolved, "http://127.0.0.1:9")
        assert "already running" in out.getvalue() and dashboard.running() == record
        # `invoke down` (another process: a fresh engine object) ends it through its record.
        down_out = io.StringIO()
        NativeEngine(project, SubprocessRunner(), out=down_out).remove()
        assert "stopped the native dashboard" in down_out.getvalue()
        assert not ProcTable().is_alive(record) and not dashboard.record_path.exists()
    finally:
        dashboard.down(quiet=True)


@pytest.mark.slow
def test_native_dashboard_that_exits_at_once_says_why(project: Project) -> None:
    from vllmstack.core.runner import SubprocessRunner
    from vllmstack.runtime.native.dashboard import NativeDashboard
    from vllmstack.runtime.native.procs import NativeError

    # Reachable from other machines without a token: the dashboard itself refuses to start.
    resolved = native_resolved(project, "DASHBOARD_BIND=0.0.0.0", "DASHBOARD_TOKEN=")
    dashboard = NativeDashboard(project, SubprocessRunner(), dict(os.environ), out=io.StringIO())
    with pytest.raises(NativeError, match=r"exited at once: error: the dashboard would listen on "
                                          r"0\.0\.0\.0"):
        dashboard.up(resolved, "http://127.0.0.1:9")
    assert dashboard.record() is None


# --- the host's fast checks as guards (issue 14 item 4: `up` runs doctor's fast subset) --------

HOST = DATA / "host"


def test_up_refuses_the_known_bad_amdgpu_dkms_unless_forced(project: Project) -> None:
    from test_doctor import ALICE, recorded_host

    resolved = resolve(project, platform="2xr9700", model="qwen3-0.6b",
                       overrides=["OTHER_ENGINE_PORTS="])
    root = HOST / "2xr9700-dkms"
    guards = check_guards(resolved, AmdSysfsProbe(root), own_engine_running=False,
                          port_probe=lambda h, p: False, host=recorded_host(root, ALICE))
    assert [g.code for g in guards] == ["host-amdgpu-dkms"]
    with pytest.raises(lifecycle.LifecycleError) as raised:
        print_guards(guards, force=False, out=io.StringIO())
    assert "amdgpu-dkms 6.16.13" in raised.value.cause
    assert raised.value.fix and "amdgpu/31.20" in raised.value.fix and "--force" in raised.value.fix
    out = io.StringIO()
    print_guards(guards, force=True, out=out)  # --force: loud, not blocking
    assert "WARNING --force: ignoring guard host-amdgpu-dkms" in out.getvalue()
    # Without a host given, the probe's own sysfs root is read (no runner: no program runs).
    probe_only = check_guards(resolved, AmdSysfsProbe(root), own_engine_running=False,
                              port_probe=lambda h, p: False)
    assert "host-amdgpu-dkms" in [g.code for g in probe_only]


def test_up_refuses_gfx1151_without_the_cwsr_fix(project: Project) -> None:
    from test_doctor import ALICE, recorded_host

    resolved = resolve(project, platform="strix-halo", model="qwen3-0.6b",
                       overrides=["OTHER_ENGINE_PORTS="])
    root = HOST / "strix-halo-no-cwsr"
    guards = check_guards(resolved, AmdSysfsProbe(root, unified_memory=True),
                          own_engine_running=False, port_probe=lambda h, p: False,
                          host=recorded_host(root, ALICE))
    assert [g.code for g in guards] == ["host-cwsr"]
    assert "6.18.4" in guards[0].fix and guards[0].overridable


def test_device_access_guards_the_runtime_that_opens_devices_as_the_user(project: Project) -> None:
    from test_doctor import ALICE_NO_GROUPS, recorded_host

    root = HOST / "r9700-igpu"
    for runtime, expected in (("native", ["host-devices"]), ("auto", [])):
        resolved = resolve(project, platform="r9700", model="qwen3-0.6b",
                           overrides=["OTHER_ENGINE_PORTS=", f"RUNTIME={runtime}"])
        guards = check_guards(resolved, AmdSysfsProbe(root), own_engine_running=False,
                              port_probe=lambda h, p: False,
                              host=recorded_host(root, ALICE_NO_GROUPS))
        assert [g.code for g in guards] == expected, runtime
    assert "sudo usermod -aG render alice" in check_guards(
        resolve(project, platform="r9700", model="qwen3-0.6b",
                overrides=["OTHER_ENGINE_PORTS=", "RUNTIME=auto"]),
        AmdSysfsProbe(root), own_engine_running=False, port_probe=lambda h, p: False,
        host=recorded_host(root, ALICE_NO_GROUPS), runtime="native")[0].fix


def test_nvidia_gpus_fewer_than_tensor_parallel_guard_up_and_fakes_add_none(project: Project) -> None:
    from vllmstack.runtime.gpu import NvidiaSmiProbe

    runner = RecordingRunner()
    runner.respond(["nvidia-smi"], Result((), 0, (HOST / "tools/nvidia-smi-detect-2xh200.txt")
                                          .read_text()))
    resolved = resolve(project, platform="2xnvidia", model="qwen3-0.6b",
                       overrides=["OTHER_ENGINE_PORTS=", "VLLM_TP=4"])
    guards = check_guards(resolved, NvidiaSmiProbe(runner), own_engine_running=False,
                          port_probe=lambda h, p: False)
    assert [g.code for g in guards] == ["host-gpus"]
    assert "VLLM_TP=4 needs 4 GPUs; 2 found" in guards[0].message
    # A probe standing in for the host (every other test here) adds no host guard.
    fake = check_guards(resolved, FakeProbe(), own_engine_running=False,
                        port_probe=lambda h, p: False)
    assert not [g for g in fake if g.code.startswith("host-")]


# --- one engine resident (issue 13 item 4) ---------------------------------------------------


def test_an_active_other_engine_service_refuses_and_names_the_stop_command(project: Project) -> None:
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b",
                       overrides=["OTHER_ENGINE_SERVICE=llama.service,ollama.service",
                                  "OTHER_ENGINE_PORTS="])
    runner = RecordingRunner()
    runner.respond(["systemctl", "is-active", "llama.service"], Result((), 0, "active\n"))
    runner.respond(["systemctl", "is-active", "ollama.service"], Result((), 3, "inactive\n"))
    guards = check_guards(resolved, FakeProbe(), own_engine_running=False, runner=runner,
                          port_probe=lambda h, p: False)
    assert [g.code for g in guards] == ["other-engine-service"]
    assert "llama.service is active" in guards[0].message
    assert "invoke up --stop-other" in guards[0].fix and "systemctl stop llama.service" in guards[0].fix
    # No systemctl on the host (the runner answers 127): nothing is active, nothing refused.
    missing = RecordingRunner()
    missing.respond(["systemctl"], Result((), 127, "", "systemctl: command not found"))
    assert check_guards(resolved, FakeProbe(), own_engine_running=False, runner=missing,
                        port_probe=lambda h, p: False) == []


def test_stop_other_stops_the_stacks_engine_and_the_service_before_starting(
    project: Project, monkeypatch: pytest.MonkeyPatch
) -> None:
    from helpers import free_port

    resolved = resolve(project, platform="cpu", model="qwen3-0.6b",
                       overrides=["OTHER_ENGINE_PORTS=", f"VLLM_PORT={free_port()}",
                                  "OTHER_ENGINE_SERVICE=llama.service"])
    runner = RecordingRunner()
    active = {"llama.service": True}
    runner.respond(["systemctl", "is-active", "llama.service"],
                   lambda argv: Result(argv, 0, "active\n" if active["llama.service"] else "inactive\n"))

    def stop(argv: tuple[str, ...]) -> Result:
        active["llama.service"] = False
        return Result(argv, 0)

    runner.respond(["systemctl", "stop", "llama.service"], stop)
    engine = DashboardEngine([EngineState(True, True, "running")], [])
    removed: list[bool] = []
    engine.remove = lambda: (removed.append(True),  # type: ignore[method-assign]
                             setattr(engine, "states", [EngineState(False, False, "missing")]))
    from vllmstack.serve.state import write_state
    write_state(project, {"profile": "qwen3.6-27b-gguf", "engine": "llamacpp", "argv": ["other"]})
    out = io.StringIO()
    stack = lifecycle.Stack(project, resolved, {}, runner, engine, FakeProbe(), out)
    monkeypatch.setattr(lifecycle, "wait_until_healthy", lambda *a, **k: 1.0)
    monkeypatch.setattr(lifecycle, "warm_up", lambda url, name: 0.1)
    monkeypatch.setattr(lifecycle, "health_status", lambda url: None)
    # Without --stop-other: refused, naming the running engine and both ways out.
    with pytest.raises(lifecycle.LifecycleError) as refused:
        lifecycle.up(stack, dashboard=False)
    assert "already runs llama.cpp with profile qwen3.6-27b-gguf" in refused.value.cause
    assert "--stop-other" in refused.value.fix and not removed
    assert any("llama.service is active" in d for d in refused.value.details)
    lifecycle.up(stack, dashboard=False, stop_other=True)
    text = out.getvalue()
    assert removed == [True] and ("systemctl", "stop", "llama.service") in runner.calls
    assert "stopping this stack's engine (profile qwen3.6-27b-gguf, llama.cpp)" in text
    assert "stopping the system service llama.service" in text
    # The stack's own engine went before the service was stopped, and both before the start.
    assert runner.calls.index(("systemctl", "stop", "llama.service")) > 0
