"""What a benchmark talks to: an explicit URL, or the running stack described by its profile.

The dashboard's engine and listening address come from the profile here too (`dashboard_target`),
so every profile key the benchmarks and the dashboard read is read in one module.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllmstack.config.modelinfo import profile_hf_cache
from vllmstack.config.profiles import Resolved, resolve
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project

PIN_KEY = re.compile(r"^[A-Z0-9_]+_(REF|VERSION|IMAGE)$")
# What the depth-decay probe's verdict names and picks its fix by; the server reports none of them
# over HTTP but the KV dtype (vllm:cache_config_info).
PROBE_KEYS = ("ATTENTION_BACKEND", "VLLM_KV_CACHE_DTYPE", "GPU_VENDOR", "GPU_ARCH")


class TargetError(StackError, ValueError):
    """The target cannot be worked out; the message names the missing key or flag."""


@dataclass
class Target:
    url: str
    model: str
    tokenizer: str | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None  # from the profile; the live value from /v1/models wins
    prefix_caching: bool | None = None
    api_key: str | None = None
    profile: str | None = None
    platform: str | None = None
    pins: dict[str, str] = field(default_factory=dict)
    from_profile: bool = False
    # The stack's Hugging Face cache (HF_HOME of the engine) when the profile moves it
    # (HF_CACHE_DIR / HOST_CACHE_DIR): a tokenizer given as a hub id is looked up there first.
    hf_cache: str | None = None
    # What the card and the model allow at best (bench/report/roofline.py); None on a CPU platform.
    roofline: dict[str, Any] | None = None
    settings: dict[str, str] = field(default_factory=dict)  # PROBE_KEYS the profile sets

    def describe(self) -> dict[str, Any]:
        """The part of a history record that says what was measured."""
        return {
            "url": self.url,
            "model": self.model,
            "tokenizer": self.tokenizer,
            "profile": self.profile,
            "platform": self.platform,
            "pins": dict(self.pins),
            "from_profile": self.from_profile,
            "roofline": self.roofline,
        }


def made_for(resolved: Resolved) -> set[str]:
    """The platforms a model profile declares (PROFILE_PLATFORMS); empty: it names none."""
    return {p.strip() for p in (resolved.get("PROFILE_PLATFORMS") or "").split(",") if p.strip()}


def shared_platform(project: Project, environ: Mapping[str, str], profiles: Sequence[str],
                    platform: str | None) -> tuple[str | None, str | None]:
    """The platform to run several profiles on when --platform is not given: .env's when every
    profile is made for it, else the one platform they are all made for (with a note saying so).

    Returns (platform, note); (platform, None) when given or .env's fits. TargetError when the
    profiles are made for several platforms but not .env's, or share none: a run on a platform
    the profiles are not made for fails profile by profile, after minutes of starting engines."""
    if platform is not None or not profiles:
        return platform, None
    default = None
    wanted: set[str] | None = None
    for name in profiles:
        resolved = resolve(project, model=name, environ=environ)
        default = resolved.platform
        declared = made_for(resolved)
        if declared:
            wanted = declared if wanted is None else wanted & declared
    if wanted is None or (default is not None and default in wanted):
        return None, None
    if len(wanted) == 1:
        (only,) = wanted
        return only, (f"note: platform {only}: every target is made for it (PROFILE_PLATFORMS), "
                      f"not for .env's {default}; --platform picks another")
    listed = ", ".join(sorted(wanted)) or "none"
    raise TargetError(
        f"the profiles {', '.join(profiles)} are not all made for .env's platform {default} "
        f"(PROFILE_PLATFORMS); the platforms they share: {listed}",
        f"pass --platform NAME ({listed})" if wanted else
        "pick profiles made for one platform (invoke profiles lists them), or pass --platform")


def pins_of(resolved: Resolved) -> dict[str, str]:
    """Build pins (refs, versions, images) from the resolved profile; empty values left out."""
    return {k: s.value for k, s in sorted(resolved.values.items())
            if PIN_KEY.match(k) and s.value}


def int_or_none(value: str | None, key: str) -> int | None:
    """A whole number from a profile value; None when unset, TargetError naming `key` when not."""
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise TargetError(f"{key}={value!r} is not a whole number; fix it in the profile") from exc


def target_from_profile(
    resolved: Resolved,
    *,
    url: str | None = None,
    model: str | None = None,
    tokenizer: str | None = None,
    max_num_seqs: int | None = None,
) -> Target:
    """The stack's endpoint from the profile; explicit arguments override single fields.

    With an explicit URL the profile still supplies the pins and names for the record, but the
    server may be something else, so `from_profile` is False then.
    """
    port = resolved.get_str("VLLM_PORT")
    served = model or resolved.get("VLLM_SERVED_NAME")
    if not served:
        raise TargetError("no model name: pass --model or set VLLM_SERVED_NAME in the profile")
    prefix = resolved.get("VLLM_ENABLE_PREFIX_CACHING")
    return Target(
        url=url or f"http://127.0.0.1:{port}",
        model=served,
        tokenizer=tokenizer or resolved.get("VLLM_TOKENIZER") or resolved.get("VLLM_MODEL"),
        max_num_seqs=max_num_seqs or int_or_none(resolved.get("VLLM_MAX_NUM_SEQS"),
                                                 "VLLM_MAX_NUM_SEQS"),
        max_model_len=int_or_none(resolved.get("VLLM_MAX_MODEL_LEN"), "VLLM_MAX_MODEL_LEN"),
        prefix_caching=None if prefix in (None, "") else prefix.lower() in ("1", "true", "yes"),
        api_key=resolved.get("VLLM_API_KEY") or None,
        profile=resolved.profile,
        platform=resolved.platform,
        pins=pins_of(resolved),
        from_profile=url is None,
        hf_cache=profile_hf_cache(resolved),
        settings={key: value for key in PROBE_KEYS if (value := resolved.get(key) or "")},
    )


def target_from_url(
    url: str, model: str, *, tokenizer: str | None = None, max_num_seqs: int | None = None,
    api_key: str | None = None,
) -> Target:
    if not model:
        raise TargetError("--model is required together with --url (the served model name)")
    return Target(url=url, model=model, tokenizer=tokenizer, max_num_seqs=max_num_seqs,
                  api_key=api_key)


@dataclass(frozen=True)
class DashboardTarget:
    """The engine a dashboard reads and runs benchmarks against, and where it listens."""

    engine_url: str
    host: str
    port: int
    token: str
    tokenizer: str | None
    max_num_seqs: int | None


def dashboard_target(
    resolved: Resolved,
    *,
    host: str | None = None,
    port: int | None = None,
    engine_url: str | None = None,
    tokenizer: str | None = None,
) -> DashboardTarget:
    """For `invoke dashboard`: the resolved profile's values, then the task's flags.

    Against the profile's own engine the tokenizer and max_num_seqs come from the profile; against
    another engine URL only --tokenizer counts (the profile's tokenizer and limits may belong to
    another model).
    """
    own_engine = engine_url is None
    if tokenizer is None and own_engine:
        tokenizer = resolved.get("VLLM_TOKENIZER") or None
    return DashboardTarget(
        engine_url=engine_url or f"http://127.0.0.1:{resolved.get_str('VLLM_PORT')}",
        host=host or resolved.get_str("DASHBOARD_BIND"),
        port=port or resolved.get_int("DASHBOARD_PORT"),
        token=resolved.get_str("DASHBOARD_TOKEN"),
        tokenizer=tokenizer,
        max_num_seqs=(int_or_none(resolved.get("VLLM_MAX_NUM_SEQS"), "VLLM_MAX_NUM_SEQS")
                      if own_engine else None),
    )
