"""`invoke install-engine --platform cpu --from-image IMAGE` / `--wheel FILE`: the wheel that
`invoke build --platform cpu` compiled, installed as a native engine environment."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.image.cpu import KERNELS_SCRIPT
from vllmstack.runtime.native.cpu_build import (
    REPACK_SCRIPT,
    BuiltWheel,
    CpuBuildError,
    read_built_file,
    read_built_image,
)
from vllmstack.runtime.native.install import (
    EngineInstallError,
    InstallReport,
    engine_dir,
    install_engine,
    read_manifest,
    render_install,
)
from vllmstack.runtime.native.wheels import WheelError

PY = "/usr/bin/python3.11"
IMAGE = "localhost/vllm-cpu:src"
VERSION = "0.31.0+cpu.p8636d551"
WHEEL = f"vllm-{VERSION}-cp311-cp311-linux_x86_64.whl"
PATCHES = ["0100-rocm-skip-torch-symbol-promotion.patch", "0200-cpu-requirements-from-the-index.patch"]
LABELS = {"vllmstack.vllm-wheel-version": VERSION, "vllmstack.target": "cpu",
          "vllmstack.torch": "2.13.0+cpu", "vllmstack.patch-list.vllm": ",".join(PATCHES),
          "vllmstack.patches.vllm": "8636d5513a1fd4a02dd094c0b6ed570b63931204c82898bd9cd425d0dbf178ba"}


def inspect_answer(labels: dict[str, str] | None) -> Result:
    return Result((), 0, f"sha256:feed {json.dumps(labels)}\n")


def built_host(project: Project, labels: dict[str, str] | None = None, packed: str = VERSION,
               start_rc: int = 0) -> RecordingRunner:
    """The container engine, venv and pip answered as the real ones answer."""
    runner = RecordingRunner()
    runner.respond([PY, "-c"], Result((), 0, "3.11\n"))
    runner.respond(["docker", "image", "inspect"], inspect_answer(LABELS if labels is None else labels))
    name = f"vllm-{packed}-cp311-cp311-linux_x86_64.whl"
    runner.respond(["docker", "start"], Result((), start_rc, json.dumps(
        {"wheel": name, "version": packed, "files": 3}) + "\n", "vllmstack: vllm/x.py differs"))

    def copy(argv: tuple[str, ...]) -> Result:
        if argv[2].endswith(":/tmp/vllmstack-wheel/."):  # out of the container: the wheel
            with zipfile.ZipFile(Path(argv[3]) / name, "w") as wheel:
                wheel.writestr("vllm/__init__.py", "")
        return Result(argv, 0)

    runner.respond(["docker", "cp"], copy)
    folder = engine_dir(project, VERSION)
    venv_py = str(folder / "bin/python")

    def make_venv(argv: tuple[str, ...]) -> Result:
        (Path(argv[-1]) / "bin").mkdir(parents=True)
        return Result(argv, 0)

    def pip_install(argv: tuple[str, ...]) -> Result:
        if argv[-1].endswith(".whl"):  # the wheel brings the `vllm` console script
            (folder / "bin" / "vllm").write_text("#!/bin/sh\n")
        return Result(argv, 0)

    runner.respond([PY, "-m", "venv"], make_venv)
    runner.respond([venv_py, "-m", "pip", "install"], pip_install)
    runner.respond([venv_py, "-c"], Result((), 0, json.dumps({"device": "cpu", "libraries": []})))
    runner.respond([venv_py, "-m", "pip", "list"], Result((), 0, json.dumps(
        [{"name": "vllm", "version": VERSION}, {"name": "torch", "version": "2.13.0+cpu"}])))
    return runner


def install_built(project: Project, runner: RecordingRunner,
                  built: BuiltWheel | None = None) -> tuple[InstallReport, str]:
    out = io.StringIO()
    built = built or read_built_image(runner, "docker", IMAGE)
    report = install_engine(project, runner, version=built.version, python=PY, environ={"HOME": "/h"},
                            out=out, built=built, docker="docker")
    return report, out.getvalue()


def test_from_image_copies_the_wheel_out_and_installs_it_after_its_torch(project: Project) -> None:
    runner = built_host(project)
    report, out = install_built(project, runner)
    folder = project.cache / "engines" / f"vllm-{VERSION}"
    wheel = project.cache / "built-wheels" / WHEEL
    docker = [c for c in runner.calls if c[0] == "docker"]
    name = docker[1][3]
    assert docker[0][:3] == ("docker", "image", "inspect") and docker[0][-1] == IMAGE
    # A container that never gets a network, fed the packing script, removed at the end.
    assert docker[1] == ("docker", "create", "--name", name, "--network", "none", "--entrypoint",
                         "python", IMAGE, "/tmp/repack-wheel.py", "vllm", "/tmp/vllmstack-wheel")
    assert docker[2] == ("docker", "cp", str(project.cache / "built-wheels" / "repack-wheel.py"),
                         f"{name}:/tmp/repack-wheel.py")
    assert docker[3:] == [("docker", "start", "--attach", name),
                          ("docker", "cp", f"{name}:/tmp/vllmstack-wheel/.",
                           str(project.cache / "built-wheels")),
                          ("docker", "rm", "--force", name)]
    assert (project.cache / "built-wheels" / "repack-wheel.py").read_text() == REPACK_SCRIPT
    # torch first (the build strips it from the wheel's requirements), then the wheel held to it.
    pip = [c[5:] for c in runner.calls if c[1:4] == ("-m", "pip", "install")]
    constraints = folder / "vllmstack-constraints.txt"
    assert pip == [("torch==2.13.0+cpu",), ("--constraint", str(constraints), str(wheel))]
    assert constraints.read_text() == "torch==2.13.0+cpu\n"
    assert any(c[1:] == ("-c", KERNELS_SCRIPT) for c in runner.calls)
    manifest = read_manifest(folder)
    assert manifest is not None and manifest["version"] == VERSION
    assert manifest["source"] == f"the wheel built in image {IMAGE}"
    assert manifest["built"] == {
        "image": IMAGE, "image_id": "sha256:feed", "torch": "2.13.0+cpu", "patches": PATCHES,
        "patch_set": LABELS["vllmstack.patches.vllm"], "wheel": WHEEL,
        "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest()}
    assert f"copying vLLM {VERSION} out of image {IMAGE}" in out
    text = render_install(report, project)
    assert f"patches:  {', '.join(PATCHES)}" in text
    assert f"--set NATIVE_ENGINE_VERSION={VERSION}" in text
    assert report.as_json()["built"]["patches"] == PATCHES


@pytest.mark.parametrize(("labels", "said"), [
    ({"vllmstack.cpu-build": "0.32.0+cpu"}, "has no vllmstack.vllm-wheel-version label"),
    ({**LABELS, "vllmstack.target": "rocm",
      "vllmstack.vllm-wheel-version": "0.31.0+rocm101.gfx1201.p8636d551"}, "for the rocm target"),
    ({k: v for k, v in LABELS.items() if k != "vllmstack.torch"}, "no vllmstack.torch label"),
])
def test_an_image_that_is_not_a_cpu_source_build_is_refused(labels: dict[str, str], said: str) -> None:
    runner = RecordingRunner()
    runner.respond(["docker", "image", "inspect"], inspect_answer(labels))
    with pytest.raises(CpuBuildError) as err:
        read_built_image(runner, "docker", IMAGE)
    assert said in err.value.cause and "invoke build --platform cpu" in (err.value.fix or "")


def test_a_missing_image_says_how_to_build_it() -> None:
    runner = RecordingRunner()
    runner.respond(["docker", "image", "inspect"], Result((), 1, "", "Error: No such image: x"))
    with pytest.raises(CpuBuildError) as err:
        read_built_image(runner, "docker", IMAGE)
    assert f"no image {IMAGE}" in err.value.cause and "No such image" in err.value.cause
    assert (err.value.fix or "").startswith("build it: invoke build --platform cpu")


def test_a_failed_pack_removes_the_container_and_leaves_no_engine(project: Project) -> None:
    runner = built_host(project, start_rc=1)
    with pytest.raises(CpuBuildError) as err:
        install_built(project, runner)
    assert "differs" in err.value.cause
    assert runner.calls[-1][:3] == ("docker", "rm", "--force")
    assert not engine_dir(project, VERSION).exists()


def test_an_image_whose_installed_vllm_is_not_its_label_is_refused(project: Project) -> None:
    with pytest.raises(CpuBuildError) as err:
        install_built(project, built_host(project, packed="0.31.0+cpu.p00000000"))
    assert "has vLLM 0.31.0+cpu.p00000000 installed, but its label names" in err.value.cause


def test_a_source_build_version_is_not_looked_for_on_the_index(project: Project) -> None:
    runner = built_host(project)
    with pytest.raises(EngineInstallError) as err:
        install_engine(project, runner, version=VERSION, python=PY, environ={}, out=io.StringIO())
    assert "--from-image" in (err.value.fix or "")
    assert not any("pip" in c for c in runner.calls)


def sdist_with_pin(folder: Path, release: str, pin: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    data = f"torch=={pin}; platform_machine == \"x86_64\"\n".encode()
    with tarfile.open(folder / f"vllm-{release}.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo(f"vllm-{release}/requirements/cpu.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def test_a_wheel_file_installs_with_the_torch_its_sdist_pins(project: Project, tmp_path: Path) -> None:
    wheel = tmp_path / WHEEL
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("vllm/__init__.py", "")
    inputs = project.cache / "build-inputs"
    with pytest.raises(CpuBuildError) as err:  # no sdist: nothing says which torch
        read_built_file(wheel, inputs)
    assert "--from-image" in (err.value.fix or "")
    sdist_with_pin(inputs, "0.31.0", "2.13.0+cpu")
    runner = built_host(project)
    report, _ = install_built(project, runner, read_built_file(wheel, inputs))
    pip = [c[5:] for c in runner.calls if c[1:4] == ("-m", "pip", "install")]
    assert pip[0] == ("torch==2.13.0+cpu",) and pip[1][-1] == str(wheel)
    assert not any(c[0] == "docker" for c in runner.calls)
    assert report.built["image"] is None and report.built["wheel"] == WHEEL


@pytest.mark.parametrize("name", ["vllm-0.31.0+rocm101.gfx1201.p8636d551-cp311-cp311-linux_x86_64.whl",
                                  "vllm-0.32.0+cpu-cp311-cp311-linux_x86_64.whl"])
def test_a_wheel_for_another_target_is_refused(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_bytes(b"")
    with pytest.raises(CpuBuildError) as err:
        read_built_file(tmp_path / name, tmp_path)
    assert "not a wheel of the cpu source build" in err.value.cause


def test_a_wheel_for_another_python_is_refused_before_the_environment(project: Project) -> None:
    runner = built_host(project)
    runner.respond([PY, "-c"], Result((), 0, "3.12\n"))
    with pytest.raises(WheelError) as err:
        install_built(project, runner)
    assert "CPython 3.11" in err.value.cause and "--python" in (err.value.fix or "")
    assert not engine_dir(project, VERSION).exists()


def test_dry_run_inspects_the_image_and_makes_nothing(project: Project) -> None:
    runner = built_host(project)
    runner.dry_run = True  # the real runner runs only the read-only commands (inspect, python -c)
    runner.respond(["docker", "cp"], Result((), 0))
    runner.respond([PY, "-m", "venv"], Result((), 0))
    runner.respond([str(engine_dir(project, VERSION) / "bin/python"), "-m", "pip", "install"],
                   Result((), 0))
    report, out = install_built(project, runner)
    assert report.dry_run and not (project.cache / "built-wheels").exists()
    assert not engine_dir(project, VERSION).exists()
    assert "(dry run) installing torch==2.13.0+cpu" in out


# --- REPACK_SCRIPT, run for real on an installed distribution -----------------------------------

def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(folder: Path) -> Path:
    files = {"demo/__init__.py": b"VALUE = 1\n", "demo/_C.so": b"\x7fELF not really",
             # vLLM's tuned configs have commas in their names: RECORD is CSV and quotes them
             "demo/configs/N=7168,K=256,dtype=fp8.json": b"{}\n",
             "demo-1.0+cpu.p12345678.dist-info/METADATA":
                 b"Metadata-Version: 2.1\nName: demo\nVersion: 1.0+cpu.p12345678\n",
             "demo-1.0+cpu.p12345678.dist-info/WHEEL":
                 b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: py3-none-any\n",
             "demo-1.0+cpu.p12345678.dist-info/entry_points.txt":
                 b"[console_scripts]\ndemo = demo:main\n"}
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(
        [*((n, record_hash(d), len(d)) for n, d in files.items()),
         ("demo-1.0+cpu.p12345678.dist-info/RECORD", "", "")])
    record = text.getvalue()
    wheel = folder / "demo-1.0+cpu.p12345678-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr("demo-1.0+cpu.p12345678.dist-info/RECORD", record)
    return wheel


def installed(tmp_path: Path) -> tuple[Path, Path]:
    original = make_wheel(tmp_path)
    prefix = tmp_path / "prefix"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
                    "--disable-pip-version-check", "--prefix", str(prefix), str(original)],
                   check=True, capture_output=True)
    site = next(prefix.glob("lib/python*/site-packages"))
    return original, site


def repack(site: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", REPACK_SCRIPT, "demo", str(out)], text=True,
                          capture_output=True, env={"PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1"},
                          check=False)


def test_repack_gives_back_the_installed_wheel_file_for_file(tmp_path: Path) -> None:
    original, site = installed(tmp_path)
    assert (site.parent.parent.parent / "bin" / "demo").is_file()  # pip made the script
    done = repack(site, tmp_path / "out")
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert said["wheel"] == original.name and said["version"] == "1.0+cpu.p12345678"
    with zipfile.ZipFile(original) as a, zipfile.ZipFile(tmp_path / "out" / original.name) as b:
        assert sorted(a.namelist()) == sorted(b.namelist())  # no INSTALLER, bytecode or script
        for name in a.namelist():
            if not name.endswith("RECORD"):
                assert a.read(name) == b.read(name), name
        record = b.read("demo-1.0+cpu.p12345678.dist-info/RECORD").decode()
        rows = list(csv.reader(io.StringIO(record)))
        assert len(rows) == len(a.namelist())
        for path, digest, size in rows[:-1]:
            assert digest == record_hash(b.read(path)) and int(size) == len(b.read(path))


def test_repack_refuses_a_file_changed_after_install(tmp_path: Path) -> None:
    _, site = installed(tmp_path)
    (site / "demo" / "__init__.py").write_text("VALUE = 2\n")
    done = repack(site, tmp_path / "out")
    assert done.returncode != 0
    assert "demo/__init__.py differs from the installed wheel's RECORD" in done.stderr


def test_a_missing_engine_names_how_its_version_is_installed() -> None:
    from vllmstack.runtime.native.command import install_hint

    assert install_hint("0.32.0+cpu") == "invoke install-engine --version 0.32.0+cpu"
    # A source-built CPU wheel is not on the index: it comes out of the image that was built.
    source = install_hint("0.31.0+cpu.p8636d551")
    assert "--from-image" in source and "--version" not in source
    assert "--wheels DIR" in install_hint("0.31.0+rocm101.gfx1201.p8636d551")
