"""The cluster engines a user adopts after one box: KServe's LLMInferenceService (llm-d inside),
a LeaderWorkerSet for a profile that spans nodes, and llm-d's modelservice chart.

Each is the engine pod of kube.py (the compose container's layout, the profile's argv word for
word, its image and the image's labels as annotations, probes on /health) placed where that
project reads it:

  * KServe (serving.kserve.io/v1alpha1, pkg/apis/serving/v1alpha1/llm_inference_service_types.go):
    `spec.template` is the pod, its container named `main` so KServe's well-known config
    (config/llmisvcconfig/config-llm-template.yaml) merges under it; the argv is the container's
    command + args, which replace the config's. `spec.model.uri` is the argv's model with the
    storage initializer off (vLLM reads the model the argv names, into the HF cache);
    `spec.router` asks for KServe's managed route, gateway and llm-d scheduler. A multi-node
    profile adds `spec.worker` and `spec.parallelism`, which make it a LeaderWorkerSet;
  * LeaderWorkerSet (leaderworkerset.x-k8s.io/v1): one group of `size` pods, the leader serving
    the API, workers headless (multinode.py), each pod with its own HF cache from a claim
    template (a ReadWriteOnce volume is one node's), and a Service to the leader;
  * llm-d-modelservice v0.4.12 (values.yaml, templates/_helpers.tpl): the decode role's one
    container with `modelCommand: custom`, whose command and args the chart writes verbatim,
    vLLM on `routing.servicePort` with the routing sidecar off (no prefill/decode split).
"""

from __future__ import annotations

import copy
from typing import Any

from vllmstack.config.engines.table import kind_named
from vllmstack.core.findings import Finding
from vllmstack.export.kube import PORT_NAME, EnginePod, engine_pod, health_probes
from vllmstack.export.layout import HF_CACHE
from vllmstack.export.multinode import Layout, multi_node_layout, node_args
from vllmstack.export.pod import labels, models_claim, resource_name
from vllmstack.export.spec import EngineSpec, describe, parallel_sizes

KSERVE_CONTAINER = "main"
LLMD_CONTAINER = "vllm"
LLMD_CHART_VERSION = "v0.4.12"
# The container keys llm-d-modelservice reads itself and never writes into the pod.
LLMD_CHART_KEYS = ("modelCommand", "mountModelVolume")
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
# KServe's well-known configs start vLLM on 8000 and route there (the InferencePool's
# targetPorts in config/llmisvcconfig/config-llm-scheduler.yaml).
KSERVE_PORT = 8000
PROFILE_LABEL = "vllmstack/profile"


def model_uri(spec: EngineSpec) -> str:
    """The argv's model as a storage URI: a file under MODELS_DIR is on the models claim
    (pvc://CLAIM/PATH), anything else a Hugging Face id (hf://ORG/NAME)."""
    if spec.models_dir and spec.model.startswith(spec.models_dir.rstrip("/") + "/"):
        return f"pvc://{models_claim(spec)}/{spec.model[len(spec.models_dir.rstrip('/')) + 1:]}"
    return f"hf://{spec.model}"


def vllm_only(spec: EngineSpec, target: str) -> list[Finding]:
    kind = kind_named(spec.engine)
    if kind.vllm_cli:
        return []
    return [Finding("error", f"export-{target}-vllm-only",
                    f"{spec.profile} runs {kind.display} (ENGINE={kind.name}); --to {target} runs "
                    "`vllm serve`: its router reads vLLM's metrics", key="ENGINE",
                    source=spec.resolved.source("ENGINE"),
                    fix=f"export it with --to kube or --to quadlet (--model {spec.profile})")]


def _hf_hub_cache(spec: EngineSpec, container: dict[str, Any]) -> None:
    """KServe's template sets HF_HUB_CACHE=/models (an emptyDir), which would win over HF_HOME
    and put the model outside the cache volume; the pod names the hub folder of its own."""
    if not any(e["name"] == "HF_HUB_CACHE" for e in container["env"]):
        container["env"].append({"name": "HF_HUB_CACHE", "value": f"{spec.layout.mounts[HF_CACHE]}/hub"})


