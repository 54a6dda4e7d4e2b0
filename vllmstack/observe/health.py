"""What answers on a port: TCP reachability, /health, and who a foreign server is.

Shared by the serving layer (guards, waiting for health, status) and anything else that asks
an OpenAI-compatible engine whether it is there.
"""

from __future__ import annotations

import socket

import requests


def port_answers(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def identify_server(url: str, timeout: float = 1.5) -> str:
    """A short description of what answers at `url` (for the other-engine guard)."""
    for path in ("/v1/models", "/health", "/"):
        try:
            response = requests.get(url + path, timeout=timeout)
        except requests.RequestException:
            continue
        server = response.headers.get("server", "")
        if path == "/v1/models" and response.ok:
            try:
                ids = [m.get("id") for m in response.json().get("data", [])]
            except (ValueError, AttributeError):
                ids = []
            return f"an OpenAI-compatible server ({server or 'unknown'}) serving {ids or 'models'}"
        return f"a server ({server or 'unknown'}) answering HTTP {response.status_code}"
    return "a process listening (not HTTP)"


def health_status(url: str, timeout: float = 2.0) -> int | None:
    """HTTP status of /health, or None while nothing answers (vLLM does not listen while loading)."""
    try:
        return requests.get(url + "/health", timeout=timeout).status_code
    except requests.RequestException:
        return None


def is_sleeping(url: str, timeout: float = 2.0) -> bool | None:
    """vLLM's GET /is_sleeping (an engine in sleep mode, VLLM_SERVER_DEV_MODE=1): True while its
    weights are off the GPU; None where nothing answers it (no sleep mode, another engine)."""
    try:
        answer = requests.get(url + "/is_sleeping", timeout=timeout)
        data = answer.json() if answer.status_code == 200 else None
    except (requests.RequestException, ValueError):
        return None
    value = data.get("is_sleeping") if isinstance(data, dict) else None
    return value if isinstance(value, bool) else None
