"""Tasks of the llama.cpp engine and the GPU itself: gguf-convert, gpu-check."""

from __future__ import annotations

import os
from pathlib import Path

from invoke.context import Context

from vllmstack.cli.common import (
    JSON_HELP,
    PROFILE_HELP,
    Opt,
    Sets,
    make_runner,
    print_json,
    project_here,
    resolve_here,
)
from vllmstack.cli.task import exit_with, stack_task


@stack_task(help={
    "model_dir": "the Hugging Face model: a folder, or a hub id in the local cache",
    "outtype": "f16 (default), bf16, q8_0 (see the converter's --outtype)",
    "out": "the .gguf to write (default: MODELS_DIR/<name>-<outtype>.gguf; without MODELS_DIR "
           "~/.cache/vllmstack-models/, where llama.cpp profiles look too)",
    "pre_tokenizer": "llama.cpp pre-tokenizer to use when the converter does not know the "
                     "tokenizer's (a model `invoke make-model` made records its own)",
    "python": "interpreter with torch, transformers and numpy (default: the CPU engine's)",
    "force": "overwrite an existing file", **JSON_HELP})
def gguf_convert(c: Context, model_dir: str, outtype: str = "f16", out: Opt = None,
                 pre_tokenizer: Opt = None, python: Opt = None, force: bool = False,
                 json: bool = False) -> None:
    """Convert a Hugging Face checkpoint to GGUF with the pinned llama.cpp's own converter."""
    from vllmstack.models import gguf_convert as convert

    done = convert.gguf_convert(project_here(), resolve_here(None, None, None), make_runner(False),
                                model=model_dir, environ=os.environ, outtype=outtype,
                                out=Path(out) if out else None, pre_tokenizer=pre_tokenizer,
                                python=python, force=force, stream=not json)
    print_json(done.as_json()) if json else print(convert.render_converted(done))


@stack_task(iterable=["set"], help={
    **PROFILE_HELP, **JSON_HELP,
    "runtime": "native (the engine environment on the host, default) or compose (the running "
               "engine container)",
    "python": "native: run the probe with this interpreter"})
def gpu_check(c: Context, model: Opt = None, platform: Opt = None, set: Sets = None,
              runtime: str = "native", python: Opt = None, json: bool = False) -> None:
    """Torch sees the GPU: device name, gfx arch or compute capability, a kernel run, HSA override."""
    from vllmstack.runtime import gpu_check as check

    resolved, project, runner = resolve_here(model, platform, set), project_here(), make_runner(False)
    engine = None
    if runtime != "native":
        from vllmstack.serve.lifecycle import open_stack

        engine = open_stack(project, resolved, os.environ, runner, runtime=runtime).engine
    result = check.gpu_check(project, resolved, runner, runtime="native" if runtime == "native"
                             else "compose", environ=os.environ, engine=engine, python=python)
    print_json(result.as_json()) if json else print(check.render_gpu_check(result))
    exit_with(0 if result.verdict == check.PASS else 1)
