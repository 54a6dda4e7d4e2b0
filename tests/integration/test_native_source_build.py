"""The source build, served natively from its wheel: no container at run time.

After `invoke build --platform cpu` (tests/integration/test_build_cpu_source.py), a maintainer runs
the compiled vLLM on the host:

    invoke install-engine --platform cpu --from-image localhost/vllm-cpu:src
    invoke make-model
    invoke up --runtime native --platform cpu --model tiny --set NATIVE_ENGINE_VERSION=<the wheel's>

This test does that in a copy of the project with a built image (VLLMSTACK_SOURCE_IMAGE, default
localhost/vllm-cpu:src; it does not build one: that is the other test's hour). What a client sees
of the patches: /version reports the wheel's version, which names the target and the patch set
the image's labels list; and when the series held the `tools: []` test patch, such a request is
answered 200, otherwise vLLM's 400 (the native runtime applies no runtime overlay that could fix
it). Marked `source_build`, so only `invoke test --slow` runs it; it holds /tmp/vllmstack-heavy.lock
while it installs and serves (do not wrap it in `flock` yourself). Its times go to
test-artifacts/native-source-build.json.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import need
from helpers import ROOT, copy_project, docker, docker_ready, free_port, write_dotenv

from vllmstack.runtime.native.install import engine_dir, read_manifest

pytestmark = [pytest.mark.source_build, pytest.mark.slow, pytest.mark.docker]
IMAGE = os.environ.get("VLLMSTACK_SOURCE_IMAGE", "localhost/vllm-cpu:src")
TEST_PATCH = "0900-test-tools-empty-list.patch"  # test_build_cpu_source.py's client-visible patch
INSTALL_TIMEOUT_S = 2400
BOOT_TIMEOUT_S = 600
LOCK = "/tmp/vllmstack-heavy.lock"
ARTIFACT = ROOT / "test-artifacts" / "native-source-build.json"


@dataclass
class Stack:
    root: Path
    home: Path
    port: int
    labels: dict[str, str]
    times: dict[str, Any] = field(default_factory=dict)

    def invoke(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=self.root, text=True,
                                env={**os.environ, "HOME": str(self.home)}, capture_output=True,
                                timeout=timeout, check=False)
        self.times[args[0].replace("-", "_")] = round(time.monotonic() - started)
        return result

    def must(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        result = self.invoke(*args, timeout=timeout)
        assert result.returncode == 0, f"invoke {' '.join(args)}:\n{result.stdout[-5000:]}\n" \
                                       f"{result.stderr[-3000:]}"
        return result

    def ask(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode() if body else None,
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    need(docker_ready(IMAGE), f"a Docker engine and the built image {IMAGE} (invoke build "
         "--platform cpu) are needed")
    shown = docker("image", "inspect", "--format", "{{json .Config.Labels}}", IMAGE)
    labels: dict[str, str] = json.loads(shown.stdout)
    lock = open(LOCK, "a")  # noqa: SIM115 (held for the whole module, released below)
    fcntl.flock(lock, fcntl.LOCK_EX)
    base = tmp_path_factory.mktemp("native-source")
    root = copy_project(base / "stack")
    home = base / "home"
    home.mkdir()
    port = free_port()
    write_dotenv(root, {
        "PLATFORM": "cpu", "MODEL_PROFILE": "tiny", "RUNTIME": "native", "VLLM_PORT": str(port),
        "OTHER_ENGINE_PORTS": "", "DASHBOARD_PORT": str(free_port()),
        "HOST_CACHE_DIR": str(ROOT / ".cache" / "real-engine-tests"), "UP_TIMEOUT": str(BOOT_TIMEOUT_S),
        "HF_CACHE_DIR": str(home / ".cache" / "huggingface")})
    made = Stack(root, home, port, labels)
    try:
        yield made
    finally:
        subprocess.run([sys.executable, "-m", "invoke", "down"], cwd=root, capture_output=True,
                       env={**os.environ, "HOME": str(home)}, timeout=180, check=False)
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
        shutil.rmtree(root / ".cache" / "engines", ignore_errors=True)  # 3 GB per run
        ARTIFACT.parent.mkdir(exist_ok=True)
        ARTIFACT.write_text(json.dumps(made.times, indent=2) + "\n")


def test_the_built_wheel_installs_natively_and_serves_with_its_patches(stack: Stack) -> None:
    version = stack.labels["vllmstack.vllm-wheel-version"]
    patches = stack.labels["vllmstack.patch-list.vllm"].split(",")
    from vllmstack.core.paths import Project

    folder = engine_dir(Project(stack.root), version)
    done = stack.invoke("install-engine", "--platform", "cpu", "--from-image", IMAGE,
                        timeout=INSTALL_TIMEOUT_S)
    if done.returncode != 0 and "so vLLM cannot load here natively" in done.stdout + done.stderr:
        # The wheel links a newer glibc than this host's: refused before any pip work, as error/fix.
        said = (done.stdout + done.stderr).strip().splitlines()
        assert said[-2].startswith("error: ") and said[-1].startswith("fix:"), said[-5:]
        assert not folder.exists()
        stack.times["refused"] = said[-2]
        pytest.skip(said[-2])
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-3000:]
    manifest = read_manifest(folder)
    assert manifest is not None and manifest["packages"]["vllm"] == version
    built = manifest["built"]
    assert built["image"] == IMAGE and built["patches"] == patches
    assert built["patch_set"] == stack.labels["vllmstack.patches.vllm"]
    assert built["torch"] == manifest["packages"]["torch"] == stack.labels["vllmstack.torch"]
    wheel = stack.root / ".cache" / "built-wheels" / built["wheel"]
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() == built["wheel_sha256"]
    stack.times["wheel_mb"] = round(wheel.stat().st_size / 2**20)

    stack.must("make-model")
    stack.must("up", "--no-dashboard", "--set", f"NATIVE_ENGINE_VERSION={version}",
               timeout=BOOT_TIMEOUT_S + 120)
    status = json.loads(stack.must("status", "--json").stdout)
    assert status.get("runtime") == "native", status
    # The running engine is the built wheel: its version names the target and the patch set.
    code, text = stack.ask("/version")
    assert code == 200 and json.loads(text)["version"] == version, text
    assert version.endswith(".p" + stack.labels["vllmstack.patches.vllm"][:8])
    code, text = stack.ask("/v1/chat/completions", {
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]})
    assert code == 200 and json.loads(text)["choices"][0]["message"]["role"] == "assistant", text
    code, text = stack.ask("/v1/chat/completions", {
        "model": "tiny", "max_tokens": 4, "tools": [], "messages": [{"role": "user", "content": "hi"}]})
    if TEST_PATCH in patches:
        assert code == 200, text
    else:  # upstream's behaviour: no overlay is applied natively
        assert code == 400 and "must not be an empty array" in text, (code, text)
    stack.times["tools_empty_list"] = code
    stack.must("down", timeout=180)
    print(json.dumps(stack.times, indent=2))
