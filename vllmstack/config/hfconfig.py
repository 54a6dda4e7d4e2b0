"""Reading a Hugging Face config.json: the parts the geometry facts, the weight count and the
tuner's shapes need.

config.json is the model's file, not the stack's: it may be a download cut short, edited by hand,
or anything at all. So it is read with the bounds of the stack's own JSON (core/files: a size
limit, no FIFO or device, no deep nesting), and every field is checked where it is read: a whole
number that is a JSON integer (not a string, a decimal, a boolean, NaN or 1e308) within a bound no
real model comes near, a flag that is true/false, a name that is a string. A bad or missing field
is a ModelConfigError naming the file and the key, with what to do. NaN is let through the parse
(Python's json, which transformers uses, accepts it) so that the field that holds it is named; a
NaN in a field the stack never reads is the engine's business.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllmstack.core.errors import StackError
from vllmstack.core.files import JsonFileError, read_json_file

# Real config.json files are a few KiB (a multimodal one with label maps some hundred KiB).
CONFIG_MAX_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class Bounds:
    """The whole numbers a field may hold: far outside what any real model has, and small
    enough that the products the projections make stay exact and finite."""

    low: int
    high: int


LAYERS = Bounds(1, 10**6)  # num_hidden_layers, heads, full_attention_interval
COUNT = Bounds(0, 10**6)  # expert counts, MTP layers, vision depth: 0 is "none"
WIDTH = Bounds(1, 2**20)  # hidden_size, head_dim, linear head dims, conv kernel
SIZE = Bounds(0, 2**20)  # intermediate sizes: 0 is "none" (an MoE model's dense MLP)
VOCAB = Bounds(1, 2**24)
POSITIONS = Bounds(1, 2**32)  # max_position_embeddings (10M-token windows exist)

# The keys a linear-attention (Gated DeltaNet) layer's state and weights are sized by.
LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
               "linear_value_head_dim")


class ModelConfigError(StackError):
    """A model's config.json cannot be read, or a field the stack reads from it is missing or
    holds a value no model has; names the file and the key."""

    def __init__(self, cause: str, fix: str | None = None, *, path: Path | None = None,
                 key: str | None = None) -> None:
        super().__init__(cause, fix)
        self.path, self.key = path, key


def read_config(path: Path) -> dict[str, Any] | None:
    """The object in config.json at `path`, None when there is no such file. Anything else that
    keeps it from being used (not a regular file, too large, not UTF-8 or JSON, nested too
    deeply, not an object) is a ModelConfigError naming it, before or while it is read."""
    fix = (f"replace {path} with the model's own config.json (download the model again), or "
           "point VLLM_MODEL (or VLLM_HF_CONFIG_PATH) at a folder that holds it")
    try:
        value = read_json_file(path, str(path), fix=fix, max_bytes=CONFIG_MAX_BYTES,
                               allow_nan=True)
    except JsonFileError as exc:
        cause = (f"{path} is larger than {CONFIG_MAX_BYTES} bytes: no model's config.json is"
                 if exc.reason.startswith("is larger than") else exc.cause)
        raise ModelConfigError(cause, fix, path=path) from None
    return value if isinstance(value, dict) else None


def describe(value: Any) -> str:
    """A JSON value as an error message shows it: short, escaped, and what kind it is."""
    if isinstance(value, bool):
        return f"{'true' if value else 'false'} (a boolean)"
    if isinstance(value, str):
        return f"{value[:40]!r}{'...' if len(value) > 40 else ''} (a string)"
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        return f"{value!r} (a decimal number)"
    if isinstance(value, int):
        text = str(value)
        return text if len(text) <= 24 else f"{text[:12]}... (a {len(text)}-digit number)"
    if isinstance(value, list | dict):
        text = json.dumps(value)
        kind = "a list" if isinstance(value, list) else "an object"
        return f"{text[:40]}{'...' if len(text) > 40 else ''} ({kind})"
    return repr(value)


class HfConfig:
    """A config.json's fields as the stack reads them, each checked as it is read.

    The language model's fields are text_config's over the top level's (multimodal checkpoints
    nest them there); a key is named as it is written (text_config.num_hidden_layers). `name`
    prefixes the keys of a nested object (vision_config.), which has no text_config of its own.
    """

    def __init__(self, data: Mapping[str, Any], path: Path | None = None, *,
                 name: str = "") -> None:
        self.data, self.path, self.name = data, path, name
        inner = None if name else data.get("text_config")
        if inner is not None and not isinstance(inner, dict):
            raise self.bad("text_config", inner, "not an object",
                           "an object holding the language model's fields")
        self.inner: Mapping[str, Any] = inner or {}

    @property
    def file(self) -> str:
        return str(self.path) if self.path else "config.json"

    def lookup(self, key: str, *, top: bool = False) -> tuple[str, Any]:
        """(the key as written, its value or None); `top`: the top level's only."""
        if not top and self.inner.get(key) is not None:
            return f"text_config.{key}", self.inner[key]
        return self.name + key, self.data.get(key)

    def has(self, key: str) -> bool:
        return self.lookup(key)[1] is not None

    def where(self, key: str) -> str:
        """Where a missing key belongs: under text_config when the file has one."""
        return f"text_config.{key}" if self.inner else self.name + key

    def bad(self, shown: str, value: Any, problem: str, want: str) -> ModelConfigError:
        return ModelConfigError(
            f"{self.file}: {shown} is {describe(value)}, {problem}",
            f"set {shown} in {self.file} to {want}, as the model's published config.json has "
            "it (or download the model again)", path=self.path, key=shown)

    def missing(self, key: str, why: str) -> ModelConfigError:
        shown = self.where(key)
        return ModelConfigError(
            f"{self.file}: {shown} is missing: {why}",
            f"add {shown} to {self.file} from the model's published config.json (or download "
            "the model again)", path=self.path, key=shown)

    def number(self, key: str, bounds: Bounds, *, top: bool = False) -> int | None:
        """A whole number within `bounds`; None when the key is missing or null."""
        shown, value = self.lookup(key, top=top)
        return None if value is None else self.whole(shown, value, bounds)

    def whole(self, shown: str, value: Any, bounds: Bounds) -> int:
        want = f"a whole number from {bounds.low} to {bounds.high}"
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.bad(shown, value, "not a whole number", want)
        if not bounds.low <= value <= bounds.high:
            raise self.bad(shown, value, f"not between {bounds.low} and {bounds.high}", want)
        return value

    def flag(self, key: str, default: bool) -> bool:
        shown, value = self.lookup(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.bad(shown, value, "not true or false", "true or false")
        return value

    def text(self, key: str, *, top: bool = False) -> str | None:
        shown, value = self.lookup(key, top=top)
        if value is not None and not isinstance(value, str):
            raise self.bad(shown, value, "not a string", "a string")
        return value

    def names(self, key: str) -> list[str] | None:
        """A list of strings (layer_types)."""
        shown, value = self.lookup(key)
        if value is None:
            return None
        if not isinstance(value, list):
            raise self.bad(shown, value, "not a list of names", "a list of names")
        for index, item in enumerate(value):
            if not isinstance(item, str):
                raise self.bad(f"{shown}[{index}]", item, "not a name", "a name in quotes")
        return value

    def section(self, key: str, *, top: bool = False) -> HfConfig | None:
        """A nested object (vision_config, quantization_config) read the same way."""
        shown, value = self.lookup(key, top=top)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.bad(shown, value, "not an object", "an object")
        return HfConfig(value, self.path, name=shown + ".")

    def block(self, key: str) -> tuple[int, int] | None:
        """A pair of whole numbers (quantization_config.weight_block_size)."""
        shown, value = self.lookup(key)
        if value is None:
            return None
        if not (isinstance(value, list) and len(value) == 2):
            raise self.bad(shown, value, "not a pair of whole numbers",
                           f"two whole numbers from 1 to {WIDTH.high}, e.g. [128, 128]")
        return self.whole(f"{shown}[0]", value[0], WIDTH), self.whole(f"{shown}[1]", value[1], WIDTH)


def full_attention_layers(cfg: HfConfig) -> int | None:
    """Layers with full attention: from layer_types, else every full_attention_interval-th
    layer, else all of them (None when the config gives no layer count)."""
    layers = cfg.number("num_hidden_layers", LAYERS)
    layer_types = cfg.names("layer_types")
    if layer_types:
        if layers is not None and len(layer_types) != layers:
            shown = cfg.lookup("layer_types")[0]
            raise ModelConfigError(
                f"{cfg.file}: {shown} names {len(layer_types)} layers but num_hidden_layers is "
                f"{layers}", f"make {shown} list one type per layer in {cfg.file}, as the "
                "model's published config.json does (or download the model again)",
                path=cfg.path, key=shown)
        return sum(1 for t in layer_types if t in ("full_attention", "attention"))
    interval = cfg.number("full_attention_interval", LAYERS)
    if interval and layers:
        return layers // interval
    return layers


@dataclass(frozen=True)
class LinearAttention:
    """The linear-attention (Gated DeltaNet) layers of a hybrid such as Qwen3.5/3.6 or
    Qwen3-Next: how many, and the geometry their state and weights are sized by."""

    layers: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int


def linear_attention(cfg: HfConfig) -> LinearAttention | None:
    """The model's linear-attention layers; None for a model without them (no linear_* key, or
    every layer full attention). A model with them that lacks one of the linear_* keys is a
    ModelConfigError naming it: its state size and weights are unknown."""
    layers = cfg.number("num_hidden_layers", LAYERS)
    full = full_attention_layers(cfg)
    # Only Qwen's linear_* keys say the other layers are Gated DeltaNet: a layer_types entry
    # alone may be another family's (sliding window, convolution), sized by keys of its own.
    declared = [cfg.lookup(k)[0] for k in LINEAR_KEYS if cfg.has(k)]
    if not declared or layers is None or full is None or layers - full <= 0:
        return None
    values: list[int] = []
    for key in LINEAR_KEYS:
        value = cfg.number(key, LAYERS if "num" in key else WIDTH)
        if value is None:
            raise cfg.missing(key, f"the model has {layers - full} linear-attention layers "
                              f"({', '.join(declared)}), and their size needs it")
        values.append(value)
    kernel = cfg.number("linear_conv_kernel_dim", WIDTH)
    key_heads, value_heads, key_dim, value_dim = values
    return LinearAttention(layers - full, key_heads, value_heads, key_dim, value_dim,
                           4 if kernel is None else kernel)


def expert_count(cfg: HfConfig) -> int:
    """Routed experts under any of the names the families use; 0 for a dense model."""
    return (cfg.number("num_experts", COUNT) or cfg.number("n_routed_experts", COUNT)
            or cfg.number("num_local_experts", COUNT) or 0)


def quant_method(cfg: HfConfig) -> str | None:
    """quantization_config.quant_method, lower case (text_config's, else the top level's)."""
    quant = cfg.section("quantization_config")
    if quant is None:
        return None
    return (quant.text("quant_method") or "").lower()
