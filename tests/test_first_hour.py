"""A newcomer's first hour (issue 23): the small things that went wrong on a fresh clone.

History in an ignored results/ folder (and what older versions left in benchmarks/ moved there
without losing a line), `.venv/` ignored, `make-model`'s next step runnable as printed, and
`up --dry-run` naming a missing image as missing."""

from __future__ import annotations

import io
import os
import subprocess
from pathlib import Path

from helpers import ROOT

from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project, results_folder
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.models.tiny import MadeModel, render_made
from vllmstack.serve import lifecycle


def test_history_lives_in_an_ignored_results_folder() -> None:
    for path in (".venv/bin/python", "results/bench_history.jsonl", "results/bench-vs-history.md",
                 "results/burn-latest.md"):
        ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, check=False)
        assert ignored.returncode == 0, f"{path} would leave `git status` dirty"


def test_old_history_in_benchmarks_moves_to_results_without_losing_a_line(tmp_path: Path) -> None:
    project = Project(tmp_path)
    old = project.benchmarks
    old.mkdir()
    (old / "bench_history.jsonl").write_text('{"id": "old-1"}\n{"id": "old-2"}')  # no final \n
    (old / "bench-vs-results.md").write_text("old latest\n")
    (old / "bench-vs-history.md").write_text("## old run\n")
    (old / "burn-2026-11-29.md").write_text("old burn\n")
    (old / "bench_c1_agreement.py").write_text("# a tracked script stays\n")
    (old / "2026-11-30-h200-real-engine.md").write_text("a tracked report stays\n")
    results = project.results
    results.mkdir()
    (results / "bench_history.jsonl").write_text('{"id": "new-1"}\n')
    (results / "bench-vs-results.md").write_text("new latest\n")

    assert results_folder(project) == results
    lines = (results / "bench_history.jsonl").read_text().splitlines()
    assert lines == ['{"id": "old-1"}', '{"id": "old-2"}', '{"id": "new-1"}']  # oldest first
    assert (results / "bench-vs-results.md").read_text() == "new latest\n"
    assert (results / "bench-vs-results.md.from-benchmarks").read_text() == "old latest\n"
    assert (results / "bench-vs-history.md").read_text() == "## old run\n"
    assert (results / "burn-2026-11-29.md").read_text() == "old burn\n"
    assert sorted(p.name for p in old.iterdir()) == ["2026-11-30-h200-real-engine.md",
                                                     "bench_c1_agreement.py"]
    assert results_folder(project) == results  # a second call has nothing left to move


def test_make_model_names_the_runtime_that_works_on_a_fresh_machine() -> None:
    made = MadeModel("tiny", "vllmstack/tiny-qwen3", Path("/x"), 4200, 3_000_000, 4_000_000,
                     2.0, made=True)
    assert "invoke up --runtime native --platform cpu --model tiny" in render_made(made)


def test_up_dry_run_with_a_missing_image_says_it_is_missing_and_how_to_build_it(
        project: Project) -> None:
    resolved = resolve(project, platform="cpu", model="tiny",
                       overrides=["OTHER_ENGINE_PORTS=", f"HOST_CACHE_DIR={project.root}/cache"])
    runner = RecordingRunner(dry_run=True)
    runner.respond(["docker", "image", "inspect"], Result((), 1, "", "Error: No such image"))
    out = io.StringIO()
    stack = lifecycle.open_stack(project, resolved, {}, runner, runtime="compose", out=out)
    lifecycle.up(stack, dry_run=True, dashboard=False)
    said = out.getvalue()
    assert "localhost/vllm-cpu:latest does not exist on this host" in said
    assert "invoke build --platform cpu" in said
    assert "vllm-package label" not in said  # the old, misleading reason


def test_bench_vs_picks_the_platform_every_target_is_made_for(project: Project) -> None:
    from vllmstack.bench.target import TargetError, shared_platform

    # .env.example selects 2xr9700; tiny and tiny-gguf are made for cpu only.
    chosen, note = shared_platform(project, {}, ["tiny", "tiny-gguf"], None)
    assert chosen == "cpu" and note and "2xr9700" in note
    assert shared_platform(project, {}, ["qwen3-0.6b"], None) == (None, None)  # .env's fits
    assert shared_platform(project, {}, ["tiny"], "nvidia") == ("nvidia", None)  # given wins
    try:
        shared_platform(project, {}, ["tiny", "qwen3.8-27b"], None)
    except TargetError as exc:
        assert "share: none" in exc.cause and exc.fix
    else:
        raise AssertionError("profiles made for no common platform must be refused")
    try:
        shared_platform(project, {}, ["qwen3.6-27b-gguf", "qwen3.5-9b-gguf"], None)
    except TargetError as exc:
        assert "--platform" in (exc.fix or "") and "nvidia" in exc.cause
    else:
        raise AssertionError("several shared platforms, none .env's: ask which")


