"""`invoke export --to kube`: plain Kubernetes manifests for one profile - a Deployment running
the profile's exact argv, a Service, the PersistentVolumeClaim of its Hugging Face cache, and a
ConfigMap with the files the argv reads (chat template, tuned configs, overlays).

The pod is the compose container's layout (layout.py) on cluster parts: the HF cache on a PVC,
the engine caches on an emptyDir, /dev/shm a memory emptyDir of EXPORT_SHM_SIZE (compose uses
the host's IPC), the GPUs an extended resource of the vendor's device plugin (count: TP x PP),
probes on /health with a startup budget of UP_TIMEOUT (what `invoke up` waits). One replica,
replaced with `Recreate`: a rolling update would need twice the GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vllmstack.core.findings import Finding
from vllmstack.export.layout import ENGINE_CACHE, HF_CACHE
from vllmstack.export.pod import (
    ENGINE_CACHE_VOLUME,
    FILES_VOLUME,
    GPU_RESOURCE,
    MODELS_VOLUME,
    config_map_name,
    file_key,
    files_config_map,
    k8s_literal,
    labels,
    models_claim,
    pod_environment,
    pod_findings,
    resource_name,
    secret_value_from,
)
from vllmstack.export.spec import PLACEHOLDER, EngineSpec, describe

HF_VOLUME = "hf-cache"
SHM_VOLUME = "shm"
PORT_NAME = "http"
PROBE_PERIOD = 10


def kube_word(word: str) -> str:
    """An argv word for a container's command: secret placeholders become $(VAR), which the
    kubelet fills from the pod's environment; everything else is escaped literal text."""
    parts = PLACEHOLDER.split(word)
    return "".join(k8s_literal(p) if i % 2 == 0 else f"$({p})" for i, p in enumerate(parts))


@dataclass
class EnginePod:
    """The engine's pod as every Kubernetes target writes it: the pod spec (one container,
    `engine`, running `command` + `args`), the documents it needs first (its ConfigMap of files,
    the PVC of its HF cache) and what did not translate."""

    spec: dict[str, Any]
    documents: list[dict[str, Any]]
    findings: list[Finding]

    @property
    def container(self) -> dict[str, Any]:
        container: dict[str, Any] = self.spec["containers"][0]
        return container


def build_manifests(spec: EngineSpec) -> tuple[list[dict[str, Any]], list[Finding]]:
    """The documents for one profile, in the order `kubectl apply -f` should create them."""
    findings: list[Finding] = []
    if spec.gpus > spec.node_gpus > 0:
        findings.append(Finding(
            "error", "export-multi-node",
            f"{spec.profile} needs {spec.gpus} GPUs and one {spec.platform} box has "
            f"{spec.node_gpus}; a Deployment's pod runs on one node",
            key="VLLM_TP", source=spec.resolved.source("VLLM_TP"),
            fix="export it with --to lws (a LeaderWorkerSet, one pod per node), --to kserve, or "
                "--to production-stack, whose raySpec spreads it over nodes"))
    name = resource_name(spec.profile, "vllmstack-")
    pod = engine_pod(spec, spec.entrypoint, spec.command_args)
    findings += pod.findings
    documents = [*pod.documents, _deployment(spec, name, pod.spec)]
    documents.append({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "labels": labels(spec)},
        "spec": {"type": "ClusterIP", "selector": labels(spec),
                 "ports": [{"name": PORT_NAME, "port": spec.port, "targetPort": PORT_NAME,
                            "protocol": "TCP"}]}})
    return documents, findings


