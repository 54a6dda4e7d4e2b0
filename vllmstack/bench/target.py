"""What a benchmark talks to: an explicit URL, or the running stack described by its profile."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from vllmstack.config.profiles import Resolved

PIN_KEY = re.compile(r"^[A-Z0-9_]+_(REF|VERSION|IMAGE)$")


class TargetError(ValueError):
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
        }


def pins_of(resolved: Resolved) -> dict[str, str]:
    """Build pins (refs, versions, images) from the resolved profile; empty values left out."""
    return {k: s.value for k, s in sorted(resolved.values.items())
            if PIN_KEY.match(k) and s.value}


def _int_or_none(value: str | None, key: str) -> int | None:
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
    port = resolved.get("VLLM_PORT") or "8180"
    served = model or resolved.get("VLLM_SERVED_NAME")
    if not served:
        raise TargetError("no model name: pass --model or set VLLM_SERVED_NAME in the profile")
    prefix = resolved.get("VLLM_ENABLE_PREFIX_CACHING")
    return Target(
        url=url or f"http://127.0.0.1:{port}",
        model=served,
        tokenizer=tokenizer or resolved.get("VLLM_TOKENIZER") or resolved.get("VLLM_MODEL"),
        max_num_seqs=max_num_seqs or _int_or_none(resolved.get("VLLM_MAX_NUM_SEQS"),
                                                  "VLLM_MAX_NUM_SEQS"),
        max_model_len=_int_or_none(resolved.get("VLLM_MAX_MODEL_LEN"), "VLLM_MAX_MODEL_LEN"),
        prefix_caching=None if prefix in (None, "") else prefix.lower() in ("1", "true", "yes"),
        api_key=resolved.get("VLLM_API_KEY") or None,
        profile=resolved.profile,
        platform=resolved.platform,
        pins=pins_of(resolved),
        from_profile=url is None,
    )


def target_from_url(
    url: str, model: str, *, tokenizer: str | None = None, max_num_seqs: int | None = None,
    api_key: str | None = None,
) -> Target:
    if not model:
        raise TargetError("--model is required together with --url (the served model name)")
    return Target(url=url, model=model, tokenizer=tokenizer, max_num_seqs=max_num_seqs,
                  api_key=api_key)