def _node_pods(spec: EngineSpec, layout: Layout) -> tuple[EnginePod, EnginePod]:
    leader = _pinned(spec, engine_pod(spec, spec.entrypoint, node_args(spec, layout, leader=True)))
    worker = _pinned(spec, engine_pod(spec, spec.entrypoint, node_args(spec, layout, leader=False),
                                      probes=False))
    return leader, worker


def _pinned(spec: EngineSpec, pod: EnginePod) -> EnginePod:
    pod.container["image"] = spec.pinned_image
    return pod


def build_llmisvc(spec: EngineSpec) -> tuple[list[dict[str, Any]], list[Finding]]:
    """The LLMInferenceService for one profile, after the documents it needs (PVC, ConfigMap)."""
    findings = vllm_only(spec, "kserve")
    if findings:
        return [], findings
    sizes = parallel_sizes(spec.argv)
    layout: Layout | None = None
    if spec.gpus > spec.node_gpus > 0:
        layout, findings = multi_node_layout(spec, "kserve")
        if layout is None:
            return [], findings
    if spec.port != KSERVE_PORT:
        findings.append(Finding(
            "warning", "export-kserve-port",
            f"the engine listens on VLLM_PORT={spec.port}; KServe's well-known configs route to "
            f"{KSERVE_PORT}", key="VLLM_PORT", source=spec.resolved.source("VLLM_PORT"),
            fix=f"export with --set VLLM_PORT={KSERVE_PORT}, so KServe's route and scheduler reach it"))
    name = resource_name(spec.profile, "vllmstack-")
    # spec.labels reach the pods last (llmisvc-label-propagation.md), so a key of KServe's own
    # would win over it: app.kubernetes.io/name is what its InferencePool selects the pods by
    # (config-llm-scheduler.yaml). The pods carry the stack's profile label only.
    workload: dict[str, Any] = {"replicas": 1, "labels": {PROFILE_LABEL: resource_name(spec.profile)},
                                "annotations": describe(spec)}
    if layout is None:
        pod = _pinned(spec, engine_pod(spec, spec.entrypoint, spec.command_args))
        findings += pod.findings
        documents = list(pod.documents)
        workload["template"] = _kserve_pod(spec, pod)
        if sizes["tp"] > 1:
            workload["parallelism"] = {"tensor": sizes["tp"]}
    else:
        leader, worker = _node_pods(spec, layout)
        findings += leader.findings
        # Each node's pod has its own cache: a ReadWriteOnce claim cannot follow two nodes.
        documents = [d for d in leader.documents if d["kind"] != "PersistentVolumeClaim"]
        workload["template"] = _kserve_pod(spec, leader, cache="emptyDir")
        workload["worker"] = _kserve_pod(spec, worker, cache="emptyDir")
        workload["parallelism"] = {"tensor": layout.tp, "pipeline": layout.pp}
        findings.append(Finding(
            "info", "export-multi-node-cache", f"{spec.profile} runs on {layout.nodes} nodes; each "
            "pod downloads the model into its own emptyDir cache", key="EXPORT_CACHE_SIZE"))
    document = {
        "apiVersion": "serving.kserve.io/v1alpha1", "kind": "LLMInferenceService",
        "metadata": {"name": name, "labels": labels(spec), "annotations": describe(spec)},
        "spec": {"model": {"uri": model_uri(spec), "name": spec.served_name},
                 "storageInitializer": {"enabled": False}, **workload,
                 "router": {"route": {}, "gateway": {}, "scheduler": {}}},
    }
    return [*documents, document], findings


def _kserve_pod(spec: EngineSpec, pod: EnginePod, cache: str = "claim") -> dict[str, Any]:
    pod_spec = copy.deepcopy(pod.spec)
    container = pod_spec["containers"][0]
    container["name"] = KSERVE_CONTAINER
    _hf_hub_cache(spec, container)
    if cache == "emptyDir":
        _cache_on_empty_dir(pod_spec)
    return pod_spec


