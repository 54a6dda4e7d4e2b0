"""The router's peers: other boxes' `invoke router`s whose models this one also offers.

`ROUTER_PEERS=name=URL,...` (the environment, .env, or `--peers`) names them; each peer's token,
the `ROUTER_TOKEN` that peer requires, is read from its own file, `ROUTER_PEER_TOKEN_DIR/NAME.token`
(default `~/.config/vllmstack/peer-tokens`), never from the setting itself: .env is printed by
`invoke config` and argv by `ps`, and a token file is what the router's own token takes
(options.read_token_file). A file that others may read is refused, as ssh refuses a key.

Every mistake stops the start naming the key, where it was set (file:line) and the fix.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from vllmstack.config.profiles import Resolved
from vllmstack.core import access
from vllmstack.router.options import MAX_TOKEN_FILE, RouterError, checked_token

PEERS_VAR = "ROUTER_PEERS"
TOKEN_DIR_VAR = "ROUTER_PEER_TOKEN_DIR"
DEFAULT_TOKEN_DIR = "~/.config/vllmstack/peer-tokens"
PEER_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
EXAMPLE = "ROUTER_PEERS=box2=http://192.168.1.20:8080"


@dataclass(frozen=True)
class Peer:
    """One peer router: its name (how errors and /v1/models call it), base URL and token."""

    name: str
    url: str
    token: str
    token_file: Path


def parse_peers(text: str, *, where: str, token_dir: Path) -> list[Peer]:
    """The peers of `text` (ROUTER_PEERS' value, set at `where`), each with its token read from
    `token_dir`. Empty text: no peers."""
    peers: list[Peer] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        name, sep, url = item.partition("=")
        name, url = name.strip(), url.strip()
        if not sep or not PEER_NAME.fullmatch(name):
            raise RouterError(
                f"{PEERS_VAR} (set at {where}): {item[:80]!r} is not name=URL",
                "give each peer as name=URL, the name lower-case letters, digits, - or _ "
                f"(at most 32), e.g. {EXAMPLE}")
        if any(p.name == name for p in peers):
            raise RouterError(f"{PEERS_VAR} (set at {where}) names the peer {name!r} twice",
                              "give each peer once, under a name of its own")
        base = checked_url(name, url, where)
        token_file = token_dir / f"{name}.token"
        peers.append(Peer(name, base, read_peer_token(token_file, name), token_file))
    return peers


def checked_url(name: str, url: str, where: str) -> str:
    """A peer's base URL without a trailing slash: http(s)://host[:port], nothing else (the
    router adds the OpenAI paths itself; a user:password@ would put a secret into the setting)."""
    fix = (f"give the peer's router as http://HOST:PORT (its `invoke router --host` and --port), "
           f"e.g. {EXAMPLE}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise RouterError(f"{PEERS_VAR} (set at {where}): the URL of peer {name!r}, "
                          f"{url[:80]!r}, has a bad port", fix) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RouterError(f"{PEERS_VAR} (set at {where}): the URL of peer {name!r}, {url[:80]!r}, "
                          "is not an http:// or https:// address", fix)
    if parts.username is not None or parts.password is not None:
        raise RouterError(f"{PEERS_VAR} (set at {where}): the URL of peer {name!r} holds a user "
                          "or password", f"put the peer's token into its token file instead; {fix}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise RouterError(f"{PEERS_VAR} (set at {where}): the URL of peer {name!r}, {url[:80]!r}, "
                          "has a path, query or fragment", fix)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


def read_peer_token(path: Path, name: str) -> str:
    """The token of peer `name` in `path`: a regular file only its owner may read."""
    fix = (f"write peer {name!r}'s ROUTER_TOKEN (one line) into {path} and `chmod 600` it, or "
           f"point {TOKEN_DIR_VAR} at the folder holding NAME.token files")
    try:
        info = path.stat()
    except OSError as exc:
        raise RouterError(f"the token file of peer {name!r}, {path}: "
                          f"{exc.strerror or exc}", fix) from None
    if not stat.S_ISREG(info.st_mode):
        raise RouterError(f"the token file of peer {name!r}, {path}, is not a regular file", fix)
    if info.st_mode & 0o077:
        raise RouterError(f"the token file of peer {name!r}, {path}, may be read by others "
                          f"(mode {stat.S_IMODE(info.st_mode):o})", f"chmod 600 {path}")
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_TOKEN_FILE + 1)
    except OSError as exc:
        raise RouterError(f"the token file of peer {name!r}, {path}: "
                          f"{exc.strerror or exc}", fix) from None
    token = raw.decode("utf-8", errors="replace").strip()
    if len(raw) > MAX_TOKEN_FILE or not token:
        raise RouterError(f"the token file of peer {name!r}, {path}, holds no token", fix)
    return checked_token(token, f"the token file of peer {name!r}, {path},")


def token_folder(value: str, *, root: Path, environ: Mapping[str, str]) -> Path:
    """ROUTER_PEER_TOKEN_DIR as a folder: `~` is the HOME of `environ`, a relative path lies in
    the checkout (`root`)."""
    text = value or DEFAULT_TOKEN_DIR
    if text == "~" or text.startswith("~/"):
        home = environ.get("HOME") or os.path.expanduser("~")
        text = home + text[1:]
    path = Path(text)
    return path if path.is_absolute() else root / path


def read_peers(value: str | None, where: str, token_dir: str, *, root: Path,
               environ: Mapping[str, str]) -> list[Peer]:
    """The peers the router starts with: `value` (--peers, else ROUTER_PEERS as set at `where`)."""
    if not value:
        return []
    return parse_peers(value, where=where,
                       token_dir=token_folder(token_dir, root=root, environ=environ))


def start_peers(resolved: Resolved, environ: Mapping[str, str], *, root: Path,
                peers: str | None = None, token_dir: str | None = None) -> list[Peer]:
    """The peers the router starts with: --peers, else ROUTER_PEERS from the environment, else
    from .env (`resolved`, named by file and line in every error); their token folder likewise."""
    if peers:
        value, where = peers, "--peers"
    elif environ.get(PEERS_VAR):
        value, where = environ[PEERS_VAR], "the environment"
    else:
        value, where = resolved.get_raw(PEERS_VAR), resolved.source(PEERS_VAR) or ".env"
    folder = token_dir or environ.get(TOKEN_DIR_VAR) or resolved.get_raw(TOKEN_DIR_VAR)
    return read_peers(value, where, folder, root=root, environ=environ)


def plain_loopback(url: str) -> bool:
    """Whether a peer's URL is https, or http to this machine: nothing crosses a network in the
    clear (the link's token is a bearer token)."""
    parts = urlsplit(url)
    return parts.scheme == "https" or access.is_loopback(parts.hostname or "")
