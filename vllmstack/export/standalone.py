"""llm-d without Kubernetes (`invoke export --to llm-d`, beside the chart's values): the llm-d
router's endpoints file, the router config that reads it, and the engines' `podman run` lines.

The llm-d router (its EPP behind Envoy) finds its model servers through the file-discovery
plugin instead of an InferencePool (llm-d/llm-d-router docs/discovery.md,
pkg/epp/framework/plugins/datalayer/discovery/file, ebab687): `endpoints.yaml` lists each
engine's name, IPv4 address and port (a string); the EPP config names the file in a
`file-discovery` plugin and `dataLayer.discovery.pluginRef`. The engine runs as the same
container as the Quadlet unit (runline.py), published on VLLM_BIND:VLLM_PORT: the address the
router reaches it on is VLLM_BIND, or 127.0.0.1 for an engine published on every address.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from vllmstack.core.findings import Finding
from vllmstack.export.pod import resource_name
from vllmstack.export.spec import EngineSpec

# Where docs/discovery.md's example keeps the file; the config names it by absolute path.
ENDPOINTS_FOLDER = "/etc/epp"


@dataclass(frozen=True)
class Files:
    endpoints: str   # the file written
    config: str      # the router config written
    path: str        # where the config reads the endpoints file


def file_names(spec: EngineSpec) -> Files:
    endpoints = f"{spec.profile}.endpoints.yaml"
    return Files(endpoints, f"{spec.profile}.epp-config.yaml", f"{ENDPOINTS_FOLDER}/{endpoints}")


def clashes(entries: list[tuple[EngineSpec, str]]) -> list[Finding]:
    """Two engines published on the same address and port cannot both run on one box."""
    seen: dict[tuple[str, int], str] = {}
    found: list[Finding] = []
    for spec, address in entries:
        other = seen.setdefault((address, spec.port), spec.profile)
        if other != spec.profile:
            found.append(Finding(
                "warning", "export-llmd-port-clash", f"{other} and {spec.profile} are both published "
                f"on {address}:{spec.port}; on one box the second `podman run` fails",
                key="VLLM_PORT", fix="run them on different boxes, or export each with its own "
                "--set VLLM_PORT=PORT"))
    return found


def endpoint_address(spec: EngineSpec) -> tuple[str | None, list[Finding]]:
    """The IPv4 address the router reaches the engine on, or None with the error."""
    bind = spec.setting("VLLM_BIND").strip()
    try:
        address = ipaddress.ip_address(bind)
    except ValueError:
        address = None
    if address is None or address.version != 4:
        return None, [Finding(
            "error", "export-llmd-ipv4", f"VLLM_BIND={bind} is not an IPv4 address; the llm-d "
            "router's endpoints file takes a literal IPv4 address only (no hostname, no IPv6)",
            key="VLLM_BIND", source=spec.resolved.source("VLLM_BIND"),
            fix="set VLLM_BIND to this box's IPv4 address (or 127.0.0.1 for a router on this box)")]
    if address.is_unspecified:
        return "127.0.0.1", [Finding(
            "info", "export-llmd-address", f"VLLM_BIND={bind} publishes the engine on every address; "
            "endpoints.yaml names it as 127.0.0.1, for a router on this box", key="VLLM_BIND",
            fix="write this box's LAN address into endpoints.yaml for a router elsewhere")]
    if address.is_loopback:
        return str(address), [Finding(
            "info", "export-llmd-address", f"the engine is published on {bind} only: the llm-d "
            "router must run on this box", key="VLLM_BIND",
            fix="set VLLM_BIND to this box's LAN address for a router on another box")]
    return str(address), []


def endpoints_document(entries: list[tuple[EngineSpec, str]]) -> dict[str, Any]:
    return {"endpoints": [
        {"name": resource_name(spec.profile), "address": address, "port": str(spec.port),
         "labels": {"llm-d.ai/model": spec.served_name, "vllmstack/profile": spec.profile}}
        for spec, address in entries]}


def epp_config(path: str) -> dict[str, Any]:
    """The router config of docs/discovery.md's no-Kubernetes example: file discovery of `path`
    (reloaded on change), one scheduling profile."""
    return {
        "plugins": [
            {"name": "file-disc", "type": "file-discovery",
             "parameters": {"path": path, "watchFile": True}},
            {"name": "kv-cache-scorer", "type": "kv-cache-utilization-scorer"},
            {"name": "random-picker", "type": "random-picker"},
            {"name": "single-profile", "type": "single-profile-handler",
             "parameters": {"scorer": "kv-cache-scorer", "picker": "random-picker"}},
        ],
        "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": "single-profile"}]}],
        "dataLayer": {"discovery": {"pluginRef": "file-disc"}},
    }
