"""The real vLLM argument parser (the pinned release) accepts the argv the native runtime runs."""

from __future__ import annotations

import importlib
import os

import pytest
from conftest import need

from vllmstack.config.engines.table import engine_of
from vllmstack.config.profiles import list_profiles, resolve
from vllmstack.core.paths import Project
from vllmstack.core.runner import SubprocessRunner
from vllmstack.runtime.native.command import native_serve_command


@pytest.mark.slow  # creates (once) and runs the pinned vLLM's parser
def test_every_shipped_native_argv_is_accepted_by_the_real_vllm_parser(
        shipped: Project) -> None:
    try:
        parser = importlib.import_module("vllmstack.checks.deep")
    except ImportError:
        parser = None
    need(parser is not None, "vllmstack.checks.deep (the `check --deep` parser) is needed")
    assert parser is not None
    environ = dict(os.environ)  # the parser finds model configs in the usual HF cache
    argvs, origins, names = [], [], []
    for profile in list_profiles(shipped):
        if profile.kind != "model":
            continue
        for platform in profile.platforms or ("2xr9700",):
            resolved = resolve(shipped, platform=platform, model=profile.name, environ=environ)
            if engine_of(resolved) != "vllm":
                continue  # llama-server's argv: vLLM's parser has nothing to say about it
            command = native_serve_command(shipped, resolved, environ)
            # The engine runs from the install-engine environment: one word, then `serve`.
            assert command.venv is not None and command.argv[1] == "serve"
            argvs.append(["vllm", *command.argv[1:]])
            origins.append(resolved)
            names.append(f"{profile.name} on {platform}")
    version = origins[0].get("VLLM_VERSION")
    # A control the parser must refuse, so an empty result means "accepted", not "never ran".
    control = [*argvs[0], "--bogus-native-flag", "1"]
    *reports, refused = parser.parse_argvs(shipped, SubprocessRunner(), [*argvs, control], version,
                                           resolved=[*origins, None], environ=environ)
    errors = {name: [f.render() for f in found if f.severity == "error"]
              for name, found in zip(names, reports, strict=True)}
    assert {name: e for name, e in errors.items() if e} == {}
    assert any(f.severity == "error" and "--bogus-native-flag" in f.message for f in refused), refused
