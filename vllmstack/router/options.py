"""The router's start options, checked the same way whichever entry point passed them.

`invoke router` has its values converted by invoke's parser (cli/values); `python -m
vllmstack.router` passes text; a test passes numbers. Either way a bad value ends the start with
`error:` / `fix:` (RouterError), never a traceback: a negative, NaN or infinite duration, a port
outside 1-65535, an unreadable or empty token file, a token shorter than 32 bytes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path

from vllmstack.core.errors import StackError

TOKEN_VAR = "ROUTER_TOKEN"
# The longest wait the router takes: a week; an event loop's timer overflows past ~24 days.
MAX_SECONDS = 7 * 24 * 3600.0
MAX_TOKEN_FILE = 4096
# What a client can send after "Bearer ": visible ASCII, no spaces (RFC 6750's b64token and more).
TOKEN_TEXT = re.compile(r"[\x21-\x7e]+")
# A token is the only lock on a router beyond loopback: short ones fall to guessing (issue 35:
# ROUTER_TOKEN=a was taken). MAKE_TOKEN's 32 random bytes are 43 characters, well over it.
MIN_TOKEN_BYTES = 32
MAKE_TOKEN = "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


class RouterError(StackError):
    """The router cannot start; the message names the setting and the fix."""


def seconds(flag: str, value: float | str | None, *, zero_means: str | None = None
            ) -> float | None:
    """A duration option: finite, not negative, at most a week; 0 only where it means something
    (`zero_means`). None stays None (the default applies)."""
    if value is None:
        return None
    wanted = (f"give {flag} a number of seconds" + (f" (0: {zero_means})" if zero_means else
                                                     " above 0") + f", at most {MAX_SECONDS:g}")
    if isinstance(value, str):
        if not NUMBER.fullmatch(value.strip()):
            raise RouterError(f"{flag} {value[:60]!r} is not a number of seconds", wanted)
        value = float(value)
    number = float(value)
    if not math.isfinite(number) or number < 0 or number > MAX_SECONDS \
            or (number == 0 and zero_means is None):
        raise RouterError(f"{flag} {number:g} is not a usable number of seconds", wanted)
    return number


SWAP_MODES = ("auto", "sleep", "restart")


def swap(value: str | None) -> str | None:
    """--swap: how a swap is done (None: ROUTER_SWAP)."""
    if value is None or value == "":
        return None
    if value not in SWAP_MODES:
        raise RouterError(f"--swap {value[:60]!r} is not a swap mode",
                          f"give --swap one of {', '.join(SWAP_MODES)}")
    return value


def port(value: int | str) -> int:
    text = str(value).strip()
    if not re.fullmatch(r"[0-9]{1,5}", text) or not 1 <= int(text) <= 65535:
        raise RouterError(f"--port {text[:60]!r} is not a port", "give --port a number from 1 to "
                                                                  "65535, e.g. --port 8080")
    return int(text)


def read_token_file(path: str | Path) -> str:
    """The token in a file (one line; surrounding whitespace dropped)."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_TOKEN_FILE + 1)
    except OSError as exc:
        raise RouterError(f"--token-file {path}: {exc.strerror or exc}",
                          "give a readable file holding the token (e.g. chmod 600, one line)") from None
    if len(raw) > MAX_TOKEN_FILE:
        raise RouterError(f"--token-file {path} is over {MAX_TOKEN_FILE} bytes: not a token",
                          "put only the token in the file")
    token = raw.decode("utf-8", errors="replace").strip()
    if not token:
        raise RouterError(f"--token-file {path} is empty", "write the token into the file")
    return checked_token(token, f"the token in {path}")


def checked_token(token: str, where: str) -> str:
    if token and not TOKEN_TEXT.fullmatch(token):
        raise RouterError(f"{where} holds spaces or characters a client cannot send in a header",
                          f"use visible ASCII only, e.g. {MAKE_TOKEN}")
    if token and len(token) < MIN_TOKEN_BYTES:
        raise RouterError(f"{where} is {len(token)} bytes: a token shorter than "
                          f"{MIN_TOKEN_BYTES} bytes can be guessed",
                          f"set {TOKEN_VAR} (or the --token-file) to a random string of at least "
                          f"{MIN_TOKEN_BYTES} bytes, e.g. {MAKE_TOKEN}")
    return token


def choose_token(token: str | None, token_file: str | Path | None, environ: Mapping[str, str],
                 dotenv: str, dotenv_at: str = ".env") -> str:
    """The token clients must send: --token-file, else ROUTER_TOKEN from the environment, else
    from .env (`dotenv`, set at `dotenv_at`: file and line). Never from the command line, where
    `ps` shows it; `token` is for callers in the same process (tests)."""
    if token_file:
        return read_token_file(token_file)
    if token is not None:
        return checked_token(token, "the token")
    if environ.get(TOKEN_VAR):
        return checked_token(environ[TOKEN_VAR], f"{TOKEN_VAR} in the environment")
    return checked_token(dotenv, f"{TOKEN_VAR} (set at {dotenv_at})")
