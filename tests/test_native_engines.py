"""`invoke install-engine`: the commands it runs, the wheel-folder checks, and its refusals."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.runtime.native.install import (
    EngineInstallError,
    InstallReport,
    engine_dir,
    install_engine,
    parse_wheel,
    read_manifest,
    render_install,
    wheel_fits_python,
)
from vllmstack.runtime.native.procs import ProcTable

PY = "/usr/bin/python3.12"
PACKAGES = [{"name": "vllm", "version": "0.31.0"}, {"name": "torch", "version": "2.13.0"},
            {"name": "Flash_Attn", "version": "2.8.0"}, {"name": "requests", "version": "2.32"}]


def fake_host(project: Project, python: str = "3.12", pip_ok: bool = True) -> RecordingRunner:
    """A runner whose venv/pip calls leave what the real ones leave behind."""
    runner = RecordingRunner()
    runner.respond([PY, "-c"], Result((), 0, python + "\n"))

    def make_venv(argv: tuple[str, ...]) -> Result:
        (Path(argv[-1]) / "bin").mkdir(parents=True)
        (Path(argv[-1]) / "bin" / "python").write_text("")
        return Result(argv, 0)

    def pip_install(argv: tuple[str, ...]) -> Result:
        if not pip_ok:
            return Result(argv, 1)
        (Path(argv[0]).parent / "vllm").write_text("#!/bin/sh\n")
        return Result(argv, 0)

    runner.respond([PY, "-m", "venv"], make_venv)
    folder = engine_dir(project, "0.31.0")
    runner.respond([str(folder / "bin/python"), "-m", "pip", "install"], pip_install)
    runner.respond([str(folder / "bin/python"), "-m", "pip", "list"],
                   Result((), 0, json.dumps(PACKAGES)))
    return runner


def install(project: Project, runner: RecordingRunner, **kw: object) -> tuple[
        InstallReport, str]:
    out = io.StringIO()
    args: dict[str, object] = {"version": "0.31.0", "python": PY, "environ": {"HOME": "/h"},
                               "out": out, **kw}
    report = install_engine(project, runner, **args)  # type: ignore[arg-type]
    return report, out.getvalue()


def test_installs_the_pinned_version_from_the_index_and_records_it(project: Project) -> None:
    runner = fake_host(project)
    report, _ = install(project, runner)
    folder = project.cache / "engines" / "vllm-0.31.0"
    assert runner.calls[1] == (PY, "-m", "venv", str(folder))
    assert runner.calls[2] == (str(folder / "bin/python"), "-m", "pip", "install",
                               "--disable-pip-version-check", "vllm==0.31.0")
    # pip runs with user-site packages off (they would shadow the environment's own).
    assert runner.envs[2] is not None and runner.envs[2]["PYTHONNOUSERSITE"] == "1"
    manifest = read_manifest(folder)
    assert manifest is not None
    assert (manifest["installed"], manifest["source"], manifest["python"]) == (
        "0.31.0", "package index", "3.12")
    assert manifest["packages"]["flash-attn"] == "2.8.0"
    text = render_install(report, project)
    assert "installed vllm 0.31.0 into .cache/engines/vllm-0.31.0" in text
    assert "torch 2.13.0" in text and "flash-attn 2.8.0" in text and "packages: 4" in text
    assert report.as_json()["installed"] == {"vllm": "0.31.0", "torch": "2.13.0",
                                             "flash-attn": "2.8.0"}


def test_a_second_install_is_refused_without_force_and_replaces_with_it(project: Project) -> None:
    install(project, fake_host(project))
    runner = fake_host(project)
    with pytest.raises(EngineInstallError) as err:
        install(project, runner)
    assert "vllm 0.31.0 is already installed in" in err.value.cause
    assert "package index" in err.value.cause and err.value.fix is not None
    assert "--force" in err.value.fix
    assert not any("venv" in call for call in runner.calls)
    stale = engine_dir(project, "0.31.0") / "lib" / "leftover.py"
    stale.parent.mkdir(parents=True)
    stale.write_text("")
    report, out = install(project, fake_host(project), force=True)
    assert report.replaced and "--force: removing the existing environment" in out
    assert not stale.exists()  # a clean environment, not one layered over the old


def test_force_refuses_to_replace_the_environment_of_a_running_engine(project: Project) -> None:
    install(project, fake_host(project))
    folder = engine_dir(project, "0.31.0")
    me = ProcTable().get(os.getpid())
    assert me is not None
    record = project.generated / "native" / "engine.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"pid": os.getpid(), "start_ticks": me.start_ticks,
                                  "boot_id": ProcTable().boot_id(), "marker": "m" * 32,
                                  "argv": [str(folder / "bin/vllm"), "serve", "m"]}))
    with pytest.raises(EngineInstallError) as err:
        install(project, fake_host(project), force=True)
    assert f"(pid {os.getpid()}) runs from" in err.value.cause
    assert err.value.fix == "stop it first: invoke down"
    assert read_manifest(folder) is not None


def test_an_unfinished_environment_is_started_over(project: Project) -> None:
    runner = fake_host(project, pip_ok=False)
    with pytest.raises(EngineInstallError) as err:
        install(project, runner)
    assert "left unfinished" in err.value.cause
    report, out = install(project, fake_host(project))
    assert "removing the unfinished environment" in out and not report.replaced


def wheel_folder(tmp_path: Path, *names: str) -> Path:
    folder = tmp_path / "wheels"
    folder.mkdir(parents=True)
    for name in names:
        (folder / name).write_bytes(b"")
    return folder


ROCM_WHEEL = "vllm-0.31.0+rocm7.2.gfx1201-cp312-cp312-linux_x86_64.whl"


def test_wheels_install_offline_from_the_folder(project: Project, tmp_path: Path) -> None:
    folder = wheel_folder(tmp_path, ROCM_WHEEL, "torch-2.13.0+rocm7.2-cp312-cp312-linux_x86_64.whl")
    runner = fake_host(project)
    report, _ = install(project, runner, wheels=folder)
    pip = runner.calls[2]
    assert pip[-4:] == ("--no-index", "--find-links", str(folder), "vllm==0.31.0")
    assert report.source == f"wheels in {folder}"
    manifest = read_manifest(engine_dir(project, "0.31.0"))
    assert manifest is not None and manifest["wheel"] == ROCM_WHEEL
    runner = fake_host(project)
    install(project, runner, wheels=folder, index_deps=True, force=True)
    assert "--no-index" not in runner.calls[2] and "--find-links" in runner.calls[2]


def test_wheel_folder_problems_are_named_before_anything_is_created(project: Project,
                                                                    tmp_path: Path) -> None:
    cases = [
        (wheel_folder(tmp_path / "a", "torch-2.13.0-cp312-cp312-linux_x86_64.whl"), "3.12",
         "has no vllm wheel (torch-2.13.0", "put the vllm-*.whl"),
        (wheel_folder(tmp_path / "b", "vllm-0.30.1+rocm7.2-cp312-cp312-linux_x86_64.whl"), "3.12",
         "has vllm 0.30.1+rocm7.2, not 0.31.0", "--version 0.30.1"),
        (wheel_folder(tmp_path / "c", ROCM_WHEEL), "3.11",
         "is for CPython 3.12, but the environment's Python is 3.11", "--python"),
        (tmp_path / "nowhere", "3.12", "is not a folder", "the folder that holds"),
    ]
    for folder, python, cause, fix in cases:
        runner = fake_host(project, python=python)
        with pytest.raises(EngineInstallError) as err:
            install(project, runner, wheels=folder)
        assert cause in err.value.cause and err.value.fix is not None and fix in err.value.fix
        assert len(runner.calls) <= 1  # only the interpreter was asked its version
    assert not engine_dir(project, "0.31.0").exists()


def test_python_tags_accepted_like_pip_does() -> None:
    def fits(name: str, python: tuple[int, int]) -> bool:
        wheel = parse_wheel(Path(name))
        assert wheel is not None and wheel.name == "vllm"
        return wheel_fits_python(wheel, python)

    assert fits("vllm-0.31.0-cp38-abi3-manylinux1_x86_64.whl", (3, 12))
    assert not fits("vllm-0.31.0-cp313-abi3-manylinux1_x86_64.whl", (3, 12))
    assert fits("vllm-0.31.0-py3-none-any.whl", (3, 11))
    assert fits("vllm-0.31.0-py2.py3-none-any.whl", (3, 11))
    assert fits("vllm-0.31.0-cp312-cp312-linux_x86_64.whl", (3, 12))
    assert not fits("vllm-0.31.0-cp312-cp312-linux_x86_64.whl", (3, 10))
    assert fits("vllm-0.31.0-1build-cp310-cp310-linux_x86_64.whl", (3, 10))


def test_bad_engine_version_or_interpreter_are_refused(project: Project) -> None:
    for version in ("../../etc", "--index-url=http://x", "", "latest"):
        with pytest.raises(EngineInstallError):
            install(project, fake_host(project), version=version)
    with pytest.raises(EngineInstallError) as err:
        install(project, fake_host(project), engine="sglang")
    assert "unknown engine 'sglang'" in err.value.cause
    broken = RecordingRunner()
    broken.respond([PY, "-c"], Result((), 127, "", "python3.12: command not found"))
    with pytest.raises(EngineInstallError) as err:
        install(project, broken)
    assert "not a working Python" in err.value.cause and "command not found" in err.value.cause


def test_dry_run_creates_nothing(project: Project) -> None:
    runner = RecordingRunner(dry_run=True)
    runner.respond([PY, "-c"], Result((), 0, "3.12\n"))
    report, out = install(project, runner)
    assert report.dry_run and "(dry run) installing vllm==0.31.0" in out
    assert render_install(report, project).startswith("(dry run) would install vllm 0.31.0")
    assert [c[1:3] for c in runner.calls[1:3]] == [("-m", "venv"), ("-m", "pip")]
    assert not engine_dir(project, "0.31.0").exists()
