"""What every Kubernetes target (plain manifests, the production-stack chart) does the same way:
names, the GPU resource of each vendor, the environment a pod may carry, files as a ConfigMap,
secret references, and what of a one-box profile does not translate to a cluster.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

from vllmstack.config.engines.table import kind_named
from vllmstack.core.findings import Finding
from vllmstack.export.spec import EngineSpec, MountedFile, SecretEnv

# The extended resource each vendor's device plugin offers (AMD's and NVIDIA's k8s-device-plugin).
GPU_RESOURCE = {"amd": "amd.com/gpu", "nvidia": "nvidia.com/gpu"}
DEVICE_PLUGIN = {"amd": "AMD's GPU device plugin (ROCm/k8s-device-plugin)",
                 "nvidia": "NVIDIA's device plugin (or the GPU Operator)"}
ENGINE_CACHE_VOLUME = "engine-cache"
FILES_VOLUME = "engine-files"
MODELS_VOLUME = "models"
# A ConfigMap holds at most 1 MiB (Kubernetes' MaxSecretSize applies to ConfigMaps too).
CONFIG_MAP_LIMIT = 1024 * 1024
# The host picks the GPUs with these; in a pod the device plugin does, and numbers them from 0.
DEVICE_SELECTION = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
LOCAL_REGISTRIES = ("localhost/", "localhost:", "127.0.0.1")


def resource_name(text: str, prefix: str = "") -> str:
    """A DNS-1123 label (lowercase letters, digits, '-'; at most 63): qwen3.8-27b -> qwen3-8-27b."""
    name = re.sub(r"[^a-z0-9-]+", "-", (prefix + text).lower()).strip("-")
    return name[:63].rstrip("-") or "engine"


def k8s_literal(text: str) -> str:
    """A word Kubernetes must not expand: it reads $(NAME) as a variable and `$$` as `$`."""
    return text.replace("$", "$$")


def file_key(index: int, mounted: MountedFile) -> str:
    """A ConfigMap key for a file (keys are [-._a-zA-Z0-9]; tuned-config names hold '=', ',')."""
    return f"f{index:02d}-" + re.sub(r"[^-._a-zA-Z0-9]+", "_", Path(mounted.target).name)[:240]


def files_config_map(spec: EngineSpec, *, binary: bool) -> dict[str, Any]:
    """The files the engine reads, one key each; `binary` writes base64 binaryData (text a
    template engine will not touch), else plain data."""
    entries: dict[str, str] = {}
    for index, mounted in enumerate(spec.files):
        content = mounted.source.read_bytes()
        entries[file_key(index, mounted)] = (base64.b64encode(content).decode("ascii") if binary
                                             else content.decode("utf-8"))
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": config_map_name(spec), "labels": labels(spec)},
            ("binaryData" if binary else "data"): entries}


def config_map_name(spec: EngineSpec) -> str:
    return resource_name(spec.profile, "vllmstack-")[:57] + "-files"


def labels(spec: EngineSpec) -> dict[str, str]:
    return {"app.kubernetes.io/name": "vllmstack-engine",
            "app.kubernetes.io/instance": resource_name(spec.profile)}


def secret_value_from(spec: EngineSpec, secret: SecretEnv) -> dict[str, Any]:
    return {"secretKeyRef": {"name": spec.setting("EXPORT_SECRET"), "key": secret.key}}


def models_claim(spec: EngineSpec) -> str:
    return resource_name("models", "vllmstack-")


def pod_environment(spec: EngineSpec) -> tuple[dict[str, str], list[Finding]]:
    """The engine's plain environment for a pod: less the host's GPU selection (the device
    plugin selects) and less values that are paths on this host."""
    env: dict[str, str] = {}
    findings: list[Finding] = []
    for key, value in spec.env.items():
        if key in DEVICE_SELECTION:
            findings.append(Finding(
                "info", "export-device-selection", f"{key}={value} selects GPUs on this host; in a "
                "pod the device plugin gives the engine its GPUs (numbered from 0), so it is left out",
                key=key, source=spec.resolved.source(key)))
            continue
        if is_host_path(spec, value):
            fallback = spec.layout.environment.get(key)
            findings.append(Finding(
                "warning", "export-host-path", f"{key}={value} is a path on this host, which a pod "
                "does not have; " + (f"the container's own {key}={fallback} is exported instead"
                                     if fallback else "it is left out of the exported environment"),
                key=key, source=spec.resolved.source(key),
                fix=f"point {key} at a folder inside the container, or mount that folder"))
            if fallback:
                env[key] = fallback
            continue
        env[key] = value
    return env, findings


def is_host_path(spec: EngineSpec, value: str) -> bool:
    """A value that names a folder of this host's user (home, the host cache folders); MODELS_DIR
    is not one: exports mount a volume there."""
    text = value.strip()
    if not text.startswith(("/", "~")):
        return False
    path = Path(text).expanduser()
    models = spec.models_dir
    if models and path.is_relative_to(Path(models).expanduser()):
        return False
    return any(path.is_relative_to(root) for root in spec.host_roots)


def pod_findings(spec: EngineSpec) -> list[Finding]:
    """What of the profile a cluster cannot take as it is, and what it needs first."""
    findings: list[Finding] = []
    if spec.image.startswith(LOCAL_REGISTRIES) or "/" not in spec.image:
        key = kind_named(spec.engine).image_key
        findings.append(Finding(
            "warning", "export-image-local",
            f"{spec.image} is a name on this host; a cluster's nodes cannot pull it",
            key=key, source=spec.resolved.source(key),
            fix=f"docker tag {spec.image} REGISTRY/NAME:TAG && docker push REGISTRY/NAME:TAG, then "
                f"export with --set {key}=REGISTRY/NAME:TAG"))
    if spec.vendor in DEVICE_PLUGIN and spec.gpus:
        findings.append(Finding(
            "info", "export-gpu-resource",
            f"the engine requests {spec.gpus} {GPU_RESOURCE[spec.vendor]}; the nodes need "
            f"{DEVICE_PLUGIN[spec.vendor]}", key="GPU_VENDOR"))
    if spec.models_dir and spec.models_dir in " ".join(spec.argv):
        findings.append(Finding(
            "warning", "export-models-dir",
            f"the argv reads files under MODELS_DIR={spec.models_dir}, a folder of this host; the "
            f"pod mounts the PersistentVolumeClaim {models_claim(spec)} there (read-only)",
            key="MODELS_DIR", source=spec.resolved.source("MODELS_DIR"),
            fix=f"create the claim {models_claim(spec)} and copy the model files into it"))
    size = sum(4 * ((f.source.stat().st_size + 2) // 3) for f in spec.files)
    if size > CONFIG_MAP_LIMIT:
        findings.append(Finding(
            "error", "export-files-too-large",
            f"the engine's files ({len(spec.files)}: chat template, tuned configs, overlays) come "
            f"to {size} bytes, over the 1 MiB a ConfigMap holds", key="VLLM_CHAT_TEMPLATE",
            fix="drop tuned configs for other devices from fused_moe_configs/, or mount the "
                "files from a volume of your own"))
    for secret in spec.secrets:
        findings.append(Finding(
            "info", "export-secret-reference",
            f"{secret.name} ({secret.origin}) is read from the Secret "
            f"{spec.setting('EXPORT_SECRET')}, key {secret.key}; its value is not exported",
            key="EXPORT_SECRET",
            fix=f"kubectl create secret generic {spec.setting('EXPORT_SECRET')} "
                f"--from-literal={secret.key}=VALUE (once per key)"))
    return findings