def _cache_on_empty_dir(pod_spec: dict[str, Any]) -> None:
    for volume in pod_spec["volumes"]:
        if "persistentVolumeClaim" in volume and volume["name"] == "hf-cache":
            del volume["persistentVolumeClaim"]
            volume["emptyDir"] = {}


def build_lws(spec: EngineSpec) -> tuple[list[dict[str, Any]], list[Finding]]:
    """The LeaderWorkerSet of a multi-node profile and the Service to its leader."""
    layout, findings = multi_node_layout(spec, "lws")
    if layout is None:
        return [], findings
    leader, worker = _node_pods(spec, layout)
    findings += leader.findings
    name = resource_name(spec.profile, "vllmstack-")
    claim = next(d for d in leader.documents if d["kind"] == "PersistentVolumeClaim")
    documents = [d for d in leader.documents if d["kind"] != "PersistentVolumeClaim"]
    for pod in (leader, worker):
        # The claim template gives each pod of the group its own cache volume, by this name.
        pod.spec["volumes"] = [v for v in pod.spec["volumes"] if v["name"] != "hf-cache"]
    meta = {"labels": labels(spec), "annotations": describe(spec)}
    lws = {
        "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
        "metadata": {"name": name, **meta},
        "spec": {
            "replicas": 1,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": layout.nodes,
                # One engine over all the pods: a pod that restarts restarts the group.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {"metadata": meta, "spec": leader.spec},
                "workerTemplate": {"metadata": meta, "spec": worker.spec},
                "volumeClaimTemplates": [{"metadata": {"name": "hf-cache"}, "spec": claim["spec"]}],
            },
        },
    }
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "labels": labels(spec)},
        "spec": {"type": "ClusterIP", "selector": {**labels(spec), WORKER_INDEX_LABEL: "0"},
                 "ports": [{"name": PORT_NAME, "port": spec.port, "targetPort": PORT_NAME,
                            "protocol": "TCP"}]}}
    findings.append(Finding(
        "info", "export-lws-nodes",
        f"{spec.profile} runs as one group of {layout.nodes} pods of {spec.node_gpus} GPU(s), one "
        "per node; the leader serves the API", key="VLLM_TP"))
    return [*documents, lws, service], findings


def build_llmd_values(spec: EngineSpec) -> tuple[dict[str, Any], list[dict[str, Any]], list[Finding]]:
    """llm-d-modelservice values for one profile, and the manifests applied before the chart
    (the HF cache claim, the files' ConfigMap)."""
    findings = vllm_only(spec, "llm-d")
    if spec.gpus > spec.node_gpus > 0:
        findings.append(Finding(
            "error", "export-multi-node", f"{spec.profile} needs {spec.gpus} GPUs and one "
            f"{spec.platform} box has {spec.node_gpus}; this export writes the chart's one-node "
            "decode pods", key="VLLM_TP", source=spec.resolved.source("VLLM_TP"),
            fix="export it with --to lws or --to kserve, which spread it over nodes"))
    if any(f.severity == "error" for f in findings):
        return {}, [], findings
    pod = _pinned(spec, engine_pod(spec, spec.entrypoint, spec.command_args))
    findings += pod.findings
    container = copy.deepcopy(pod.container)
    container.update(name=LLMD_CONTAINER, modelCommand="custom", mountModelVolume=False)
    container.update(health_probes(spec, PORT_NAME))
    served = resource_name(spec.served_name)
    values: dict[str, Any] = {
        "multinode": False,
        "accelerator": {"type": spec.vendor if spec.vendor in ("amd", "nvidia") else "cpu"},
        "modelArtifacts": {"name": spec.served_name, "uri": model_uri(spec),
                           # The chart's default label (what its InferencePool selects), and the model.
                           "labels": {"llm-d.ai/inference-serving": "true", "llm-d.ai/model": served}},
        "routing": {"servicePort": spec.port, "proxy": {"enabled": False}},
        "decode": {"create": True, "replicas": 1,
                   "parallelism": {"tensor": parallel_sizes(spec.argv)["tp"]},
                   "containers": [container], "volumes": pod.spec["volumes"],
                   "terminationGracePeriodSeconds": spec.layout.stop_grace},
        "prefill": {"create": False},
    }
    return values, pod.documents, findings
