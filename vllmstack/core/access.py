"""Who may change state on a local HTTP service: the dashboard's and the router's one rule.
(The router applies it to every request, reads included: its /v1/health and /v1/models tell
what the engines run, as vLLM's --api-key refuses them too.)

A service reachable from other machines (bound beyond loopback) must be given a token, and then
every state-changing request must carry it; a token set on a loopback service is required too.
Without a token (loopback only), a state-changing request must name a loopback Host and, when a
browser sent it, a loopback Origin, so a web page or a DNS-rebinding name cannot drive the
service from the user's own browser. Each service words its refusals itself (which setting holds
its token differs); the decision is made here, once.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Mapping
from urllib.parse import urlsplit

# Why a state-changing request was refused (None: allowed).
NEEDS_TOKEN = "needs-token"  # answered 401: the token is missing or wrong
NOT_LOCAL = "not-local"  # answered 403: no token in use, and Host or Origin is not loopback


def is_loopback(host: str) -> bool:
    host = host.strip().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def token_required(exposed_on: str, token: str) -> bool:
    """A token set is a token required; beyond loopback one is always required."""
    return bool(token) or not is_loopback(exposed_on)


def exposed_without_token(exposed_on: str, token: str) -> bool:
    """The service would listen beyond loopback with no token: refuse to start it."""
    return not is_loopback(exposed_on) and not token


def sent_token(headers: Mapping[str, str], token_header: str | None = None) -> str:
    """The token a request carries: `token_header` (e.g. X-Dashboard-Token) first, else
    `Authorization: Bearer TOKEN`. `headers` is looked up with lower-case names."""
    sent = headers.get(token_header, "") if token_header else ""
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        sent = sent or auth[7:].strip()
    return sent


def _octets(text: str) -> bytes:
    """`text` as bytes to compare, whatever it holds: aiohttp decodes a header's bytes as UTF-8
    with surrogateescape, so a non-ASCII token arrives holding lone surrogates that a plain
    encode() refuses (a 500 instead of a 401, issue 35); such a token never equals a real one."""
    return text.encode("utf-8", "surrogatepass")


def write_denial(headers: Mapping[str, str], *, token: str, required: bool,
                 token_header: str | None = None) -> str | None:
    """Why a state-changing request with these headers is refused: NEEDS_TOKEN, NOT_LOCAL or
    None (allowed). `required` is token_required() for where the service is reachable."""
    if required:
        sent = sent_token(headers, token_header)
        if not sent or not hmac.compare_digest(_octets(sent), _octets(token)):
            return NEEDS_TOKEN
        return None
    host = urlsplit("//" + headers.get("host", "")).hostname or ""
    origin = headers.get("origin")
    origin_host = urlsplit(origin).hostname if origin and origin != "null" else None
    if not is_loopback(host) or (origin is not None and not (origin_host and is_loopback(origin_host))):
        return NOT_LOCAL
    return None
