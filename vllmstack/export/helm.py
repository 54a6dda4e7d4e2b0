"""`invoke export --to production-stack`: one values file for vLLM's production-stack chart, with
one `servingEngineSpec.modelSpec[]` entry per profile, so the chart's router serves them all.

Each profile's argv is split between the chart's own `vllmConfig` fields (where the chart has one
and renders it back to the same flag and value) and `extraArgs` (everything else, in the argv's
order); chart.chart_argv renders the values back and the result must equal the profile's argv
flag for flag, or the export stops. Files the engine reads (chat template, tuned configs,
overlays) ride in ConfigMaps under `extraObjects`, as base64 `binaryData`: the chart passes
extraObjects through Helm's `tpl`, which would run a chat template's own `{{ }}`. The HF cache is
the chart's PVC (`pvcStorage`, mounted at /data, HF_HOME=/data); the engine caches of compose's
layout are an emptyDir; secrets are `secretKeyRef`s, never values.
"""

from __future__ import annotations

import math
import re
from typing import Any

from vllmstack.config.engines.table import kind_named
from vllmstack.core.findings import Finding
from vllmstack.export import chart
from vllmstack.export.layout import ENGINE_CACHE
from vllmstack.export.pod import (
    ENGINE_CACHE_VOLUME,
    FILES_VOLUME,
    GPU_RESOURCE,
    MODELS_VOLUME,
    file_key,
    files_config_map,
    k8s_literal,
    models_claim,
    pod_environment,
    pod_findings,
    resource_name,
    secret_value_from,
)
from vllmstack.export.spec import PLACEHOLDER, EngineSpec, describe

# Set by the chart's template (HF_HOME from pvcStorage) or meaningless in a pod.
CHART_OWNED_ENV = {"HF_HOME"}
PROBE_PERIOD = 10


def modelspec_name(spec: EngineSpec) -> str:
    """The chart names its Deployment `<release>-<name>-deployment-vllm`: a DNS label part."""
    return resource_name(spec.profile)


def build_values(specs: list[EngineSpec]) -> tuple[dict[str, Any], list[Finding]]:
    """The values document for every profile, and what did not translate."""
    findings: list[Finding] = []
    for spec in specs:
        kind = kind_named(spec.engine)
        if not kind.vllm_cli:
            findings.append(Finding(
                "error", "export-chart-vllm-only",
                f"{spec.profile} runs {kind.display} (ENGINE={kind.name}); the production-stack chart "
                "runs `vllm serve` only", key="ENGINE", source=spec.resolved.source("ENGINE"),
                fix=f"export it with --to kube or --to quadlet (--model {spec.profile})"))
    if any(f.severity == "error" for f in findings):
        return {}, findings
    ports = {spec.port for spec in specs}
    port = specs[0].port
    if len(ports) > 1:
        findings.append(Finding("info", "export-chart-one-port",
                                f"the profiles listen on ports {sorted(ports)}; the chart has one "
                                f"containerPort, {port}, so each engine's --port is {port} in its "
                                "own pod", key="VLLM_PORT"))
    startup = max(spec.resolved.get_int("UP_TIMEOUT") for spec in specs)
    probe = {"path": "/health", "port": port}
    layout = specs[0].layout
    engine: dict[str, Any] = {
        "containerPort": port,
        # The chart's probes start after 15 s (templateProbe's default, also for 0).
        "startupProbe": {"periodSeconds": PROBE_PERIOD,
                         "failureThreshold": math.ceil(startup / PROBE_PERIOD), "httpGet": probe},
        "readinessProbe": {"periodSeconds": PROBE_PERIOD,
                           "failureThreshold": 3, "httpGet": probe},
        "livenessProbe": {"periodSeconds": layout.health.interval,
                          "timeoutSeconds": layout.health.timeout,
                          "failureThreshold": layout.health.retries, "httpGet": probe},
        "modelSpec": [],
    }
    values: dict[str, Any] = {"servingEngineSpec": engine}
    objects: list[dict[str, Any]] = []
    for spec in specs:
        model, extra, model_findings = _model_spec(spec, port)
        engine["modelSpec"].append(model)
        objects += extra
        findings += model_findings
        rendered = chart.chart_argv(values, model)
        findings += _compare(spec, rendered, port, ray=bool(model.get("raySpec")))
    if objects:
        values["extraObjects"] = objects
    return values, findings