def test_engine_temp_files_and_compile_caches_stay_in_the_stacks_cache(project: Project) -> None:
    """Issue 23: every vLLM start left /tmp/vllm_dist_<hex>, and the first boot wrote 149 MB of
    precompiled headers to /tmp/torchinductor_root (both from tempfile.gettempdir())."""
    import yaml

    from vllmstack.runtime import engine_env
    from vllmstack.runtime.native.command import native_serve_command

    environ = {"HOME": str(project.root / "home")}
    resolved = resolve(project, platform="cpu", model="tiny", environ=environ)
    command = native_serve_command(project, resolved, environ)
    cache = project.root / "home" / ".cache" / "vllmstack-engine" / "native" / "vllm-0.32.0+cpu"
    for key, sub in (("TMPDIR", "tmp"), ("TORCHINDUCTOR_CACHE_DIR", "torchinductor"),
                     ("TRITON_CACHE_DIR", "triton"), ("VLLM_CACHE_ROOT", "vllm")):
        assert command.env[key] == str(cache / sub)
        assert cache / sub in command.cache_dirs  # made before the start: else /tmp again
    # Its unix sockets: relative to the engine's working folder (the checkout), so that a deep
    # cache folder cannot push a socket's path past 107 bytes (a real boot failed so).
    assert command.env["VLLM_RPC_BASE_PATH"] == "generated/native/ipc"
    assert project.generated / "native" / "ipc" in command.cache_dirs
    gguf = native_serve_command(project, resolve(project, platform="cpu", model="tiny-gguf",
                                                 environ=environ), environ)
    assert gguf.env["TMPDIR"].startswith(str(cache.parent)) and \
        Path(gguf.env["TMPDIR"]) in gguf.cache_dirs
    # The container runtimes: the same folder names under the mounted engine cache.
    service = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["vllm"]
    assert service["environment"]["TMPDIR"] == "/cache/engine/tmp"
    assert "tmp" in engine_env.ENGINE_CACHE_SUBDIRS and "tmp" in engine_env.CLEARED_SUBDIRS
    # clear-caches empties them, the models stay.
    paths = engine_env.stack_paths(resolved, environ)
    (paths.engine_cache / "tmp").mkdir(parents=True)
    (paths.engine_cache / "tmp" / "vllm_dist_0").write_text("x")
    (cache / "tmp").mkdir(parents=True)
    (paths.hf_cache / "hub").mkdir(parents=True)
    done = engine_env.clear_engine_caches(paths, dry_run=False)
    assert any(line.endswith("/tmp") for line in done) and any("native" in line for line in done)
    assert not (paths.engine_cache / "tmp").exists() and not cache.exists()
    assert (paths.hf_cache / "hub").is_dir()


def test_every_dashboard_reads_the_history_from_results(project: Project) -> None:
    """The native side-car, `invoke dashboard` and compose.yaml's mount: results/, not benchmarks/."""
    import yaml

    from vllmstack.dashboard.__main__ import settings_for_stack
    from vllmstack.runtime.native.dashboard import NativeDashboard

    resolved = resolve(project, platform="cpu", model="tiny")
    argv = NativeDashboard(project, RecordingRunner()).argv(resolved, "http://127.0.0.1:1")
    assert argv[argv.index("--history-dir") + 1] == str(project.results)
    assert settings_for_stack(project, {}).history_dir == project.results
    volumes = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["dashboard"]["volumes"]
    assert "./results:/app/benchmarks" in volumes


def test_down_removes_the_sockets_an_engine_left(project: Project) -> None:
    """vLLM leaves its ZMQ sockets behind (seven per boot, seen on the real CPU engine)."""
    import socket

    from vllmstack.core.runner import SubprocessRunner
    from vllmstack.runtime.native.engine import NativeEngine

    folder = project.generated / "native" / "ipc"
    folder.mkdir(parents=True)
    cwd = os.getcwd()
    os.chdir(project.root)  # a short, relative socket path, as the engine binds it
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind("generated/native/ipc/3898470a-54bf-4d41-9c4f-d88415211022")
    finally:
        os.chdir(cwd)
    (folder / "keep.txt").write_text("not a socket")
    NativeEngine(project, SubprocessRunner(), out=io.StringIO()).remove()
    assert [p.name for p in folder.iterdir()] == ["keep.txt"]
