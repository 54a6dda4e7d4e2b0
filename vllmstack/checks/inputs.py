"""Checks of what settings turn into outside the stack: generated files, mounts, published ports.

A value reaches Compose through generated/compose.env (read by python-dotenv or compose-go) and
through the rendered override (volume specs split on ':'), and the engine through ENGINE_ENV's
words. A value one of those would read differently from what the setting says is refused here,
with its key and the file:line that set it, before `up` writes anything.
"""

from __future__ import annotations

import ipaddress

from vllmstack.checks.context import CheckContext
from vllmstack.core.files import env_value_problem
from vllmstack.core.findings import Finding
from vllmstack.runtime.engine_env import engine_env_words, stack_paths

# Settings whose value goes into generated/compose.env as it is.
COMPOSE_ENV_KEYS = ("VLLM_IMAGE", "DASHBOARD_IMAGE", "VLLM_BIND", "VLLM_PORT", "DASHBOARD_BIND",
                    "DASHBOARD_PORT", "DASHBOARD_TOKEN")
ENV_FILE = "generated/compose.env"


def _containers(ctx: CheckContext) -> bool:
    """compose.env and the override exist only for the container runtimes."""
    return ctx.runtime != "native"


def _path_origin(ctx: CheckContext, *keys: str) -> tuple[str, str | None]:
    """The first of `keys` that is set (the one a derived path comes from), else the first key
    (the one to set) with $HOME as the source."""
    for key in keys:
        if ctx.get(key):
            return key, ctx.src(key)
    return keys[0], "$HOME"


def _cache_paths(ctx: CheckContext) -> list[tuple[str, str | None, str]]:
    """(key, source, host path) of the folders compose.env carries and compose.yaml mounts."""
    paths = stack_paths(ctx.resolved, ctx.environ)
    hf_key, hf_src = _path_origin(ctx, "HF_CACHE_DIR", "HOST_CACHE_DIR")
    cache_key, cache_src = _path_origin(ctx, "HOST_CACHE_DIR")
    return [(hf_key, hf_src, str(paths.hf_cache)), (cache_key, cache_src, str(paths.engine_cache))]


def rule_env_file_values(ctx: CheckContext) -> list[Finding]:
    """Every value compose.env carries must read back the same in python-dotenv (Compose v1,
    podman-compose) and compose-go (Compose v2): no ', \\, $ or control characters."""
    if not _containers(ctx):
        return []
    out: list[Finding] = []
    values = [(key, ctx.src(key), ctx.resolved.get_str(key)) for key in COMPOSE_ENV_KEYS]
    seen: set[tuple[str, str | None]] = set()  # HOST_CACHE_DIR feeds two paths: say it once
    for key, source, value in [*values, *_cache_paths(ctx)]:
        problem = env_value_problem(value)
        if problem is None or (key, source) in seen:
            continue
        seen.add((key, source))
        origin = " (derived from $HOME)" if source == "$HOME" else ""
        out.append(Finding(
            "error", "env-file-value",
            f"{key}{origin} {problem}: {ENV_FILE} cannot carry it exactly, and Compose would read "
            "another value (a quote or newline could even set other variables)",
            key=key, source=source,
            fix=f"remove the character from {key}" + (
                " (a token of letters and digits: openssl rand -hex 32)" if "TOKEN" in key
                else "; paths, images and addresses need none of ' \\ $ or control characters")))
    return out


def rule_mount_paths(ctx: CheckContext) -> list[Finding]:
    """Volume specs are `HOST:CONTAINER[:MODE]`: a ':' in a host path would change the mount."""
    if not _containers(ctx):
        return []
    out: list[Finding] = []
    mounted = _cache_paths(ctx)
    if ctx.get("MODELS_DIR"):
        mounted.append(("MODELS_DIR", ctx.src("MODELS_DIR"), ctx.get("MODELS_DIR")))
    for key, source, path in mounted:
        if ":" in path:
            out.append(Finding(
                "error", "mount-path-colon",
                f"{key} {path!r} contains ':'; Compose splits a volume at ':' (HOST:CONTAINER:MODE), "
                "so the folder would be mounted somewhere else, or with other options",
                key=key, source=source, fix=f"use a folder whose path has no ':' for {key}"))
    root = str(ctx.project.root)
    if ":" in root:
        out.append(Finding(
            "error", "mount-path-colon",
            f"the project folder {root!r} contains ':'; its chat templates, tuned configs and "
            "overlays are mounted into the engine by path", source=root,
            fix="move (or clone) the project to a path without ':'"))
    return out


def rule_bind_addresses(ctx: CheckContext) -> list[Finding]:
    """Compose publishes ports as BIND:PORT:PORT, so a bind must be a plain IPv4 address."""
    if not _containers(ctx):
        return []
    out: list[Finding] = []
    for key in ("VLLM_BIND", "DASHBOARD_BIND"):
        value = ctx.resolved.get_str(key)
        try:
            address = ipaddress.ip_address(value)
        except ValueError:
            address = None
        if address is None or address.version != 4:
            out.append(ctx.finding(
                "error", "bad-bind", key,
                f"{key}={value!r} is not an IPv4 address; Compose publishes the port as "
                f"{key}:PORT:PORT, where anything else changes or breaks the mapping",
                fix=f"use 127.0.0.1 (this host only) or 0.0.0.0 (every interface) for {key}"))
    return out


def rule_engine_env(ctx: CheckContext) -> list[Finding]:
    """Each ENGINE_ENV word is KEY=VALUE with a variable name; any other word would be dropped."""
    if not ctx.usable("ENGINE_ENV"):
        return []  # not shell words at all: validation reports it
    _, bad = engine_env_words(ctx.get("ENGINE_ENV"))
    return [ctx.finding(
        "error", "engine-env-word", "ENGINE_ENV",
        f"ENGINE_ENV word {word!r} is not KEY=VALUE with a variable name, so it cannot reach "
        "the engine's environment",
        fix="write each variable as KEY=VALUE (quote a value with spaces: 'KEY=a b')")
        for word in bad]


# Keys that decide what the host exposes, mounts or runs as. They belong to the machine (.env,
# --set), not to a profile someone shares: a profile that sets one is pointed out.
HOST_KEYS = ("USER_UID", "USER_GID", "VLLM_BIND", "DASHBOARD_BIND", "DASHBOARD_TOKEN",
             "HOST_CACHE_DIR", "HF_CACHE_DIR", "MODELS_DIR")


def rule_profile_host_keys(ctx: CheckContext) -> list[Finding]:
    out: list[Finding] = []
    for key in HOST_KEYS:
        source = ctx.src(key) or ""
        if source.startswith("env/"):
            out.append(ctx.finding(
                "warning", "profile-sets-host-key", key,
                f"the profile layer {source} sets {key}={ctx.get(key)!r}: it decides what this "
                "host exposes, mounts or runs the engine as, for everyone who uses the profile",
                fix=f"move {key} into .env (this machine's file), or remove it from the profile"))
    return out
