"""`invoke install-engine --wheels DIR` for real (a venv, pip, offline), then `up --runtime native`
running the installed `vllm` command.

The wheel is a stand-in built here: a `vllm` 0.31.0 package whose `vllm` console script runs the
engine simulator, so the path from a wheel folder to a healthy endpoint is the one an AMD user
takes with AMD's wheels, without downloading gigabytes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import ROOT, copy_project, free_port, write_dotenv

pytestmark = pytest.mark.slow  # creates virtual environments: about 10 s each
SIMULATOR = ROOT / "tests" / "simulator" / "server.py"


def build_wheel(folder: Path, version: str) -> Path:
    files = {
        "vllm/__init__.py": f"__version__ = {version!r}\n",
        "vllm/cli.py": ("import os, sys\n\ndef main():\n"
                        f"    os.execv(sys.executable, [sys.executable, {str(SIMULATOR)!r}, "
                        "*sys.argv[1:]])\n"),
        f"vllm-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n",
        f"vllm-{version}.dist-info/WHEEL": ("Wheel-Version: 1.0\nGenerator: vllmstack-tests\n"
                                            "Root-Is-Purelib: true\nTag: py3-none-any\n"),
        f"vllm-{version}.dist-info/entry_points.txt": "[console_scripts]\nvllm = vllm.cli:main\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"vllm-{version}.dist-info/RECORD,,")
    files[f"vllm-{version}.dist-info/RECORD"] = "\n".join(record) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"vllm-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return path



def invoke(root: Path, home: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOME": str(home), "PIP_NO_INDEX": "1"}
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=root, env=env, text=True,
                          capture_output=True, timeout=timeout, check=False)


def test_install_from_a_wheel_folder_refuse_reinstall_then_serve_natively(tmp_path: Path) -> None:
    root = copy_project(tmp_path / "stack")
    port = free_port()
    # The cpu platform would run vLLM's CPU build; this test serves the stand-in 0.31.0 wheel.
    write_dotenv(root, {"VLLM_PORT": str(port), "OTHER_ENGINE_PORTS": "",
                        "NATIVE_ENGINE_VERSION": "0.31.0"})
    home = tmp_path / "home"
    home.mkdir()
    wheels = tmp_path / "wheels"
    build_wheel(wheels, "0.31.0")

    first = invoke(root, home, "install-engine", "--wheels", str(wheels), "--json")
    assert first.returncode == 0, first.stdout + first.stderr
    report = json.loads(first.stdout)
    assert (report["version"], report["installed"]["vllm"]) == ("0.31.0", "0.31.0")
    assert report["source"] == f"wheels in {wheels}"
    venv = root / ".cache" / "engines" / "vllm-0.31.0"
    assert (venv / "bin" / "vllm").is_file() and (venv / "vllmstack-engine.json").is_file()

    again = invoke(root, home, "install-engine", "--wheels", str(wheels))
    assert again.returncode == 0, again.stderr
    assert "vllm 0.31.0 is already installed in" in again.stdout and "--force" in again.stdout

    other = invoke(root, home, "install-engine", "--wheels", str(wheels), "--version", "0.30.1")
    assert other.returncode == 1 and "has vllm 0.31.0, not 0.30.1" in other.stderr

    up = invoke(root, home, "up", "--runtime", "native", "--platform", "cpu", "--model",
                "qwen3-0.6b", "--no-dashboard", "--set", "ENGINE_ENV=SIM_BOOT_SECONDS=0.5")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        record = json.loads((root / "generated" / "native" / "engine.json").read_text())
        assert record["argv"][:3] == [str(venv / "bin" / "vllm"), "serve", "Qwen/Qwen3-0.6B"]
        # Replacing the environment of the running engine is refused even with --force.
        busy = invoke(root, home, "install-engine", "--wheels", str(wheels), "--force")
        assert busy.returncode == 1 and "stop it first: invoke down" in busy.stderr
    finally:
        down = invoke(root, home, "down")
    assert down.returncode == 0, down.stderr

    forced = invoke(root, home, "install-engine", "--wheels", str(wheels), "--force")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert "installed vllm 0.31.0 into .cache/engines/vllm-0.31.0" in forced.stdout
    assert "(replaced the previous one)" in forced.stdout


def base_interpreter(folder: Path, *, torch: str, vllm_wheel: Path | None = None) -> Path:
    """An interpreter that already has a torch (a distribution record is all pip and the stack
    look at) and, given a wheel, its own vLLM: what TheRock's ROCm torch or a system vLLM is."""
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True, timeout=300)
    python = folder / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    record = Path(site) / f"torch-{torch}.dist-info"
    record.mkdir()
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {torch}\n")
    (record / "RECORD").write_text("")
    if vllm_wheel is not None:
        subprocess.run([str(python), "-m", "pip", "install", "--no-index", "--disable-pip-version-check",
                        str(vllm_wheel)], check=True, capture_output=True, timeout=300)
    return python


def test_system_site_packages_reuses_the_interpreters_torch_and_its_vllm(tmp_path: Path) -> None:
    root = copy_project(tmp_path / "stack")
    port = free_port()
    write_dotenv(root, {"VLLM_PORT": str(port), "OTHER_ENGINE_PORTS": "",
                        "NATIVE_ENGINE_VERSION": "0.31.0"})
    home = tmp_path / "home"
    home.mkdir()
    wheels = tmp_path / "wheels"
    wheel = build_wheel(wheels, "0.31.0")
    python = base_interpreter(tmp_path / "rocm-python", torch="2.9.1+rocm7.2", vllm_wheel=wheel)

    first = invoke(root, home, "install-engine", "--python", str(python), "--system-site-packages",
                   "--wheels", str(wheels), "--json")
    assert first.returncode == 0, first.stdout + first.stderr
    report = json.loads(first.stdout)
    assert report["system_site_packages"] and report["base_python"] == str(python)
    assert report["installed"]["torch"] == "2.9.1+rocm7.2"  # the interpreter's, not a download
    venv = root / ".cache" / "engines" / "vllm-0.31.0"
    assert (venv / "vllmstack-constraints.txt").read_text() == "torch==2.9.1+rocm7.2\n"
    assert "runs it" in " ".join(report["notes"])  # the interpreter's vllm, through bin/vllm
    listed = json.loads(invoke(root, home, "engines", "--json").stdout)
    assert [(e["vllm"], e["torch"], e["system_site_packages"]) for e in listed] == [
        ("0.31.0", "2.9.1+rocm7.2", True)]

    up = invoke(root, home, "up", "--runtime", "native", "--platform", "cpu", "--model",
                "qwen3-0.6b", "--no-dashboard", "--set", "ENGINE_ENV=SIM_BOOT_SECONDS=0.5")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        record = json.loads((root / "generated" / "native" / "engine.json").read_text())
        assert record["argv"][:2] == [str(venv / "bin" / "vllm"), "serve"]
    finally:
        down = invoke(root, home, "down")
    assert down.returncode == 0, down.stderr


def test_system_site_packages_refuses_an_interpreter_without_torch(tmp_path: Path) -> None:
    root = copy_project(tmp_path / "stack")
    home = tmp_path / "home"
    home.mkdir()
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", str(bare)], check=True, timeout=300)
    result = invoke(root, home, "install-engine", "--python", str(bare / "bin" / "python"),
                    "--system-site-packages", "--version", "0.31.0")
    assert result.returncode == 1
    assert "has no torch" in result.stderr and "fix:" in result.stderr
    assert not (root / ".cache" / "engines" / "vllm-0.31.0").exists()

