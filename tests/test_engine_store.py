"""install-engine through the build store: an index install lands in a content-keyed entry outside
the checkout and .cache/engines/NAME links to it, so a second checkout (a fresh clone) gets the
environment in seconds; a killed or failed install is built again, never linked; --force rebuilds
it unless an engine runs from it; what is not from the index (--wheels, --system-site-packages, a
built wheel) and an environment already installed inside the checkout stay where they were."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import ROOT, copy_project, wait_for

from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.core.store import STORE_VAR, Store, users
from vllmstack.runtime.native.install import (
    MANIFEST,
    EngineInstallError,
    InstallReport,
    engine_dir,
    engine_key,
    install_engine,
    list_engines,
    read_manifest,
    render_install,
)

PY = sys.executable
VERSION = "0.31.0"
PACKAGES = [{"name": "vllm", "version": VERSION}, {"name": "torch", "version": "2.13.0"}]


def host(pip_ok: bool = True) -> RecordingRunner:
    """venv and pip as they behave, wherever the environment is (the checkout or the store)."""
    runner = RecordingRunner()

    def answer(argv: tuple[str, ...]) -> Result:
        if argv[:2] == (PY, "-c"):
            return Result(argv, 0, "3.12\n")
        if argv[1:3] == ("-m", "venv"):
            (Path(argv[-1]) / "bin").mkdir(parents=True)
            (Path(argv[-1]) / "bin" / "python").write_text("")
            return Result(argv, 0)
        if argv[1:4] == ("-m", "pip", "install"):
            if not pip_ok:
                return Result(argv, 1, "", "No space left on device")
            (Path(argv[0]).parent / "vllm").write_text("#!/bin/sh\n")
            return Result(argv, 0)
        if argv[1:4] == ("-m", "pip", "list"):
            return Result(argv, 0, json.dumps(PACKAGES))
        return Result(argv, 0)

    runner.respond((), answer)
    return runner


def install(project: Project, runner: RecordingRunner, store: Path | None,
            **kw: object) -> tuple[InstallReport, str]:
    out = io.StringIO()
    environ = {STORE_VAR: str(store) if store else "off", "HOME": "/h"}
    report = install_engine(project, runner, version=VERSION, python=PY, environ=environ, out=out,
                            stream=False, **kw)
    return report, out.getvalue()


def entry_of(store: Path) -> Path:
    return Store(store).entry(engine_key("vllm", VERSION, "vllm", PY, (3, 12), {})).path


def pip_calls(runner: RecordingRunner) -> int:
    return sum(1 for c in runner.calls if c[1:4] == ("-m", "pip", "install"))


def test_the_environment_lands_in_the_store_and_a_second_clone_links_it(tmp_path: Path) -> None:
    store = tmp_path / "store"
    first = Project(copy_project(tmp_path / "clone1"))
    runner = host()
    report, _ = install(first, runner, store)
    entry = entry_of(store)
    link = engine_dir(first, VERSION)
    assert link.is_symlink() and link.resolve() == entry.resolve()
    assert pip_calls(runner) == 1 and read_manifest(entry) is not None
    assert report.store == str(entry)
    assert Store(store).entry(engine_key("vllm", VERSION, "vllm", PY, (3, 12), {})).is_complete()
    assert "kept in the build store" in render_install(report, first)
    assert [e.version for e in list_engines(first)] == [VERSION]  # `invoke engines` follows it
    # A fresh clone on the same machine: linked in a moment, pip never runs.
    second = Project(copy_project(tmp_path / "clone2"))
    again_runner = host()
    again, _ = install(second, again_runner, store)
    assert again.already and pip_calls(again_runner) == 0
    assert engine_dir(second, VERSION).resolve() == entry.resolve()
    assert "into the build store" in render_install(again, second)


def test_a_failed_install_is_not_linked_and_the_next_one_builds_it(tmp_path: Path) -> None:
    store, project = tmp_path / "store", Project(copy_project(tmp_path / "clone"))
    with pytest.raises(EngineInstallError, match="left unfinished"):
        install(project, host(pip_ok=False), store)
    assert not engine_dir(project, VERSION).exists() and not entry_of(store).exists()
    runner = host()
    report, _ = install(project, runner, store)
    assert not report.already and pip_calls(runner) == 1
    assert read_manifest(engine_dir(project, VERSION)) is not None


# install-engine in a process of its own, with a pip that writes half the environment, says so
# and hangs: killed there, as a closed terminal or CI's timeout kills it.
HALFWAY = textwrap.dedent(f"""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {str(ROOT / "tests")!r})
    from test_engine_store import host, install
    from vllmstack.core.paths import Project
    runner = host()
    usual = runner.responses[()]
    def answer(argv):
        if argv[1:4] == ("-m", "pip", "install"):
            (Path(argv[0]).parent.parent / "lib").mkdir()
            Path(sys.argv[3]).write_text("halfway")
            time.sleep(600)
        return usual(argv)
    runner.responses[()] = answer
    install(Project(Path(sys.argv[1])), runner, Path(sys.argv[2]))
