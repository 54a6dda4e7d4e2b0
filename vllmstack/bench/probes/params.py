"""The settings each probe and stability mode takes (`--param KEY=VALUE`, `-p KEY=VALUE`).

Declared once, checked before anything is sent: an unknown key, a value of the wrong kind (`true`
for a count, `abc` for a ratio) or out of bounds (`victims=0`) is an error that names the key,
what it needs and the keys that exist. A probe then reads only checked values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllmstack.core.errors import StackError


class ParamError(StackError, ValueError):
    """A --param the probe or mode cannot use; the message names the key and the fix."""


@dataclass(frozen=True)
class Param:
    name: str
    kind: type  # int, float, str, list (of strings), dict (a JSON object)
    minimum: float | None = None
    maximum: float | None = None
    above: bool = False  # the minimum itself is not allowed

    def check(self, owner: str, value: Any) -> Any:
        where = f"--param {self.name}={value!r} for {owner}"
        if self.kind is str:
            if isinstance(value, int | float) and not isinstance(value, bool):
                return str(value)  # `expect=391` means the text "391"
            if not isinstance(value, str):
                raise ParamError(f"{where}: needs text")
            return value
        if self.kind is list:
            if isinstance(value, str):
                return [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ParamError(f"{where}: needs a comma-separated list or a JSON list of text")
            return value
        if self.kind is dict:
            if not isinstance(value, dict):
                raise ParamError(f"{where}: needs a JSON object, e.g. {self.name}='{{\"a\": 1}}'")
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ParamError(f"{where}: needs a {'whole ' if self.kind is int else ''}number")
        if self.kind is int and not isinstance(value, int):
            raise ParamError(f"{where}: needs a whole number")
        if not math.isfinite(value):
            raise ParamError(f"{where}: needs a finite number")
        if self.minimum is not None and (value < self.minimum
                                         or (self.above and value == self.minimum)):
            raise ParamError(f"{where}: must be {'more than' if self.above else 'at least'} "
                             f"{self.minimum:g}")
        if self.maximum is not None and value > self.maximum:
            raise ParamError(f"{where}: must be at most {self.maximum:g}")
        return self.kind(value)


def _count(name: str, minimum: int = 1, maximum: float | None = None) -> Param:
    return Param(name, int, minimum, maximum)


def _seconds(name: str, above: bool = True) -> Param:
    return Param(name, float, 0, None, above)


def _share(name: str) -> Param:
    return Param(name, float, 0, 1)


PARAMS: dict[str, tuple[Param, ...]] = {
    "itl-stall": (_count("victims"), _count("bully_tokens", 128), _count("victim_prompt"),
                  _count("victim_tokens", 2), _count("fire_at"),
                  Param("max_choke", float, 0, None, True), _seconds("start_timeout_s"),
                  _seconds("after_s", above=False)),
    "tool-truncation": (Param("extra_body", dict),),
    "thinkoff": (Param("question", str), Param("expect", str), _count("max_tokens"),
                 Param("routes", list)),
    "prefix-cache": (_count("turns", 2), Param("min_reuse", float, 0, 1, True),
                     _count("context_tokens"), _count("max_tokens")),
    "multi-image": (_count("images", 1, 64), _count("width", 64, 8192), _count("height", 64, 8192),
                    _count("max_tokens")),
    # tg of at least 2: a decode rate needs a token after the first.
    "depth-decay": (_count("pp"), _count("tg", 2), _count("runs", 1, 100),
                    Param("min_of_roofline", float, 0, 1, True), _count("max_depth", 512),
                    Param("attention_backend", str), Param("gpu_vendor", str),
                    Param("gpu_arch", str)),
    "smoke": (),
    "stress": (_count("workers"), _count("requests"), _count("max_tokens")),
    "long": (_count("runs"), _count("max_tokens"), _count("context_tokens", 256),
             _seconds("temperature", above=False), _count("ngram"), _share("max_repeat_share"),
             _share("min_richness")),
}


def check_params(owner: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """The settings for `owner` (a probe or stability mode), checked and converted."""
    declared = {p.name: p for p in PARAMS.get(owner, ())}
    out: dict[str, Any] = {}
    for key, value in given.items():
        param = declared.get(key)
        if param is None:
            known = ", ".join(declared)
            raise ParamError(f"--param {key}: {owner} has no such setting",
                             f"use one of: {known}" if known else f"{owner} takes no --param")
        out[key] = param.check(owner, value)
    return out
