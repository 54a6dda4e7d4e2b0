"""Reading a Hugging Face config.json: the parts both the geometry facts and the weight count need."""

from __future__ import annotations

from typing import Any


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal checkpoints nest the language model's geometry under text_config."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def full_attention_layers(cfg: dict[str, Any]) -> int | None:
    """Layers with full attention: from layer_types, else every full_attention_interval-th
    layer, else all of them (None when the config gives no layer count)."""
    layers = cfg.get("num_hidden_layers")
    layer_types = cfg.get("layer_types")
    interval = cfg.get("full_attention_interval")
    if isinstance(layer_types, list) and layer_types:
        return sum(1 for t in layer_types if t in ("full_attention", "attention"))
    if interval and layers:
        return int(layers) // int(interval)
    return int(layers) if isinstance(layers, int | float) else None
