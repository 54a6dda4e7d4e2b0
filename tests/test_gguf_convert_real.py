"""The stack's tiny model through llama.cpp's real converter, read back with the `gguf` package.

Runs the pinned source's convert_hf_to_gguf.py (the sdist is fetched into this checkout's .cache
once, checked against its pin) with a Python that has torch and transformers: the CPU engine's
environment, which the test installs the way tests/integration/test_real_cpu_engine.py does when
no candidate has them. The made model's tokenizer is one the converter does not know by hash, so
this also proves the recorded pre-tokenizer reaches the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import ROOT

from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project
from vllmstack.core.runner import SubprocessRunner
from vllmstack.models import gguf_convert as gc
from vllmstack.models.tiny import PRESETS, make_model, tensor_shapes

pytestmark = [pytest.mark.slow, pytest.mark.real_engine]


@pytest.mark.parametrize(("outtype", "file_type"), [("f16", "MOSTLY_F16"), ("q8_0", "MOSTLY_Q8_0")])
def test_the_tiny_model_converts_to_a_qwen3_gguf(tmp_path: Path, outtype: str, file_type: str,
                                                 converter_python: str) -> None:
    made = make_model("tiny", out=tmp_path / "tiny-qwen3")
    project = Project(ROOT)  # the pinned sdist and prepared tree are cached in this checkout
    resolved = resolve(project, platform="cpu", environ={})
    done = gc.gguf_convert(project, resolved, SubprocessRunner(), model=str(made.folder),
                           environ=os.environ, outtype=outtype, out=tmp_path / f"tiny-{outtype}.gguf",
                           python=converter_python, stream=False, say=print)
    head = done.header
    assert head["architecture"] == "qwen3"
    # Every tensor of the checkpoint, and nothing else (llama.cpp names them its own way).
    assert head["tensors"] == len(tensor_shapes(PRESETS["tiny"], made.vocab))
    assert head["file_type_name"] == file_type
    assert head["pre_tokenizer"] == "gpt-2"  # from the made model's record
    assert head["context_length"] == 8192
    assert done.path.stat().st_size > 1_000_000
    # bench-vs reads where the weights came from (a pair of identical weights) beside the file.
    sidecar = json.loads(done.path.with_name(done.path.name + ".json").read_text())
    assert sidecar["source"] == str(done.source.resolve()) and sidecar["outtype"] == outtype


def test_the_made_model_converts_quietly_through_the_task(tmp_path: Path,
                                                         converter_python: str) -> None:
    """Issue 23: `invoke gguf-convert` of the stack's own model printed llama.cpp's "pre-tokenizer
    was not recognized" box, the stack's own box, and the whole chat template."""
    import subprocess
    import sys

    made = make_model("tiny", out=tmp_path / "tiny-qwen3")
    out = tmp_path / "tiny.gguf"
    done = subprocess.run([sys.executable, "-m", "invoke", "gguf-convert", str(made.folder),
                           "--out", str(out), "--python", converter_python],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    assert "not recognized" not in said and "!!!!" not in said and "****" not in said
    assert "Setting chat_template (" in said and "{%-" not in said
    assert gc.read_header(out)["pre_tokenizer"] == "gpt-2"
