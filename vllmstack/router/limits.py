"""The router's limits and timeouts (ROUTER_* settings) and the OpenAI-shaped errors it answers.

Every limit is a settings key with a safe default (config/schema.yaml), read once at start from
the first profile's resolution (the router's settings are host settings: .env or the
environment), range-checked there with the file and line a bad value came from. A request over a
limit gets the status a client can act on, with a body shaped as vLLM's own errors
(`{"error": {"message", "type", "param", "code"}}`), so an OpenAI client shows the message.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from vllmstack.config.profiles import Resolved
from vllmstack.config.schema import load_schema, validate_value
from vllmstack.core.errors import StackError

# The error `type` per status, as OpenAI's clients name the classes they raise. 413 and 502 are
# not server faults of the router's own making: 413 is the client's request, 502/504 the engine's.
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError",
               413: "RequestTooLargeError", 422: "UnprocessableEntityError",
               431: "RequestHeaderFieldsTooLargeError", 500: "InternalServerError",
               502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}
SHOWN_NAME = 80  # characters of a client's model name an error quotes (a 1 MB name is not echoed)


class LimitsError(StackError):
    """A ROUTER_* setting is out of its range; the message names the key and where it was set."""


@dataclass(frozen=True)
class Limits:
    """What one client may send and how long the router waits (seconds, bytes)."""

    max_head: int = 32768
    max_body: int = 32 * 1024 * 1024
    max_json_depth: int = 64
    header_timeout: float = 60.0
    keepalive_timeout: float = 75.0
    connect_timeout: float = 10.0
    read_timeout: float = 600.0
    max_connections: int = 4096
    swap_wait: float = 30.0
    swap_grace: float = 0.1
    health_interval: float = 5.0
    error_run: int = 5


KEYS = {"max_head": "ROUTER_MAX_HEAD_BYTES", "max_body": "ROUTER_MAX_BODY_BYTES",
        "max_json_depth": "ROUTER_MAX_JSON_DEPTH", "header_timeout": "ROUTER_HEADER_TIMEOUT",
        "keepalive_timeout": "ROUTER_KEEPALIVE_TIMEOUT",
        "connect_timeout": "ROUTER_UPSTREAM_CONNECT_TIMEOUT",
        "read_timeout": "ROUTER_UPSTREAM_READ_TIMEOUT", "max_connections": "ROUTER_MAX_CONNECTIONS",
        "swap_wait": "ROUTER_SWAP_WAIT", "swap_grace": "ROUTER_SWAP_GRACE",
        "health_interval": "ROUTER_HEALTH_INTERVAL", "error_run": "ROUTER_ERROR_RUN"}


def read_limits(resolved: Resolved) -> Limits:
    """The limits as `resolved` sets them (schema defaults elsewhere), each range-checked."""
    schema = load_schema()
    values: dict[str, Any] = {}
    for field_name, key in KEYS.items():
        spec = schema.get(key)
        assert spec is not None, f"{key} is missing from schema.yaml"
        raw = resolved.get_str(key).strip()
        problem = validate_value(spec, raw)
        if problem:
            where = resolved.source(key) or "the schema default"
            raise LimitsError(f"{key} {problem} (set at {where})",
                              f"set {key} to a value from {spec.min:g} to {spec.max:g}, or remove it "
                              f"for the default {spec.default}")
        values[field_name] = int(raw) if spec.type == "int" else float(raw)
    return Limits(**values)


def error_body(message: str, status: int, param: str | None = None, **extra: Any) -> dict[str, Any]:
    """An OpenAI-style error body, shaped as vLLM's (`{"error": {message, type, param, code}}`)."""
    error = {"message": message, "type": ERROR_TYPES.get(status, "ServerError"), "param": param,
             "code": status, **extra}
    return {"error": error}


def error_json(message: str, status: int, **extra: Any) -> bytes:
    return json.dumps(error_body(message, status, **extra)).encode()


def shown_name(name: str) -> str:
    """A client's model name as an error quotes it: cut, with its length when cut."""
    if len(name) <= SHOWN_NAME:
        return name
    return f"{name[:SHOWN_NAME]}... ({len(name)} characters)"


class BodyError(ValueError):
    """A request body that cannot be used; `status` and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


# A JSON string (skipped whole: brackets inside strings do not nest), or one bracket. The string
# pattern is the unrolled form, linear on a long base64 image.
_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def json_depth_exceeds(body: bytes, limit: int) -> bool:
    """Whether `body` nests arrays and objects deeper than `limit`, found without parsing it
    (json.loads recurses once per level: 100,000 levels raised RecursionError)."""
    depth = 0
    for match in _TOKENS.finditer(body):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        elif token in (b"]", b"}"):
            depth -= 1
    return False


def parse_body(body: bytes, limits: Limits, *, empty: Any = None) -> Any:
    """The JSON of a request body; BodyError (400) when it is not JSON or nests too deep.
    An empty body is `empty` when given, else an error."""
    if not body.strip() and empty is not None:
        return empty
    if json_depth_exceeds(body, limits.max_json_depth):
        raise BodyError(400, f"the body nests arrays or objects deeper than "
                             f"{limits.max_json_depth} levels (ROUTER_MAX_JSON_DEPTH)")
    try:
        return json.loads(body)
    except RecursionError:  # a depth the scan missed cannot crash the request
        raise BodyError(400, "the body nests too deep to be read") from None
    except ValueError as exc:
        raise BodyError(400, f"the body is not JSON ({str(exc)[:200]})") from None
