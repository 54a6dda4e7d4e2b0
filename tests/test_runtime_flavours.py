"""The runtime differences (vllmstack/runtime/flavours.py) as the compose runtime applies them:
the argv each runtime gets, what a status reads from each engine, and the rendered host keys.
The integration suite (tests/integration/test_lifecycle_docker.py) runs the same on real engines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllmstack.config.profiles import resolve
from vllmstack.config.vllm_args import build_serve_argv
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.runtime import compose, compose_files, engine_env, flavours

LEGACY_VERSION = ("['podman', '--version', '']\nusing podman version: 4.3.1\n"
                  "podman-composer version  1.0.3\npodman --version \npodman version 4.3.1\n")


def engine_for(project: Project, runner: RecordingRunner, cli: compose.ComposeCli,
               environ: dict[str, str] | None = None) -> compose.ComposeEngine:
    return compose.ComposeEngine(cli, runner, "proj", compose_files.compose_files(project),
                                 project.generated / "compose.env", project=project,
                                 environ=environ or {"PATH": "/usr/bin"})


def legacy_podman(runner: RecordingRunner) -> compose.ComposeCli:
    runner.respond(["podman-compose", "version"], Result((), 0, LEGACY_VERSION, ""))
    return compose.detect_compose(runner, "docker", "podman")


def test_podman_compose_version_decides_its_arguments() -> None:
    runner = RecordingRunner()
    cli = legacy_podman(runner)
    assert cli.base == ("podman-compose",) and cli.traits is flavours.PODMAN_LEGACY
    modern = RecordingRunner()
    modern.respond(["podman-compose", "version"], Result((), 0, "podman-compose version 1.2.0\n", ""))
    assert compose.detect_compose(modern, "docker", "podman").traits is flavours.PODMAN
    # Without podman-compose, Podman 4.7+'s own `podman compose`.
    wrapper = RecordingRunner()
    wrapper.respond(["podman-compose"], Result((), 127, "", "not found"))
    assert compose.detect_compose(wrapper, "docker", "podman").base == ("podman", "compose")


def test_legacy_podman_compose_gets_the_env_in_its_environment(project: Project) -> None:
    runner = RecordingRunner()
    engine = engine_for(project, runner, legacy_podman(runner))
    project.generated.mkdir(parents=True, exist_ok=True)
    # What compose_files writes (quoted: a space and a '#'), read back exactly.
    (project.generated / "compose.env").write_text(
        "# header\nVLLMSTACK_HF_CACHE_DIR='/c/cache dir #1/hf'\nVLLMSTACK_VLLM_PORT=8000\n")
    (project.generated / "compose.override.yaml").write_text(
        "services:\n  vllm:\n    group_add: ['44', '992']\n")
    engine.remove()
    down = next(call for call in runner.calls if "down" in call)
    assert "--env-file" not in down and "--profile" not in down and "--remove-orphans" not in down
    env = runner.envs[runner.calls.index(down)]
    assert env is not None and env["VLLMSTACK_HF_CACHE_DIR"] == "/c/cache dir #1/hf"
    assert env["PATH"] == "/usr/bin"
    # podman-compose 1.0.3 leaves the project network behind.
    assert runner.calls[-1] == ("podman", "network", "rm", "proj_default")
    # ipc (compose.yaml) and group_add (override) are dropped by 1.0.3: they go onto podman run.
    runner.respond(["podman", "ps"], Result((), 0, json.dumps(
        [{"Names": ["proj_vllm_1"], "Labels": {"com.docker.compose.service": "vllm"},
          "State": "running", "Status": "Up", "Image": "x"}]), ""))
    engine.start()
    up = next(call for call in runner.calls if "up" in call)
    assert "--podman-run-args=--ipc=host --group-add=44 --group-add=992" in up


def test_podman_never_sees_a_docker_config_folder_without_config_json(
    project: Project, tmp_path: Path
) -> None:
    runner = RecordingRunner()
    plugins_only = tmp_path / "docker-config"
    plugins_only.mkdir()
    environ = {"PATH": "/usr/bin", "DOCKER_CONFIG": str(plugins_only)}
    engine = engine_for(project, runner, legacy_podman(runner), environ)
    engine.stop()
    assert "DOCKER_CONFIG" not in (runner.envs[-1] or {}) and runner.envs[-1]["PATH"] == "/usr/bin"
    (plugins_only / "config.json").write_text("{}")
    engine.stop()
    assert runner.envs[-1]["DOCKER_CONFIG"] == str(plugins_only)  # type: ignore[index]
    docker = engine_for(project, runner, compose.ComposeCli("compose", ("docker", "compose"), "docker"),
                        {"DOCKER_CONFIG": str(tmp_path)})
    docker.stop()
    assert runner.envs[-1] is None  # docker: inherited as it is


def test_docker_compose_reads_the_env_file_and_knows_profiles(project: Project) -> None:
    runner = RecordingRunner()
    engine = engine_for(project, runner, compose.ComposeCli("compose", ("docker", "compose"), "docker"))
    project.generated.mkdir(parents=True, exist_ok=True)
    (project.generated / "compose.env").write_text("VLLMSTACK_VLLM_PORT=8000\n")
    engine.remove()
    down = runner.calls[-1]
    assert down[-6:] == ("--profile", "dashboard", "down", "--remove-orphans", "-t", "20")
    assert "--env-file" in down and runner.envs[-1] is None


def test_legacy_podman_start_that_created_no_running_container_fails(project: Project) -> None:
    runner = RecordingRunner()
    engine = engine_for(project, runner, legacy_podman(runner))
    # podman-compose 1.0.3 exits 0 although `podman run` failed; the container stays "created".
    runner.respond(["podman-compose"], Result((), 0, "", "Error: runc: runc create failed"))
    runner.respond(["podman", "ps"], Result((), 0, json.dumps(
        [{"Names": ["proj_vllm_1"], "Labels": {"com.docker.compose.service": "vllm"},
          "State": "created", "Status": "Created", "Image": "x"}]), ""))
    with pytest.raises(compose.ComposeError, match="runc create failed"):
        engine.start()


def test_exec_and_logs_per_runtime(project: Project) -> None:
    runner = RecordingRunner()
    legacy = engine_for(project, runner, legacy_podman(runner))
    # podman-compose 1.0.3 exits 0 whatever the command did: podman exec with the container name.
    assert legacy.exec_command(["true"], tty=False)[:3] == ["podman", "exec", "-i"]
    assert legacy.exec_command(["true"], tty=False)[3] == "proj_vllm_1"
    assert legacy.log_command(tail=5, follow=True, service="dashboard") == [
        "podman", "logs", "--tail", "5", "-f", "proj_dashboard_1"]
    v2 = engine_for(project, runner, compose.ComposeCli("compose", ("docker", "compose"), "docker"))
    assert v2.container_name("vllm") == "proj-vllm-1"
    argv = v2.exec_command(["true"], tty=False)
    assert argv[:3] == ["docker", "compose", "-p"] and "exec" in argv


def test_status_reads_both_ps_formats(project: Project) -> None:
    docker_runner = RecordingRunner()
    docker_runner.respond(["docker", "ps"], Result((), 0, json.dumps(
        {"Names": "p-vllm-1", "Labels": "a=b,com.docker.compose.service=vllm", "State": "running",
         "Status": "Up 3 seconds", "Image": "sim"}) + "\n", ""))
    v1 = engine_for(project, docker_runner, compose.ComposeCli("compose-v1", ("docker-compose",), "docker"))
    assert v1.members() == [{"name": "p-vllm-1", "service": "vllm", "state": "running",
                             "status": "Up 3 seconds", "image": "sim"}]
    podman_runner = RecordingRunner()
    cli = legacy_podman(podman_runner)
    podman_runner.respond(["podman", "ps"], Result((), 0, json.dumps([
        {"Names": ["p_vllm_1"], "Labels": {"com.docker.compose.service": "vllm"},
         "State": "running", "Status": "Up 3 seconds ago", "Image": "localhost/sim"}], indent=2), ""))
    members = engine_for(project, podman_runner, cli).members()
    assert members == [{"name": "p_vllm_1", "service": "vllm", "state": "running",
                        "status": "Up 3 seconds ago", "image": "localhost/sim"}]
    assert podman_runner.calls[-1][-2:] == ("--format", "json")


def render(project: Project, runtime: str, host: flavours.Host, platform: str = "cpu"
           ) -> dict[str, dict[str, object]]:
    resolved = resolve(project, platform=platform, model="qwen3-0.6b")
    paths = engine_env.StackPaths(Path("/h/hf"), Path("/h/engine"), None)
    override, _ = compose_files.build_override(
        project, resolved, build_serve_argv(resolved), runtime=runtime,
        ids=engine_env.HostIds(1000, 1000, 44, 992), paths=paths, package_dir=None, host=host)
    return override["services"]  # type: ignore[no-any-return]


def test_host_keys_per_runtime(project: Project) -> None:
    sandbox = flavours.Host(cap_sys_resource=False, nofile=20000, nproc=96364)
    podman = render(project, "podman", sandbox)
    # Podman 4.3 would raise the limits past what this caller may set; Docker inherits them.
    assert podman["vllm"]["ulimits"] == {"nofile": 20000, "nproc": 32768}
    assert podman["dashboard"]["ulimits"] == {"nofile": 20000, "nproc": 32768}
    assert "ulimits" not in render(project, "compose", sandbox)["vllm"]
    assert "ulimits" not in render(project, "podman", flavours.Host())["vllm"]
    rootless = render(project, "podman", flavours.Host(rootless=True, selinux=True))
    assert rootless["vllm"]["userns_mode"] == "keep-id"
    assert rootless["dashboard"]["security_opt"] == ["label=disable"]
    assert "userns_mode" not in render(project, "compose", flavours.Host(rootless=True))["vllm"]
    # AMD already disables labelling: one entry, not two.
    amd = render(project, "podman", flavours.Host(selinux=True), platform="2xr9700")
    assert amd["vllm"]["security_opt"] == ["label=disable"]


def test_probe_host_reads_caps_and_selinux(tmp_path: Path) -> None:
    (tmp_path / "status").write_text("Name:\tx\nCapEff:\t000001fffeffffff\n")
    host = flavours.probe_host(tmp_path, tmp_path / "no-selinux")
    assert host.cap_sys_resource is False and host.selinux is False
    (tmp_path / "status").write_text("CapEff:\t000001ffffffffff\n")
    (tmp_path / "enforce").write_text("1")
    host = flavours.probe_host(tmp_path, tmp_path / "enforce")
    assert host.cap_sys_resource is True and host.selinux is True
