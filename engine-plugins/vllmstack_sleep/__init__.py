"""A vLLM sleep that frees only the KV cache, for the router's `ROUTER_SLEEP_FREES=kv`.

Runs inside the engine (a vLLM general plugin, found through ../vllmstack_sleep-1.0.dist-info).
vLLM's level-1 sleep backs every weight up in host RAM and releases it, and its wake copies it
back: for an 8B that is 15 GiB each way, about 0.35 s on an H200, on every swap. Where the card
holds the weights of the router's engines side by side, nothing needs to move: this backend
releases only the allocations tagged `kv_cache` (the KV cache, and a hybrid model's state, which
vLLM allocates with it) and keeps everything else mapped. A wake maps them again at the same
addresses (CUDA graphs stay valid), and vLLM's own wake path then does what it does after its
level-1 wake, which discards the same allocations (the prefix cache was cleared by the sleep).

Active only where the engine's environment says VLLMSTACK_SLEEP_FREES=kv: it then stands in for
vLLM's default backend (`cumem`), since vLLM 0.27-0.32 have no flag to pick another. Level 2 is
vLLM's own (the router never asks for it). Where VLLMSTACK_SLEEP_FREES_FILE names a file, each
level-1 sleep reads it first: `all` there makes that sleep vLLM's own level 1 (the weights backed
up in host RAM: the router's tier `asleep`), anything else frees the KV cache only (`kv-released`).
The router writes it before each /sleep, since the environment is fixed at the engine's start
and /sleep takes nothing but its level.
"""

from __future__ import annotations

import gc
import logging
import os
from typing import Any

ENV = "VLLMSTACK_SLEEP_FREES"
FILE_ENV = "VLLMSTACK_SLEEP_FREES_FILE"
FREED_TAG = "kv_cache"
DEFAULT_BACKEND = "cumem"

logger = logging.getLogger("vllm.vllmstack_sleep")


def register() -> None:
    """vLLM calls this in every process it starts (API server, engine core, workers)."""
    if os.environ.get(ENV, "") != "kv":
        return
    try:
        from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
    except ImportError:
        logger.warning("vllmstack_sleep: this vLLM has no pluggable sleep-mode backends: its "
                       "sleep frees the weights too (%s=kv has no effect)", ENV)
        return
    # Registration is lazy (a loader per name); ours replaces the default's loader, so the
    # module with torch and the allocator is imported only in the worker, at its first sleep.
    SleepModeBackendFactory._registry[DEFAULT_BACKEND] = _backend_class


def _backend_class() -> type:
    from vllm.device_allocator.sleep_mode_backend import CuMemBackend

    class KeepWeightsBackend(CuMemBackend):  # type: ignore[misc, valid-type]
        """Level 1 frees the KV cache only; everything else stays mapped on the card."""

        def suspend(self, level: int = 1) -> None:
            if level != 1 or asked_frees() == "all":
                super().suspend(level)
                return
            from vllm.device_allocator import get_mem_allocator_instance

            self._state = "SUSPENDED"
            freed, kept = release_tagged(get_mem_allocator_instance(), FREED_TAG)
            logger.info("vllmstack_sleep: freed %.2f GiB of KV cache, kept %.2f GiB mapped "
                        "(weights) on the card", freed / 2**30, kept / 2**30)

        def resume(self, tags: list[str] | None = None) -> None:
            from vllm.device_allocator import get_mem_allocator_instance

            self._state = "RESUMING"
            map_released(get_mem_allocator_instance(), tags)
            self._state = "RUNNING"

    return KeepWeightsBackend


def asked_frees() -> str:
    """What the router asked this sleep to free: the first word of VLLMSTACK_SLEEP_FREES_FILE
    (kv where there is none, or it cannot be read: the plugin's own sleep)."""
    path = os.environ.get(FILE_ENV, "")
    if not path:
        return "kv"
    try:
        with open(path, encoding="utf-8") as handle:
            words = handle.read(64).split()
    except OSError:
        return "kv"
    return words[0] if words else "kv"


def release_tagged(allocator: Any, tag: str) -> tuple[int, int]:
    """Unmap and release the allocator's allocations with `tag` (their contents are dropped, as
    vLLM's level-1 sleep drops them); the bytes released and the bytes left mapped."""
    from vllm.device_allocator.cumem import unmap_and_release

    freed = kept = 0
    for data in allocator.pointer_to_data.values():
        size = data.handle[1]
        if data.tag != tag or data.is_asleep:
            kept += 0 if data.is_asleep else size
            continue
        try:
            unmap_and_release(data.handle)
        finally:
            data.is_asleep = True
        freed += size
    return freed, kept


def map_released(allocator: Any, tags: list[str] | None) -> None:
    """Map again what a sleep released (of `tags`, or all); never an allocation still mapped,
    which vLLM's own wake would map a second time. A host backup (left by a level-1 sleep of
    vLLM's own) is copied back, as vLLM does."""
    import torch
    from vllm.device_allocator.cumem import create_and_map, libcudart

    gc.collect()
    torch.accelerator.empty_cache()
    for ptr, data in allocator.pointer_to_data.items():
        if not data.is_asleep or (tags is not None and data.tag not in tags):
            continue
        create_and_map(data.handle)
        data.is_asleep = False
        backup = data.cpu_backup_tensor
        if backup is not None:
            libcudart.cudaMemcpy(ptr, backup.data_ptr(), backup.numel() * backup.element_size())
            data.cpu_backup_tensor = None
