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
               429: "RateLimitError", 431: "RequestHeaderFieldsTooLargeError",
               500: "InternalServerError",
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
    max_client_connections: int = 512
    max_queued_body: int = 1024 * 1024 * 1024
    # 2 s, not 30 (issue 35): a model's clients waited up to 16.6 s for their first token while
    # the awake model's clients held the card; the bound is the worst wait before a swap.
    swap_wait: float = 2.0
    swap_grace: float = 0.1
    health_interval: float = 5.0
    error_run: int = 5
    load_backoff: float = 30.0  # a failed load is answered at once for this long
    stop_timeout: float = 60.0  # a stop, in all (systemd kills at 90 s)


KEYS = {"max_head": "ROUTER_MAX_HEAD_BYTES", "max_body": "ROUTER_MAX_BODY_BYTES",
        "max_json_depth": "ROUTER_MAX_JSON_DEPTH", "header_timeout": "ROUTER_HEADER_TIMEOUT",
        "keepalive_timeout": "ROUTER_KEEPALIVE_TIMEOUT",
        "connect_timeout": "ROUTER_UPSTREAM_CONNECT_TIMEOUT",
        "read_timeout": "ROUTER_UPSTREAM_READ_TIMEOUT", "max_connections": "ROUTER_MAX_CONNECTIONS",
        "max_client_connections": "ROUTER_MAX_CLIENT_CONNECTIONS",
        "max_queued_body": "ROUTER_MAX_QUEUED_BODY_BYTES",
        "swap_wait": "ROUTER_SWAP_WAIT", "swap_grace": "ROUTER_SWAP_GRACE",
        "health_interval": "ROUTER_HEALTH_INTERVAL", "error_run": "ROUTER_ERROR_RUN",
        "load_backoff": "ROUTER_LOAD_BACKOFF",
        "stop_timeout": "ROUTER_STOP_TIMEOUT"}


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


class BodyLedger:
    """The bytes of request bodies the router holds, counted as they are read and until their
    request is done (issue 35: 40 bodies of 30 MiB queued behind a load grew the router by
    3.7 GiB; ROUTER_MAX_BODY_BYTES bounds one body, this bounds them all)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, 0

    def take(self, size: int) -> bool:
        """Count `size` more bytes; False (nothing counted) when that would pass the limit."""
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held = max(0, self.held - size)


class FailureThrottle:
    """Back-off for a client's wrong tokens (issue 35: about 2,700 guesses a second on one
    connection). A peer address has FREE_FAILURES answered at once; each one after that waits
    for the peer's previous one plus a doubling delay (up to MAX_DELAY_S), so parallel
    connections do not multiply its rate. A right token never waits. The table is bounded: a
    peer quiet for FORGET_S is forgotten, and past MAX_PEERS the oldest goes."""

    FREE_FAILURES = 5
    FIRST_DELAY_S = 0.1
    MAX_DELAY_S = 2.0
    FORGET_S = 300.0
    MAX_PEERS = 4096

    def __init__(self) -> None:
        self.peers: dict[str, tuple[int, float]] = {}  # peer: (failures, when its last one ends)

    def failed(self, peer: str, now: float) -> float:
        """Seconds the 401 for this failure of `peer` waits, counted from `now`."""
        failures, free_at = self.peers.pop(peer, (0, now))
        if now - free_at > self.FORGET_S:
            failures, free_at = 0, now
        failures += 1
        wait = 0.0
        if failures > self.FREE_FAILURES:
            step = min(self.MAX_DELAY_S,
                       self.FIRST_DELAY_S * 2 ** min(failures - self.FREE_FAILURES - 1, 16))
            wait = max(free_at, now) + step - now
        self.peers[peer] = (failures, now + wait)  # re-inserted: the newest at the end
        while len(self.peers) > self.MAX_PEERS:
            del self.peers[next(iter(self.peers))]
        return wait


def form_field(body: bytes, content_type: str, name: str) -> tuple[str, int, int] | None:
    """The value of the text field `name` in a multipart/form-data `body` and where its bytes
    lie (start, end), or None. The audio routes carry `model` in a form field (OpenAI's and
    vLLM's transcription API), not in JSON; the file part is never decoded."""
    boundary = ""
    for param in content_type.split(";")[1:]:
        key, _, value = param.strip().partition("=")
        if key.strip().lower() == "boundary":
            boundary = value.strip().strip('"')
    if not content_type.lower().startswith("multipart/form-data") or not boundary:
        return None
    delimiter = b"--" + boundary.encode("latin-1", "replace")
    wanted = re.compile(rb'(?i)content-disposition:[^\r\n]*;\s*name="?' + re.escape(name.encode())
                        + rb'"?(\s*;|\s*\r\n)')
    at = body.find(delimiter)
    while at >= 0:
        head_start = at + len(delimiter) + 2  # past the CRLF after the delimiter
        head_end = body.find(b"\r\n\r\n", head_start)
        following = body.find(b"\r\n" + delimiter, head_start)
        if head_end < 0 or following < 0 or head_end > following:
            return None
        if wanted.search(body[head_start:head_end + 2]) and b"filename=" not in body[head_start:head_end]:
            start, end = head_end + 4, following
            return body[start:end].decode("utf-8", "replace"), start, end
        at = following + 2
    return None
