"""One vLLM engine over several nodes, as the cluster targets (LeaderWorkerSet, KServe's
multi-node LLMInferenceService) start it: vLLM's own multiprocessing backend across nodes.

vLLM documents this layout in docs/serving/parallelism_scaling.md ("Running vLLM with
MultiProcessing", vllm-project/vllm 096bd6a): every node runs the same `vllm serve` argv with
`--nnodes N --node-rank R --master-addr HEAD_IP`, and every node but the head adds `--headless`
(it serves no API). KServe's own pipeline-parallel config (config/llmisvcconfig/
config-llm-worker-pipeline-parallel.yaml) passes the same flags, the rank from LeaderWorkerSet's
LWS_WORKER_INDEX and the address from LWS_LEADER_ADDRESS; both variables are set in every
container of a LeaderWorkerSet group (lws api/leaderworkerset/v1/leaderworkerset_types.go), so
the kubelet expands $(VAR) in the args. Nothing else in the argv changes: the profile's words
come first, unchanged, and the distribution flags follow.

A profile is multi-node when its TP x PP x DP exceeds one box's GPU_COUNT (the rule every export
uses); it must fill whole nodes, and the data-parallel layout across nodes (other flags:
--data-parallel-start-rank, ...) is not exported.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllmstack.config.engines.table import kind_named
from vllmstack.core.findings import Finding
from vllmstack.export.spec import EngineSpec, parallel_sizes, placeholder

LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
WORKER_INDEX = "LWS_WORKER_INDEX"
# torch.distributed's rendezvous port; KServe's config uses the same default (PP_MASTER_PORT).
MASTER_PORT = 29500
PP_FIX = "--set VLLM_EXTRA_ARGS='--pipeline-parallel-size 2' (TP inside a box, PP across boxes)"


@dataclass(frozen=True)
class Layout:
    nodes: int
    tp: int
    pp: int


def multi_node_layout(spec: EngineSpec, target: str) -> tuple[Layout | None, list[Finding]]:
    """The profile's node layout, or None with the error that says why it has none."""
    kind = kind_named(spec.engine)
    if not kind.vllm_cli:
        return None, [Finding("error", "export-multi-node-vllm-only",
                              f"{spec.profile} runs {kind.display}; --to {target} runs vLLM's "
                              "multi-node mode only", key="ENGINE", source=spec.resolved.source("ENGINE"),
                              fix=f"export it with --to kube or --to quadlet (--model {spec.profile})")]
    sizes = parallel_sizes(spec.argv)
    if not spec.node_gpus or spec.gpus <= spec.node_gpus:
        return None, [Finding(
            "error", "export-single-node",
            f"{spec.profile} needs {spec.gpus} GPU(s) and one {spec.platform} box has "
            f"{spec.node_gpus}: it runs on one node, and --to {target} writes a group of nodes",
            key="VLLM_TP", source=spec.resolved.source("VLLM_TP"),
            fix=f"export it with --to kube, or spread it over boxes: {PP_FIX}")]
    if sizes["dp"] > 1:
        return None, [Finding(
            "error", "export-multi-node-dp",
            f"{spec.profile} runs data parallel {sizes['dp']} across nodes; vLLM starts that with "
            "other flags (--data-parallel-start-rank, ...), which this export does not write",
            key="VLLM_EXTRA_ARGS", source=spec.resolved.source("VLLM_EXTRA_ARGS"),
            fix=f"use pipeline parallelism across the boxes: {PP_FIX}")]
    if spec.gpus % spec.node_gpus:
        return None, [Finding(
            "error", "export-multi-node-partial",
            f"{spec.profile} needs {spec.gpus} GPUs, not a whole number of {spec.platform} boxes "
            f"of {spec.node_gpus}", key="VLLM_TP", source=spec.resolved.source("VLLM_TP"),
            fix=f"make TP x PP a multiple of GPU_COUNT ({spec.node_gpus})")]
    return Layout(spec.gpus // spec.node_gpus, sizes["tp"], sizes["pp"]), []


def node_args(spec: EngineSpec, layout: Layout, *, leader: bool) -> list[str]:
    """The argv after the image's entrypoint for the leader (rank 0, serves the API) or a
    worker (rank from LWS_WORKER_INDEX, headless): the profile's words, then the flags."""
    # A variable reference is written as the argv's placeholder, which each target turns into
    # its own form ($(VAR) for the kubelet), as it does for a secret flag's value.
    rank = "0" if leader else placeholder(WORKER_INDEX)
    flags = ["--nnodes", str(layout.nodes), "--node-rank", rank,
             "--master-addr", placeholder(LEADER_ADDRESS), "--master-port", str(MASTER_PORT)]
    return [*spec.command_args, *flags, *([] if leader else ["--headless"])]


def strip_node_flags(words: list[str]) -> list[str]:
    """The inverse of node_args, for the tests and the export's own check: the words before
    the distribution flags."""
    return words[:words.index("--nnodes")] if "--nnodes" in words else words