def _model_spec(spec: EngineSpec, port: int) -> tuple[dict[str, Any], list[dict[str, Any]],
                                                        list[Finding]]:
    findings: list[Finding] = []
    ray = spec.gpus > spec.node_gpus > 0
    config, findings_argv = _vllm_config(spec, ray=ray)
    findings += findings_argv
    repository, tag = split_image(spec.image)
    model: dict[str, Any] = {
        "name": modelspec_name(spec),
        "repository": repository,
        "tag": tag,
        "modelURL": spec.model if ray else k8s_literal(spec.model),
        "replicaCount": 1,
        "requestCPU": _cpu(spec),
        "requestMemory": spec.setting("EXPORT_MEMORY_REQUEST"),
        "requestGPU": spec.gpus if not ray else spec.node_gpus,
        "pvcStorage": spec.setting("EXPORT_CACHE_SIZE"),
        "shmSize": spec.setting("EXPORT_SHM_SIZE"),
        "vllmConfig": config,
        "podAnnotations": describe(spec),
    }
    if spec.vendor in GPU_RESOURCE:
        model["requestGPUType"] = GPU_RESOURCE[spec.vendor]
    if spec.setting("EXPORT_STORAGE_CLASS"):
        model["storageClass"] = spec.setting("EXPORT_STORAGE_CLASS")
    plain, env_findings = pod_environment(spec)
    findings += env_findings + pod_findings(spec)
    env: list[dict[str, Any]] = [{"name": k, "value": k8s_literal(v)} for k, v in plain.items()
                                 if k not in CHART_OWNED_ENV]
    env += [{"name": s.name, "valueFrom": secret_value_from(spec, s)} for s in spec.secrets]
    model["env"] = env
    volumes: list[dict[str, Any]] = [{"name": ENGINE_CACHE_VOLUME, "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [{"name": ENGINE_CACHE_VOLUME,
                                     "mountPath": spec.layout.mounts[ENGINE_CACHE]}]
    extra: list[dict[str, Any]] = []
    if spec.files:
        config_map = files_config_map(spec, binary=True)
        extra.append(config_map)
        volumes.append({"name": FILES_VOLUME, "configMap": {"name": config_map["metadata"]["name"]}})
        mounts += [{"name": FILES_VOLUME, "mountPath": f.target, "subPath": file_key(i, f),
                    "readOnly": True} for i, f in enumerate(spec.files)]
    if spec.models_dir and spec.models_dir in " ".join(spec.argv):
        volumes.append({"name": MODELS_VOLUME,
                        "persistentVolumeClaim": {"claimName": models_claim(spec), "readOnly": True}})
        mounts.append({"name": MODELS_VOLUME, "mountPath": spec.models_dir, "readOnly": True})
    model["extraVolumes"] = volumes
    model["extraVolumeMounts"] = mounts
    if ray:
        workers = math.ceil(spec.gpus / spec.node_gpus) - 1
        model["replicaCount"] = workers
        model["raySpec"] = {"enabled": True, "headNode": {
            "requestCPU": _cpu(spec), "requestMemory": spec.setting("EXPORT_MEMORY_REQUEST"),
            "requestGPU": spec.node_gpus}}
        # ray-cluster.yaml sets VLLM_USE_V1=0 unless vllmConfig.v1 is given; vLLM has had no V0
        # engine since 0.11, so the stack's engine is always V1.
        config["v1"] = "1"
        findings += _ray_findings(spec, workers)
    findings += _hf_cache_findings(spec)
    return model, extra, findings


def _vllm_config(spec: EngineSpec, *, ray: bool) -> tuple[dict[str, Any], list[Finding]]:
    """The profile's argv as vllmConfig fields + extraArgs (model, --host and --port are the
    chart's own words)."""
    findings: list[Finding] = []
    words = list(spec.command_args[1:])  # after the model argument
    words = _drop_listen_address(words)
    counts: dict[str, int] = {}
    for word in words:
        if word.startswith("--"):
            name = word.partition("=")[0]
            counts[name] = counts.get(name, 0) + 1
    config: dict[str, Any] = {}
    lifted: set[int] = set()
    for field in chart.FIELDS:
        if counts.get(field.flag) != 1:
            continue  # absent, or repeated (the last one wins: keep them in order in extraArgs)
        at = words.index(field.flag) if field.flag in words else -1
        if at < 0 or at + 1 >= len(words):
            continue
        text = words[at + 1]
        if field.kind is int:
            if not text.isdigit() or str(int(text)) != text:
                continue
            config[field.field] = int(text)
        else:
            config[field.field] = text
        lifted |= {at, at + 1}
    caching = [i for i, w in enumerate(words) if w in (chart.PREFIX_CACHING, chart.NO_PREFIX_CACHING)]
    if len(caching) == 1 and (not ray or words[caching[0]] == chart.PREFIX_CACHING):
        config["enablePrefixCaching"] = words[caching[0]] == chart.PREFIX_CACHING
        lifted.add(caching[0])
    elif not caching and not ray:
        findings.append(Finding(
            "error", "export-chart-prefix-caching",
            "the profile leaves prefix caching to vLLM's default (VLLM_ENABLE_PREFIX_CACHING is "
            "empty), but the chart always writes --enable-prefix-caching or "
            "--no-enable-prefix-caching", key="VLLM_ENABLE_PREFIX_CACHING",
            source=spec.resolved.source("VLLM_ENABLE_PREFIX_CACHING"),
            fix="set VLLM_ENABLE_PREFIX_CACHING=true or false"))
    extra = [_secret_ref(w, ray=ray) for i, w in enumerate(words) if i not in lifted]
    if ray:
        unsafe = [w for w in [spec.model, *extra] if not chart.safe_in_ray_script(
            PLACEHOLDER.sub("", w) if "<secret:" in w else w)]
        unsafe = [w for w in unsafe if not re.fullmatch(r"(--[\w-]+=)?\$\{[A-Z_0-9]+\}", w)]
        if unsafe:
            findings.append(Finding(
                "error", "export-ray-script-quoting",
                f"the chart's RayCluster runs vLLM from a bash script, where {unsafe[0]!r} would "
                "not reach vLLM as written ($, backquotes, backslashes and control characters "
                "are bash's)", key="VLLM_EXTRA_ARGS",
                fix="write the value without those characters, or serve the profile on one node"))
    config["extraArgs"] = extra
    return config, findings


