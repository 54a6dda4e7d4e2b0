"""The multi-node argv the cluster exports write (--to lws, --to kserve over two boxes) parses with
vLLM's own `vllm serve` parser, the real CPU engine's: the profile's words plus vLLM's
--nnodes/--node-rank/--master-addr/--master-port (and --headless on a worker) are flags that
vLLM has, with values it takes. The kubelet's $(VAR) references are filled in as LWS fills them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import ROOT

from vllmstack.checks import deep
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, SubprocessRunner
from vllmstack.export import service

ENV = {"HOME": "/home/op", "PATH": os.environ.get("PATH", "")}
PP2 = "VLLM_EXTRA_ARGS=--pipeline-parallel-size 2"
# What LeaderWorkerSet puts in each container's environment (leaderworkerset_types.go).
LWS_VALUES = {"LWS_LEADER_ADDRESS": "vllmstack-qwen3-8-27b-0.vllmstack-qwen3-8-27b", "LWS_WORKER_INDEX": "1"}


def containers(document: dict[str, Any]) -> list[dict[str, Any]]:
    spec = document["spec"]
    if document["kind"] == "LeaderWorkerSet":
        template = spec["leaderWorkerTemplate"]
        return [template[role]["spec"]["containers"][0] for role in ("leaderTemplate", "workerTemplate")]
    return [spec[part]["containers"][0] for part in ("template", "worker")]


def as_run(container: dict[str, Any]) -> list[str]:
    """The argv the kubelet starts: $(VAR) filled in, $$ a literal $."""
    return [re.sub(r"(?<!\$)\$\(([A-Z_]+)\)", lambda m: LWS_VALUES[m.group(1)], w).replace("$$", "$")
            for w in container["command"] + container["args"]]


@pytest.mark.real_engine
@pytest.mark.parametrize("target", [service.LWS, service.KSERVE])
def test_the_multi_node_argv_parses_with_vllms_own_parser(target: str, cpu_engine_python: Path) -> None:
    project = Project(ROOT)
    argvs: list[list[str]] = []
    for platform, model in (("2xr9700", "qwen3.8-27b"), ("nvidia", "qwen3-0.6b")):
        p = service.plan_export(project, target, [model], platform, ["MODELS_DIR=/srv/models", PP2], ENV,
                                RecordingRunner())
        (document,) = [d for d in yaml.safe_load_all(p.files[f"{model}.yaml"])
                       if d["kind"] in ("LeaderWorkerSet", "LLMInferenceService")]
        argvs += [as_run(c) for c in containers(document)]
    assert [a[-1] == "--headless" for a in argvs] == [False, True, False, True]
    found = deep.parse_argvs(project, SubprocessRunner(), argvs, "0.32.0", python=cpu_engine_python,
                             environ=dict(os.environ))
    assert found == [[], [], [], []], [[f.render() for f in fs] for fs in found]
    # The parser is the judge: a misspelt multi-node flag is refused.
    (wrong,) = deep.parse_argvs(project, SubprocessRunner(), [[w.replace("--node-rank", "--node-rnak")
                                                               for w in argvs[1]]], "0.32.0",
                                python=cpu_engine_python, environ=dict(os.environ))
    assert "vllm-unknown-flag" in {f.code for f in wrong}