def engine_pod(spec: EngineSpec, command: list[str], args: list[str], *,
               probes: bool = True) -> EnginePod:
    """The pod spec running `command` + `args` (argv words, secret placeholders still in them)
    with the compose container's layout; `probes=False` for a pod that serves no HTTP (a
    multi-node worker)."""
    env, findings = pod_environment(spec)
    findings += pod_findings(spec)
    name = resource_name(spec.profile, "vllmstack-")
    documents: list[dict[str, Any]] = []
    volumes: list[dict[str, Any]] = [
        {"name": HF_VOLUME, "persistentVolumeClaim": {"claimName": f"{name}-hf-cache"}},
        {"name": ENGINE_CACHE_VOLUME, "emptyDir": {}},
        {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory",
                                          "sizeLimit": spec.setting("EXPORT_SHM_SIZE")}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": HF_VOLUME, "mountPath": spec.layout.mounts[HF_CACHE]},
        {"name": ENGINE_CACHE_VOLUME, "mountPath": spec.layout.mounts[ENGINE_CACHE]},
        {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
    ]
    if spec.files:
        documents.append(files_config_map(spec, binary=False))
        volumes.append({"name": FILES_VOLUME, "configMap": {"name": config_map_name(spec)}})
        mounts += [{"name": FILES_VOLUME, "mountPath": f.target, "subPath": file_key(i, f),
                    "readOnly": True} for i, f in enumerate(spec.files)]
    if spec.models_dir and spec.models_dir in " ".join(spec.argv):
        volumes.append({"name": MODELS_VOLUME,
                        "persistentVolumeClaim": {"claimName": models_claim(spec), "readOnly": True}})
        mounts.append({"name": MODELS_VOLUME, "mountPath": spec.models_dir, "readOnly": True})
    claim: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": spec.setting("EXPORT_CACHE_SIZE")}}}
    if spec.setting("EXPORT_STORAGE_CLASS"):
        claim["storageClassName"] = spec.setting("EXPORT_STORAGE_CLASS")
    documents.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                      "metadata": {"name": f"{name}-hf-cache", "labels": labels(spec)},
                      "spec": claim})
    container = _container(spec, env, mounts, command, args, probes=probes)
    pod = {"terminationGracePeriodSeconds": spec.layout.stop_grace,
           "containers": [container], "volumes": volumes}
    return EnginePod(pod, documents, findings)


def _container(spec: EngineSpec, env: dict[str, str], mounts: list[dict[str, Any]],
               command: list[str], args: list[str], *, probes: bool) -> dict[str, Any]:
    resources: dict[str, Any] = {"requests": {"cpu": spec.resolved.get_int("EXPORT_CPU_REQUEST"),
                                              "memory": spec.setting("EXPORT_MEMORY_REQUEST")}}
    if spec.vendor in GPU_RESOURCE and spec.gpus:
        # Extended resources are requested through limits (requests default to them); a pod
        # holds one node's share of a multi-node engine.
        resources["limits"] = {GPU_RESOURCE[spec.vendor]: min(spec.gpus, spec.node_gpus or spec.gpus)}
    container: dict[str, Any] = {
        "name": "engine",
        "image": spec.image,
        "command": [kube_word(w) for w in command],
        "args": [kube_word(w) for w in args],
        "ports": [{"name": PORT_NAME, "containerPort": spec.port, "protocol": "TCP"}],
        "env": [*({"name": k, "value": k8s_literal(v)} for k, v in env.items()),
                *({"name": s.name, "valueFrom": secret_value_from(spec, s)} for s in spec.secrets)],
        "resources": resources,
        "volumeMounts": mounts,
    }
    if probes:
        container.update(health_probes(spec, PORT_NAME))
    return container


def health_probes(spec: EngineSpec, port: int | str) -> dict[str, Any]:
    """Startup, readiness and liveness on /health: vLLM serves nothing until the engine is
    built (reference/vllm-facts.md, section 6), so the startup probe waits UP_TIMEOUT, what
    `invoke up` waits for a boot; liveness keeps compose's interval."""
    probe = {"httpGet": {"path": "/health", "port": port}}
    health = spec.layout.health
    return {
        "startupProbe": {**probe, "periodSeconds": PROBE_PERIOD, "failureThreshold":
                         math.ceil(spec.resolved.get_int("UP_TIMEOUT") / PROBE_PERIOD)},
        "readinessProbe": {**probe, "periodSeconds": PROBE_PERIOD, "failureThreshold": 3},
        "livenessProbe": {**probe, "periodSeconds": health.interval, "timeoutSeconds": health.timeout,
                          "failureThreshold": health.retries},
    }


def _deployment(spec: EngineSpec, name: str, pod: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "labels": labels(spec), "annotations": describe(spec)},
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": labels(spec)},
            "template": {
                "metadata": {"labels": labels(spec), "annotations": describe(spec)},
                "spec": pod,
            },
        },
    }