def _drop_listen_address(words: list[str]) -> list[str]:
    """The argv builder's own `--host H --port P` pair: the chart writes its own in their place
    (containerPort is the profile's port). Any other --host/--port (VLLM_EXTRA_ARGS) stays."""
    for index in range(len(words) - 3):
        if words[index] == "--host" and words[index + 2] == "--port":
            return words[:index] + words[index + 4:]
    return words


def _secret_ref(word: str, *, ray: bool) -> str:
    """A secret placeholder as the chart's container expands it: Kubernetes' $(VAR) in a
    Deployment's command, bash's ${VAR} in the RayCluster's script; everything else literal."""
    if ray:
        return PLACEHOLDER.sub(lambda m: "${" + m.group(1) + "}", word)
    parts = PLACEHOLDER.split(word)
    # split() alternates literal text and variable names.
    return "".join(k8s_literal(p) if i % 2 == 0 else f"$({p})" for i, p in enumerate(parts))


def _compare(spec: EngineSpec, rendered: list[str], port: int, *, ray: bool) -> list[Finding]:
    """The argv the chart will run must be the profile's, flag for flag (the chart's --port is
    containerPort; a RayCluster adds its executor backend)."""
    expected = [_secret_ref(w, ray=ray) for w in spec.argv]
    expected = [str(port) if i > 0 and expected[i - 1] == "--port" and w == str(spec.port) else w
                for i, w in enumerate(expected)]
    if ray:
        expected += list(chart.RAY_BACKEND)
    else:  # Kubernetes reads `$$` in a command as `$`; both sides are read the same way
        rendered, expected = [unescape_k8s(w) for w in rendered], [unescape_k8s(w) for w in expected]
    if chart.options(rendered) == chart.options(expected):
        return []
    return [Finding("error", "export-chart-argv-differs",
                    f"the chart would run {rendered} for {spec.profile}, not the profile's argv "
                    f"{expected}", fix="report this: vllmstack/export/helm.py maps the argv to the chart")]


def unescape_k8s(word: str) -> str:
    """Kubernetes' expansion of a command word with no variables defined: `$$` is `$`."""
    return re.sub(r"\$\$", "$", word)


def split_image(image: str) -> tuple[str, str]:
    """`registry/name:tag` -> (`registry/name`, `tag`); the chart joins them with ':'."""
    name, at, digest = image.partition("@")
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        repository, _, tag = name.rpartition(":")
    else:
        repository, tag = name, "latest"
    return repository, tag + (at + digest if at else "")


def _cpu(spec: EngineSpec) -> int:
    return spec.resolved.get_int("EXPORT_CPU_REQUEST")


def _ray_findings(spec: EngineSpec, workers: int) -> list[Finding]:
    return [
        Finding("info", "export-multi-node",
                f"{spec.profile} needs {spec.gpus} GPUs and one {spec.platform} box has "
                f"{spec.node_gpus}: exported with the chart's raySpec, a Ray head with "
                f"{spec.node_gpus} GPUs and {workers} worker(s) with {spec.node_gpus} each",
                key="VLLM_TP", source=spec.resolved.source("VLLM_TP")),
        Finding("warning", "export-ray-needs-ray",
                f"the RayCluster runs {spec.image}, which must have Ray installed (vLLM 0.26-0.33 "
                "does not install it) and the cluster must run the KubeRay operator",
                key="VLLM_IMAGE", source=spec.resolved.source("VLLM_IMAGE"),
                fix="build an image FROM this one with `pip install ray`, push it, and pass --set "
                    "VLLM_IMAGE=REGISTRY/NAME:TAG; install KubeRay (its Helm chart) in the cluster"),
    ]


def _hf_cache_findings(spec: EngineSpec) -> list[Finding]:
    """The cache PVC must hold the weights (MODEL_WEIGHT_GIB, when the profile states it)."""
    size = spec.setting("EXPORT_CACHE_SIZE")
    weights = spec.resolved.get("MODEL_WEIGHT_GIB")
    match = re.fullmatch(r"(\d+)Gi", size)
    if not (match and weights):
        return []
    try:
        need = float(weights)
    except ValueError:
        return []
    if need < int(match.group(1)):
        return []
    return [Finding("error", "export-cache-too-small",
                    f"EXPORT_CACHE_SIZE={size} cannot hold the {need:g} GiB of weights "
                    f"(MODEL_WEIGHT_GIB) of {spec.profile}", key="EXPORT_CACHE_SIZE",
                    source=spec.resolved.source("EXPORT_CACHE_SIZE"),
                    fix=f"--set EXPORT_CACHE_SIZE={math.ceil(need * 1.5) + 10}Gi")]

