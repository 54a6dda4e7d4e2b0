"""What vLLM's production-stack chart does with a `servingEngineSpec.modelSpec[]` entry.

Read from the templates of chart 0.1.12 (validate.CHART_VERSION, CHART_COMMIT; the values side
of the same reading is chart_values.schema.json): `deployment-vllm-multi.yaml` (one Deployment per
model) and `ray-cluster.yaml` (`raySpec.enabled`: a RayCluster whose head runs vLLM from a bash
script). `chart_argv` renders the engine command those templates write from values, so an export
is checked flag for flag against the profile's argv before it is written, and tests do the same
from the written file.

What the templates do that matters here:
  * command: `vllm serve MODEL_URL --host 0.0.0.0 --port CONTAINER_PORT`, then the vllmConfig
    fields, then `extraArgs` in order, then `--revision` (modelRevision);
  * a Deployment always writes `--enable-prefix-caching` or `--no-enable-prefix-caching` once a
    vllmConfig exists; a RayCluster writes the first only, and adds
    `--distributed-executor-backend ray`;
  * a Deployment writes `--gpu_memory_utilization` (vLLM's parser takes `_` for `-`);
  * the RayCluster's script quotes each word with sprig's `quote` inside bash, so `$`, backquotes
    and control characters in a word would be expanded by bash (`safe_in_ray_script`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


# vllmConfig fields with a flag of their own, in the order the Deployment template writes them.
# `kind` is how the field is written in values: int where the chart takes an integer (only when
# the argv's text is that integer's own spelling), str where it takes a string.
@dataclass(frozen=True)
class ChartField:
    field: str
    flag: str        # the flag as vLLM names it
    kind: type


FIELDS = (
    ChartField("maxModelLen", "--max-model-len", int),
    ChartField("dtype", "--dtype", str),
    ChartField("tensorParallelSize", "--tensor-parallel-size", int),
    ChartField("maxNumSeqs", "--max-num-seqs", int),
    ChartField("gpuMemoryUtilization", "--gpu-memory-utilization", str),
)
# The Deployment template's spelling of a flag where it differs from vLLM's own.
DEPLOYMENT_SPELLING = {"--gpu-memory-utilization": "--gpu_memory_utilization"}
PREFIX_CACHING = "--enable-prefix-caching"
NO_PREFIX_CACHING = "--no-enable-prefix-caching"
RAY_BACKEND = ("--distributed-executor-backend", "ray")
DEFAULT_CONTAINER_PORT = 8000
# Characters bash would act on inside the double quotes of the RayCluster's script.
RAY_UNSAFE = re.compile(r"[$`\\\x00-\x1f\x7f]")


def safe_in_ray_script(word: str) -> bool:
    return RAY_UNSAFE.search(word) is None


def _render(value: Any) -> str:
    """What sprig's `quote` makes of a values entry (YAML-decoded by Helm first)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def chart_argv(values: dict[str, Any], model: dict[str, Any]) -> list[str]:
    """The engine command the chart runs for `model` (an entry of servingEngineSpec.modelSpec),
    as its templates write it; `values` is the whole values document (containerPort)."""
    engine = values.get("servingEngineSpec", {})
    port = engine.get("containerPort") or DEFAULT_CONTAINER_PORT
    ray = bool(model.get("raySpec", {}).get("enabled"))
    argv = ["vllm", "serve", _render(model["modelURL"]), "--host", "0.0.0.0", "--port", _render(port)]
    if ray:
        argv += list(RAY_BACKEND)
    config = model.get("vllmConfig")
    if config:
        if "enableChunkedPrefill" in config:
            argv.append("--enable-chunked-prefill" if config["enableChunkedPrefill"]
                        else "--no-enable-chunked-prefill")
        if config.get("enablePrefixCaching"):
            argv.append(PREFIX_CACHING)
        elif not ray:
            argv.append(NO_PREFIX_CACHING)
        for field in FIELDS:
            if field.field in config:
                flag = field.flag if ray else DEPLOYMENT_SPELLING.get(field.flag, field.flag)
                argv += [flag, _render(config[field.field])]
        argv += [str(word) for word in config.get("extraArgs") or []]
    if model.get("modelRevision"):
        argv += ["--revision", _render(model["modelRevision"])]
    return argv


def options(argv: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """The positional words and, per flag, its values in order: what vLLM's parser ends up with
    (`_` and `-` are one spelling, `--no-X` sets X, the last value of a flag wins). Flag order
    across different flags does not matter to it, which is how the chart may reorder them."""
    positional: list[str] = []
    flags: dict[str, list[str]] = {}
    index = 0
    while index < len(argv):
        word = argv[index]
        if not word.startswith("-"):
            positional.append(word)
            index += 1
            continue
        name, eq, inline = word.partition("=")
        name = "--" + name.lstrip("-").replace("_", "-") if name.startswith("--") else name
        value: str
        if eq:
            value = inline
        elif index + 1 < len(argv) and not argv[index + 1].startswith("-"):
            index += 1
            value = argv[index]
        elif name.startswith("--no-"):
            name, value = "--" + name.removeprefix("--no-"), "<off>"
        else:
            value = "<on>"
        flags.setdefault(name, []).append(value)
        index += 1
    return positional, flags