""")


def test_an_install_killed_halfway_is_built_again_never_linked(tmp_path: Path) -> None:
    store, project = tmp_path / "store", Project(copy_project(tmp_path / "clone"))
    halfway = tmp_path / "halfway"
    child = subprocess.Popen([PY, "-c", HALFWAY, str(project.root), str(store), str(halfway)],
                             cwd=ROOT)
    try:
        wait_for(lambda: halfway.exists() or child.poll() is not None, timeout=60,
                 what="the install to get halfway")
        assert child.poll() is None, "the install ended before it got halfway"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    entry = entry_of(store)
    assert (entry / "lib").is_dir() and not (entry / MANIFEST).exists()  # half an environment
    assert not engine_dir(project, VERSION).exists()  # never linked
    runner = host()
    report, out = install(project, runner, store)
    assert pip_calls(runner) == 1 and not report.already
    assert not (entry / "lib").exists()  # what the killed install left went first
    assert "removing the unfinished store entry" in out
    assert read_manifest(engine_dir(project, VERSION)) is not None


def test_force_rebuilds_the_entry_unless_an_engine_runs_from_it(tmp_path: Path) -> None:
    store, project = tmp_path / "store", Project(copy_project(tmp_path / "clone"))
    install(project, host(), store)
    entry = entry_of(store)
    (entry / "serve.py").write_text("import time\ntime.sleep(600)\n")
    engine = subprocess.Popen([PY, str(engine_dir(project, VERSION) / "serve.py")])
    try:
        wait_for(lambda: engine.pid in users(entry), timeout=30, what="the engine's command line")
        with pytest.raises(EngineInstallError) as err:
            install(project, host(), store, force=True)
        assert f"pid {engine.pid} runs from {entry}" in err.value.cause
        assert "invoke down" in (err.value.fix or "")
        assert (entry / "serve.py").exists()  # nothing was removed under it
    finally:
        engine.kill()
        engine.wait()
    runner = host()
    report, _ = install(project, runner, store, force=True)
    assert pip_calls(runner) == 1 and report.replaced
    assert not (entry / "serve.py").exists() and read_manifest(entry) is not None


def test_an_environment_installed_in_the_checkout_and_non_index_installs_stay_there(
        tmp_path: Path) -> None:
    store, project = tmp_path / "store", Project(copy_project(tmp_path / "clone"))
    install(project, host(), None)  # VLLMSTACK_STORE=off: the checkout, as before the store
    folder = engine_dir(project, VERSION)
    assert folder.is_dir() and not folder.is_symlink()
    runner = host()
    report, _ = install(project, runner, store)
    assert report.already and pip_calls(runner) == 0 and not folder.is_symlink()
    assert not store.exists()
    # --system-site-packages depends on another interpreter's packages: never shared.
    other = Project(copy_project(tmp_path / "clone2"))
    base = host()
    base.respond([PY, "-c"], lambda argv: Result(argv, 0, json.dumps(
        {"torch": "2.13.0", "vllm": None, "site": [], "venv": False}) if "site" in argv[2] else "3.12\n"))
    install(other, base, store, system_site_packages=True)
    assert not engine_dir(other, VERSION).is_symlink() and not store.exists()


def test_dry_run_names_the_store_entry_and_changes_nothing(tmp_path: Path) -> None:
    store, project = tmp_path / "store", Project(copy_project(tmp_path / "clone"))
    runner = RecordingRunner(dry_run=True)
    runner.respond([PY, "-c"], Result((), 0, "3.12\n"))
    report, out = install(project, runner, store)
    assert f"would install into the build store entry {entry_of(store)}" in out
    assert not store.exists() and not engine_dir(project, VERSION).exists()
    assert any(c[1:3] == ("-m", "venv") and c[-1] == str(entry_of(store)) for c in runner.calls)
    assert report.dry_run
