"""A stand-in for vLLM's OpenAI server (0.27.1), for tests only. Python 3 standard library only.

It speaks the same HTTP API, SSE chunk shapes, error bodies, log lines and `/metrics` families as
the real server captured in `reference/vllm-captures/`, with deterministic text, exact pacing and
injectable faults, so the stack (launcher, readiness checks, log diagnosis, benchmark client,
dashboard) can be tested without a GPU.

Run: `python3 server.py [vllm serve] [MODEL] [--served-model-name NAME] [--port N] ...`
The argv of a real `vllm serve` command is accepted; these flags are used and every other flag is
ignored: `--model`, `--served-model-name`, `--host`, `--port`, `--max-model-len` (`32k`, `auto`),
`--max-num-seqs`, `--speculative-config`/`-sc` (JSON), `--enable-prefix-caching`/
`--no-enable-prefix-caching`/`--disable-prefix-caching`, `--reasoning-parser`,
`--enable-auto-tool-choice`, `--tool-call-parser`, `--gpu-memory-utilization`, `--block-size`,
`--kv-cache-dtype`, `--tensor-parallel-size`/`-tp`. Underscores and dashes are interchangeable and
`--flag=value` works, as in vLLM.

Environment (all optional; an `SIM_*` value wins over the argv):
  SIM_BOOT_SECONDS      seconds spent "loading" before the socket listens (default 1). Until then a
                        connection is refused, exactly like vLLM, whose port does not listen until
                        the engine is built.
  SIM_TTFT_MS           base time to first token in ms (default 20)
  SIM_PREFILL_TPS       prompt tokens per second of prefill (default 20000; 0 = instant). Only the
                        tokens not served from the prefix cache are computed, as in vLLM.
  SIM_ITL_MS            gap between decode steps in ms (default 10)
  SIM_DECODE_DEPTH_SLOWDOWN
                        ms added to every decode step per 1,000 prompt tokens (the context each
                        step attends over), like an attention backend whose decode slows with
                        depth (default 0: the same gap at every depth)
  SIM_TOKENS_PER_CHUNK  tokens per decode step after the first token, like speculative decoding
                        (default 1; 2 when --speculative-config is given)
  SIM_ROLE_DELAY_MS     send the role-only chunk, then wait this long before the first token
                        (default 0: both in the same step, as vLLM does)
  SIM_MAX_NUM_SEQS      concurrency limit (default: --max-num-seqs, else 256); extra requests wait
                        and are counted in vllm:num_requests_waiting
  SIM_MAX_MODEL_LEN     context window (default: --max-model-len, else 4096)
  SIM_KV_CACHE_TOKENS   KV cache size in tokens (default 8 x max_model_len)
  SIM_STOP_AFTER        the "model" emits EOS after this many tokens (finish_reason "stop") unless
                        the request sets ignore_eos; default 0 = never, like the captured
                        random-weight model, so generation runs to max_tokens ("length")
  SIM_REASONING_TOKENS  with a reasoning parser and thinking on, the first N tokens go to
                        `delta.reasoning`, the rest to `delta.content` (default 16)
  SIM_TEXTLESS_TOKENS   the first N tokens of every answer have no text, like a thinking marker
                        the reasoning parser strips: they count in usage, but no chunk carries
                        them (a one-token answer sends only its finish chunk, content "")
  SIM_MAMBA_CACHE_MODE  "align" makes a hybrid (Mamba-layer) model: cache_config_info says so,
                        and a cached prefix can resume only where an earlier prefill saved its
                        layer state, at the last whole block of that prompt (default "none")
  SIM_TOKENIZER         path to a tokenizer.json; used when the `tokenizers` package is importable
  SIM_SEED              extra seed for the generated text (default 0)
  SIM_FAULT             one of: crash-at-boot, crash-loop, hang, die-after, token-loop,
                        drop-requests, stream-mismatch, tool-truncation, keepalive, trickle,
                        html-page, wrong-types, usage-overcount (see `Faults` below)
  SIM_KEEPALIVE_MS      keepalive: gap between SSE comments (default 1000)
  SIM_TRICKLE_MS        trickle: gap between the bytes of a stream (default 50)
  SIM_FAULT_LOG         text printed (as an EngineCore ERROR line) for crash-at-boot/crash-loop;
                        default: vLLM's "No available memory for the cache blocks" error
  SIM_DIE_AFTER_S       die-after: seconds of serving before the engine dies (default 5)
  SIM_DEAD_LINGER_S     die-after: seconds /health answers 503 before the process exits (default 1)
  SIM_DROP_EVERY        drop-requests: every Nth generation request is dropped (default 3)
  SIM_LOOP_AFTER        token-loop: tokens before the output starts repeating (default 16)
  SIM_LOOP_NGRAM        token-loop: length of the repeated n-gram (default 4)
  SIM_VERSION           version reported by /version and the logs (default 0.27.1)
  SIM_GPU_MEMORY_DIR    a folder standing in for the card (the stack's GPU_MEMORY_DIR): `total`
                        holds its bytes; the engine claims --gpu-memory-utilization x total at
                        boot in `PID.used` (refusing with vLLM's "Free memory on device" error
                        when less is free, counting only live processes' files), holds the
                        residue while asleep and removes the file when it exits
  SIM_SLEEP_RESIDUE_MIB what a sleeping engine still holds (default 1300, as on an H200)
  SIM_WEIGHTS_MIB       its weights (default 0): what a kv sleep keeps on the card beside the
                        residue. A kv sleep is the stack's plugin's (VLLMSTACK_SLEEP_FREES=kv in
                        the engine's environment; each level-1 sleep reads
                        VLLMSTACK_SLEEP_FREES_FILE first, where `all` makes it vLLM's own level 1)
  SIM_SLEEP_FAULT       keep-memory: a sleep returns 200 but frees nothing (ROCm before vLLM's
                        2026 sleep fixes)
  SIM_SLEEP_MS / SIM_FIRST_SLEEP_MS / SIM_WAKE_MS
                        how long a sleep, the first sleep (pinned host buffers) and a wake take
                        (defaults 50, 300, 50)

Sleep mode (`--enable-sleep-mode`; the endpoints only with VLLM_SERVER_DEV_MODE=1, else 404):
POST /sleep?level=N, POST /wake_up, GET /is_sleeping ({"is_sleeping": bool}, plus this
simulator's own counts under "sim": sleeps, wakes, levels, requests_while_asleep). While asleep,
/v1/chat/completions and /v1/completions answer 503 (counted), as vLLM's protected endpoints do.

Pacing (absolute deadlines from the moment the request gets a slot, so errors do not add up):
  first token  = admit + SIM_TTFT_MS + computed_prompt_tokens / SIM_PREFILL_TPS + SIM_ROLE_DELAY_MS
  role chunk   = first token - SIM_ROLE_DELAY_MS (chat streams only)
  step j >= 1  = first token + j * (SIM_ITL_MS + SIM_DECODE_DEPTH_SLOWDOWN * prompt tokens / 1000),
                 carrying min(SIM_TOKENS_PER_CHUNK, left) tokens
A non-streamed request is answered at the time its last step would have been sent.

Token counting: with SIM_TOKENIZER, the exact token ids of the rendered prompt. Otherwise each of
these counts as one token: a ChatML marker (`<|im_start|>`, `<|im_end|>`, `<think>`, `</think>`),
a run of newlines, a run of other non-space characters (a lone `<` is its own token). A chat
prompt is rendered as ChatML: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message (plus a
system message with the tools JSON when tools are given), then `<|im_start|>assistant\\n`, plus
`<think>\\n\\n</think>\\n\\n` when thinking is disabled (Qwen3's template). So a chat message costs
its words + 5 tokens and the generation prompt 3. Completion tokens are the tokens emitted; each
generated word is one token.

Not simulated: n > 1, stop strings, logprobs, sampling parameters (the text does not depend on
temperature), /v1/responses, multimodal input, engine-step batching (each request is paced on its
own; vllm:iteration_tokens_total counts per-request steps).

Faults:
  crash-at-boot   boot lines, then SIM_FAULT_LOG and vLLM's generic "Engine core initialization
                  failed ... Failed core proc(s): {}" lines, exit 1 before listening
  crash-loop      the same on every start (run it under a restart policy)
  hang            boot lines, then never listens
  die-after       serves for SIM_DIE_AFTER_S, then the engine dies: /health 503, requests 500,
                  streams get an error event; the process exits 1 after SIM_DEAD_LINGER_S
  token-loop      after SIM_LOOP_AFTER tokens the text repeats an SIM_LOOP_NGRAM-token n-gram
  drop-requests   every SIM_DROP_EVERY-th generation request: connection closed, no response
  stream-mismatch streamed text differs from the non-streamed text for the same request
  tool-truncation when max_tokens cuts a tool call, the non-streamed answer drops the partial
                  arguments while the stream keeps them
  keepalive       a stream sends its role chunk, then only SSE keep-alive comments (": ping"),
                  every SIM_KEEPALIVE_MS, until the client goes away: it never ends by itself
  trickle         every byte of a stream goes out on its own, SIM_TRICKLE_MS after the last
  html-page       generation requests get 200 with a text/html login page (a proxy in the way)
  wrong-types     JSON of the wrong shape: stream chunks carry `"usage": 5`, non-streamed
                  answers `"choices": "abc"`
  usage-overcount the usage reports twice the tokens generated (more than max_tokens)

Prefix cache with speculative decoding (`--speculative-config` with method eagle, eagle3 or mtp):
the last matched block is dropped, as vLLM does so the draft head gets its hidden states.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import re
import resource
import signal
import socket
import sys
import threading
import time
import traceback
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DEFAULT_VERSION = "0.27.1"
# vLLM's system_fingerprint is "vllm-<version>-<build hash>"; the hash is the captured build's.
BUILD_HASH = "246619e8"
ENGINE_ERROR_TEXT = "EngineCore encountered an issue. See stack trace (above) for the root cause."
KV_MEMORY_ERROR = (
    "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
    "when initializing the engine (this flag also controls CPU memory reservation on the CPU "
    "backend, despite its name). See https://docs.vllm.ai/en/latest/configuration/"
    "conserving_memory/ for more details."
)
CORE_FAILED_TEXT = (
    "RuntimeError: Engine core initialization failed. See root cause above. "
    "Failed core proc(s): {}"
)
FAULTS = (
    "crash-at-boot", "crash-loop", "hang", "die-after", "token-loop", "drop-requests",
    "stream-mismatch", "tool-truncation", "keepalive", "trickle", "html-page", "wrong-types",
    "usage-overcount",
)
HTML_PAGE = (b"<!DOCTYPE html><html><head><title>Sign in - Example Proxy</title></head>"
             b"<body><form>Please sign in to continue.</form></body></html>")
# Speculative methods that make vLLM drop the last matched prefix-cache block.
EAGLE_METHODS = ("eagle", "eagle3", "mtp")

# --------------------------------------------------------------------------------------------
# configuration


@dataclass
class Config:
    model: str = "sim"
    served_names: list[str] = field(default_factory=list)
    host: str = "0.0.0.0"
    port: int = 8000
    max_model_len: int = 4096
    max_num_seqs: int = 256
    prefix_caching: bool = True
    block_size: int = 16
    gpu_memory_utilization: float = 0.92
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    reasoning_parser: str = ""
    tool_call_parser: str = ""
    auto_tool_choice: bool = False
    spec_config: dict[str, Any] | None = None
    non_default: dict[str, Any] = field(default_factory=dict)
    # pacing and behaviour (SIM_*)
    boot_seconds: float = 1.0
    ttft_ms: float = 20.0
    prefill_tps: float = 20000.0
    itl_ms: float = 10.0
    decode_depth_slowdown: float = 0.0  # ms per decode step per 1,000 prompt tokens
    tokens_per_chunk: int = 1
    role_delay_ms: float = 0.0
    kv_cache_tokens: int = 0
    stop_after: int = 0
    reasoning_tokens: int = 16
    textless_tokens: int = 0
    mamba_cache_mode: str = "none"
    keepalive_ms: float = 1000.0
    trickle_ms: float = 50.0
    tokenizer_path: str = ""
    seed: int = 0
    fault: str = ""
    fault_log: str = ""
    die_after_s: float = 5.0
    dead_linger_s: float = 1.0
    drop_every: int = 3
    loop_after: int = 16
    loop_ngram: int = 4
    version: str = DEFAULT_VERSION
    sleep_mode: bool = False  # --enable-sleep-mode
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1: /sleep, /wake_up, /is_sleeping exist
    gpu_memory_dir: str = ""
    sleep_residue_mib: float = 1300.0
    weights_mib: float = 0.0
    sleep_plugin: bool = False  # the stack's plugin is on: a level-1 sleep keeps the weights
    sleep_frees_file: str = ""
    sleep_fault: str = ""
    sleep_ms: float = 50.0
    first_sleep_ms: float = 300.0
    wake_ms: float = 50.0

    @property
    def name(self) -> str:
        """The first served name (vLLM's metrics label and default), else the model path."""
        return self.served_names[0] if self.served_names else self.model

    @property
    def names(self) -> list[str]:
        return self.served_names or [self.model]

    @property
    def eagle(self) -> bool:
        """Speculative decoding that drops the last matched prefix-cache block."""
        return bool(self.spec_config) and str(
            (self.spec_config or {}).get("method", "")).lower() in EAGLE_METHODS

    @property
    def num_spec_tokens(self) -> int:
        if not self.spec_config:
            return 0
        return int(self.spec_config.get("num_speculative_tokens") or 0)


class ConfigError(ValueError):
    """A flag or SIM_* value the simulator cannot use; printed like an argparse error."""


# Flags that take no value (vLLM's BooleanOptionalAction flags and friends), so the parser
# does not swallow the next token when skipping them.
_BOOL_FLAGS = {
    "enable-prefix-caching", "no-enable-prefix-caching", "disable-prefix-caching",
    "enable-auto-tool-choice", "no-enable-auto-tool-choice", "enforce-eager", "no-enforce-eager",
    "trust-remote-code", "no-trust-remote-code", "async-scheduling", "no-async-scheduling",
    "enable-expert-parallel", "no-enable-expert-parallel", "ep", "disable-log-requests",
    "enable-log-requests", "disable-log-stats", "enable-chunked-prefill",
    "no-enable-chunked-prefill", "language-model-only", "disable-custom-all-reduce",
    "kv-cache-metrics", "enable-mfu-metrics", "fail-on-environ-validation", "headless",
    "disable-fastapi-docs", "enable-prompt-tokens-details", "enable-server-load-tracking",
    "enable-force-include-usage", "disable-uvicorn-access-log", "skip-tokenizer-init",
    "enable-sleep-mode",
}
_ALIASES = {"sc": "speculative-config", "tp": "tensor-parallel-size", "q": "quantization"}


def parse_human_int(text: str, flag: str) -> int:
    """vLLM's human-readable ints: 32k = 32000, 32K = 32768, 25.6k; -1/auto keep the default."""
    raw = text.strip()
    if raw.lower() in ("auto", "-1"):
        return -1
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", raw)
    if not match:
        raise ConfigError(
            f"argument --{flag}: invalid human_readable_int_or_auto value: '{text}'")
    number, unit = float(match.group(1)), match.group(2)
    scale = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3,
             "K": 1024, "M": 1024**2, "G": 1024**3}[unit]
    return int(number * scale)


def parse_serve_argv(argv: Sequence[str]) -> dict[str, Any]:
    """Pick the flags the simulator uses out of a `vllm serve` argv; ignore everything else."""
    args = list(argv)
    if args[:2] == ["vllm", "serve"]:
        args = args[2:]
    elif args[:1] in (["serve"], ["vllm"]):
        args = args[1:]
    found: dict[str, Any] = {}
    positional: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if not token.startswith("-") or token == "-":
            positional.append(token)
            continue
        name, has_inline, inline = token.lstrip("-").partition("=")
        name = name.replace("_", "-")
        name = _ALIASES.get(name, name)
        if name.startswith("speculative-config."):
            # dotted JSON keys: --speculative-config.num_speculative_tokens 2
            value = inline if has_inline else (args[i] if i < len(args) else "")
            if not has_inline:
                i += 1
            spec = found.setdefault("speculative-config", {})
            key = name.split(".", 1)[1].replace("-", "_")
            try:
                spec[key] = json.loads(value)
            except ValueError:
                spec[key] = value
            continue
        if name in _BOOL_FLAGS:
            found[name] = True
            continue
        values: list[str] = []
        if has_inline:
            values.append(inline)
        else:
            # one value; --served-model-name takes several
            while i < len(args) and not args[i].startswith("--"):
                if args[i].startswith("-") and not re.fullmatch(r"-\d+(\.\d+)?", args[i]):
                    break
                values.append(args[i])
                i += 1
                if name != "served-model-name":
                    break
        found[name] = values if name == "served-model-name" else (values[0] if values else "")
    if positional:
        found.setdefault("model", positional[0])
    return found


def load_config(argv: Sequence[str], environ: dict[str, str]) -> Config:
    cfg = Config()
    flags = parse_serve_argv(argv)
    non_default: dict[str, Any] = {}
    if "model" in flags:
        cfg.model = str(flags["model"])
        non_default["model_tag"] = cfg.model
        non_default["model"] = cfg.model
    if flags.get("served-model-name"):
        cfg.served_names = list(flags["served-model-name"])
        non_default["served_model_name"] = list(flags["served-model-name"])
    if "host" in flags:
        cfg.host = flags["host"]
        non_default["host"] = cfg.host
    if "port" in flags:
        cfg.port = _int(flags["port"], "--port")
        non_default["port"] = cfg.port
    if "max-model-len" in flags:
        length = parse_human_int(flags["max-model-len"], "max-model-len")
        if length > 0:
            cfg.max_model_len = length
        non_default["max_model_len"] = length
    if "max-num-seqs" in flags:
        cfg.max_num_seqs = _int(flags["max-num-seqs"], "--max-num-seqs")
        non_default["max_num_seqs"] = cfg.max_num_seqs
    if "gpu-memory-utilization" in flags:
        cfg.gpu_memory_utilization = _float(flags["gpu-memory-utilization"],
                                            "--gpu-memory-utilization")
        non_default["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    if "block-size" in flags:
        cfg.block_size = _int(flags["block-size"], "--block-size")
        non_default["block_size"] = cfg.block_size
    if "kv-cache-dtype" in flags:
        cfg.kv_cache_dtype = flags["kv-cache-dtype"]
        non_default["kv_cache_dtype"] = cfg.kv_cache_dtype
    if "tensor-parallel-size" in flags:
        cfg.tensor_parallel_size = _int(flags["tensor-parallel-size"], "--tensor-parallel-size")
        non_default["tensor_parallel_size"] = cfg.tensor_parallel_size
    if flags.get("enable-prefix-caching"):
        cfg.prefix_caching = True
        non_default["enable_prefix_caching"] = True
    if flags.get("no-enable-prefix-caching") or flags.get("disable-prefix-caching"):
        cfg.prefix_caching = False
        non_default["enable_prefix_caching"] = False
    if flags.get("reasoning-parser"):
        cfg.reasoning_parser = flags["reasoning-parser"]
        non_default["reasoning_parser"] = cfg.reasoning_parser
    if flags.get("enable-auto-tool-choice"):
        cfg.auto_tool_choice = True
        non_default["enable_auto_tool_choice"] = True
    if flags.get("tool-call-parser"):
        cfg.tool_call_parser = flags["tool-call-parser"]
        non_default["tool_call_parser"] = cfg.tool_call_parser
    if "speculative-config" in flags:
        spec = flags["speculative-config"]
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as exc:
                raise ConfigError(
                    f"argument --speculative-config/-sc: Value {spec} cannot be converted to "
                    f"<function loads>: {exc}") from exc
        if not isinstance(spec, dict):
            raise ConfigError("argument --speculative-config/-sc: expected a JSON object")
        cfg.spec_config = spec
        non_default["speculative_config"] = spec
        cfg.tokens_per_chunk = 2
    cfg.non_default = non_default

    env = environ
    cfg.max_num_seqs = _env_int(env, "SIM_MAX_NUM_SEQS", cfg.max_num_seqs, minimum=1)
    cfg.max_model_len = _env_int(env, "SIM_MAX_MODEL_LEN", cfg.max_model_len, minimum=1)
    cfg.boot_seconds = _env_float(env, "SIM_BOOT_SECONDS", cfg.boot_seconds)
    cfg.ttft_ms = _env_float(env, "SIM_TTFT_MS", cfg.ttft_ms)
    cfg.prefill_tps = _env_float(env, "SIM_PREFILL_TPS", cfg.prefill_tps)
    cfg.itl_ms = _env_float(env, "SIM_ITL_MS", cfg.itl_ms)
    cfg.decode_depth_slowdown = _env_float(env, "SIM_DECODE_DEPTH_SLOWDOWN",
                                           cfg.decode_depth_slowdown)
    cfg.tokens_per_chunk = _env_int(env, "SIM_TOKENS_PER_CHUNK", cfg.tokens_per_chunk, minimum=1)
    cfg.role_delay_ms = _env_float(env, "SIM_ROLE_DELAY_MS", cfg.role_delay_ms)
    cfg.kv_cache_tokens = _env_int(env, "SIM_KV_CACHE_TOKENS", cfg.max_model_len * 8, minimum=1)
    cfg.stop_after = _env_int(env, "SIM_STOP_AFTER", cfg.stop_after)
    cfg.reasoning_tokens = _env_int(env, "SIM_REASONING_TOKENS", cfg.reasoning_tokens)
    cfg.textless_tokens = _env_int(env, "SIM_TEXTLESS_TOKENS", cfg.textless_tokens)
    cfg.mamba_cache_mode = env.get("SIM_MAMBA_CACHE_MODE", "").strip() or cfg.mamba_cache_mode
    if cfg.mamba_cache_mode not in ("none", "align"):
        raise ConfigError(f"SIM_MAMBA_CACHE_MODE={cfg.mamba_cache_mode!r} is not none or align")
    cfg.keepalive_ms = _env_float(env, "SIM_KEEPALIVE_MS", cfg.keepalive_ms)
    cfg.trickle_ms = _env_float(env, "SIM_TRICKLE_MS", cfg.trickle_ms)
    cfg.tokenizer_path = env.get("SIM_TOKENIZER", "")
    cfg.seed = _env_int(env, "SIM_SEED", cfg.seed)
    cfg.fault = env.get("SIM_FAULT", "").strip()
    if cfg.fault and cfg.fault not in FAULTS:
        raise ConfigError(f"SIM_FAULT={cfg.fault!r} is not one of: {', '.join(FAULTS)}")
    cfg.fault_log = env.get("SIM_FAULT_LOG", "")
    cfg.die_after_s = _env_float(env, "SIM_DIE_AFTER_S", cfg.die_after_s)
    cfg.dead_linger_s = _env_float(env, "SIM_DEAD_LINGER_S", cfg.dead_linger_s)
    cfg.drop_every = _env_int(env, "SIM_DROP_EVERY", cfg.drop_every, minimum=1)
    cfg.loop_after = _env_int(env, "SIM_LOOP_AFTER", cfg.loop_after)
    cfg.loop_ngram = _env_int(env, "SIM_LOOP_NGRAM", cfg.loop_ngram, minimum=1)
    cfg.version = env.get("SIM_VERSION", cfg.version) or cfg.version
    cfg.sleep_mode = bool(flags.get("enable-sleep-mode"))
    cfg.dev_mode = environ.get("VLLM_SERVER_DEV_MODE", "") == "1"
    cfg.gpu_memory_dir = env.get("SIM_GPU_MEMORY_DIR", "")
    cfg.sleep_residue_mib = _env_float(env, "SIM_SLEEP_RESIDUE_MIB", cfg.sleep_residue_mib)
    cfg.weights_mib = _env_float(env, "SIM_WEIGHTS_MIB", cfg.weights_mib)
    cfg.sleep_plugin = environ.get("VLLMSTACK_SLEEP_FREES", "") == "kv"
    cfg.sleep_frees_file = environ.get("VLLMSTACK_SLEEP_FREES_FILE", "")
    cfg.sleep_fault = env.get("SIM_SLEEP_FAULT", "").strip()
    if cfg.sleep_fault not in ("", "keep-memory"):
        raise ConfigError(f"SIM_SLEEP_FAULT={cfg.sleep_fault!r} is not keep-memory")
    cfg.sleep_ms = _env_float(env, "SIM_SLEEP_MS", cfg.sleep_ms)
    cfg.first_sleep_ms = _env_float(env, "SIM_FIRST_SLEEP_MS", cfg.first_sleep_ms)
    cfg.wake_ms = _env_float(env, "SIM_WAKE_MS", cfg.wake_ms)
    return cfg


def _int(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"argument {flag}: invalid int value: '{text}'") from None


def _float(text: str, flag: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"argument {flag}: invalid float value: '{text}'") from None


def _env_int(env: dict[str, str], key: str, default: int, minimum: int = 0) -> int:
    raw = env.get(key, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"{key}={raw!r} must be >= {minimum}")
    return value


def _env_float(env: dict[str, str], key: str, default: float) -> float:
    raw = env.get(key, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not a number") from None
    if value < 0:
        raise ConfigError(f"{key}={raw!r} must be >= 0")
    return value


# --------------------------------------------------------------------------------------------
# logging in vLLM's format: "(APIServer pid=N) INFO 11-29 16:10:03 [file.py:line] message"


class Log:
    def __init__(self) -> None:
        self.pid = os.getpid()
        # vLLM runs the engine core in a child process; the simulator has one process, so the
        # EngineCore prefix gets a made-up pid that is at least stable and distinct.
        self.core_pid = self.pid + 1
        self.lock = threading.Lock()

    def _emit(self, text: str, stream: Any = None) -> None:
        with self.lock:
            out = stream or sys.stdout
            out.write(text + "\n")
            out.flush()

    def api(self, level: str, where: str, message: str) -> None:
        stamp = time.strftime("%m-%d %H:%M:%S")
        self._emit(f"(APIServer pid={self.pid}) {level} {stamp} [{where}] {message}")

    def core(self, level: str, where: str, message: str) -> None:
        stamp = time.strftime("%m-%d %H:%M:%S")
        self._emit(f"(EngineCore pid={self.core_pid}) {level} {stamp} [{where}] {message}")

    def uvicorn(self, message: str) -> None:
        self._emit(f"(APIServer pid={self.pid}) INFO:     {message}")

    def raw(self, text: str, stream: Any = None) -> None:
        self._emit(text, stream)


# --------------------------------------------------------------------------------------------
# tokens

_FALLBACK_TOKEN = re.compile(r"<\|im_start\|>|<\|im_end\|>|</?think>|\n+|[^\s<]+|<")
THINK_OFF_SUFFIX = "<think>\n\n</think>\n\n"


class Tokenizer:
    """Counts prompt tokens: a real tokenizer.json when available, else the documented rule."""

    def __init__(self, path: str) -> None:
        self.real: Any = None
        if path:
            try:
                from tokenizers import Tokenizer as HFTokenizer  # optional dependency
            except ImportError:
                HFTokenizer = None  # noqa: N806 - mirrors the imported class name
            if HFTokenizer is not None and os.path.isfile(path):
                self.real = HFTokenizer.from_file(path)

    @property
    def kind(self) -> str:
        return "tokenizer.json" if self.real is not None else "words"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[Any]:
        if self.real is not None:
            return list(self.real.encode(text, add_special_tokens=add_special_tokens).ids)
        return _FALLBACK_TOKEN.findall(text)

    def ids(self, tokens: Sequence[Any]) -> list[int]:
        """Token ids for /tokenize; the word rule maps each word to a stable id below 8192."""
        if self.real is not None:
            return [int(t) for t in tokens]
        return [zlib.crc32(str(t).encode()) % 8192 for t in tokens]


def content_text(content: Any) -> str:
    """A message's text: a string, or the text parts of an OpenAI content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return str(content)


def render_chatml(messages: list[dict[str, Any]], tools: list[Any] | None,
                  thinking: bool) -> str:
    """The prompt text a ChatML (Qwen3-style) chat template would produce."""
    out = []
    if tools:
        out.append("<|im_start|>system\n" + json.dumps(tools) + "<|im_end|>\n")
    for message in messages:
        role = str(message.get("role", "user"))
        text = content_text(message.get("content"))
        for call in message.get("tool_calls") or []:
            function = call.get("function", {}) if isinstance(call, dict) else {}
            text += "\n<tool_call>\n" + json.dumps(
                {"name": function.get("name"), "arguments": function.get("arguments")}
            ) + "\n</tool_call>"
        out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    if not thinking:
        out.append(THINK_OFF_SUFFIX)
    return "".join(out)


# Two-syllable words: 256 of them, so ordinary output has no short period a loop detector could
# mistake for a token loop.
_SYLLABLES = ["ka", "lo", "mi", "ren", "to", "sa", "vel", "du", "ne", "pa", "ri", "gon", "te",
              "ba", "sul", "fi"]
VOCAB = [a + b for a in _SYLLABLES for b in _SYLLABLES]


# --------------------------------------------------------------------------------------------
# prefix cache: vLLM hashes full blocks of tokens, chained, and reuses the longest cached prefix


class PrefixCache:
    """Chained block hashes, longest cached prefix wins. `drop_last` (EAGLE/MTP) gives back the
    last matched block; `align` (hybrid models) also needs a saved layer state where the match
    ends, and a prefill saves one only at the last whole block of its prompt (one block earlier
    with `drop_last`), as vLLM's align mode does."""

    def __init__(self, block_size: int, capacity_blocks: int, enabled: bool,
                 drop_last: bool = False, align: bool = False) -> None:
        self.block_size = block_size
        self.capacity = max(1, capacity_blocks)
        self.enabled = enabled
        self.drop_last = drop_last
        self.align = align
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.states: set[int] = set()  # align mode: block hashes a layer state was saved at
        self.lock = threading.Lock()

    def _hashes(self, tokens: Sequence[Any]) -> list[int]:
        out = []
        parent = 0
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            block = "\x1f".join(str(t) for t in tokens[start:start + size])
            parent = zlib.crc32(block.encode(), parent) | (len(out) << 32)
            out.append(parent)
        return out

    def lookup(self, tokens: Sequence[Any]) -> int:
        """Cached prompt tokens. Like vLLM, the last prompt token is always computed."""
        if not self.enabled or not tokens:
            return 0
        limit = (len(tokens) - 1) // self.block_size
        hits: list[int] = []
        with self.lock:
            for h in self._hashes(tokens)[:limit]:
                if h not in self.blocks:
                    break
                self.blocks.move_to_end(h)
                hits.append(h)
            if self.align:
                while hits and hits[-1] not in self.states:
                    hits.pop()
            elif self.drop_last and hits:
                hits.pop()
        return len(hits) * self.block_size

    def insert(self, tokens: Sequence[Any], prefill: bool = False) -> None:
        if not self.enabled:
            return
        hashes = self._hashes(tokens)
        with self.lock:
            for h in hashes:
                self.blocks[h] = None
                self.blocks.move_to_end(h)
            if self.align and prefill:
                saved = len(hashes) - (1 if self.drop_last else 0)
                if saved > 0:
                    self.states.add(hashes[saved - 1])
            while len(self.blocks) > self.capacity:
                gone, _ = self.blocks.popitem(last=False)
                self.states.discard(gone)


# --------------------------------------------------------------------------------------------
# metrics in prometheus_client's text format (as vLLM exposes them)


def go_float(value: float) -> str:
    """prometheus_client's float formatting (floatToGoString)."""
    if value == float("inf"):
        return "+Inf"
    if value == float("-inf"):
        return "-Inf"
    if value != value:
        return "NaN"
    text = repr(float(value))
    dot = text.find(".")
    if value > 0 and dot > 6 and "e" not in text:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return text


def format_labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{escape_label(str(v))}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def escape_label(value: str) -> str:
    """Prometheus text-format escaping of a label value."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


BUCKETS_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
BUCKETS_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
BUCKETS_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
BUCKETS_N = [1.0, 2.0, 5.0, 10.0, 20.0]
BUCKETS_HTTP = [0.1, 0.5, 1.0]
BUCKETS_HTTP_HIGHR = [0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0,
                      3.5, 4.0, 4.5, 5.0, 7.5, 10.0, 30.0, 60.0]


def buckets_1_2_5(limit: int) -> list[float]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return out
            out.append(float(value))
        exponent += 1


def buckets_iteration(max_batched: int) -> list[float]:
    """vLLM's iteration_tokens_total buckets: 1, 8, 16, ... powers of two up to the batch limit."""
    out = [1.0]
    value = 8
    while value <= max_batched:
        out.append(float(value))
        value *= 2
    return out


class Histogram:
    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.n = 0
        self.created = time.time()

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.total += value
        self.n += 1


@dataclass
class Family:
    name: str           # exposed base name, e.g. "vllm:prompt_tokens" (counter) or full gauge name
    kind: str           # counter | gauge | histogram | summary
    help: str
    bounds: list[float] = field(default_factory=list)  # histogram buckets
    labelled: bool = True  # carries the engine/model_name labels
    samples: dict[tuple[tuple[str, str], ...], Any] = field(default_factory=dict)
    created: dict[tuple[tuple[str, str], ...], float] = field(default_factory=dict)


class Metrics:
    """The families vLLM 0.27.1 exposes, in its order, counting what this server really did."""

    def __init__(self, cfg: Config) -> None:
        self.sleep_state = "awake"  # vllm:engine_sleep_state's label that reads 1
        self.cfg = cfg
        self.lock = threading.Lock()
        self.base = {"engine": "0", "model_name": cfg.name}
        self.families: OrderedDict[str, Family] = OrderedDict()
        self.start_time = time.time()
        self.running = 0
        self.waiting = 0
        self.kv_blocks_used = 0
        token_buckets = buckets_1_2_5(cfg.max_model_len)
        f = self._family
        if cfg.spec_config:
            f("vllm:spec_decode_num_drafts", "counter", "Number of spec decoding drafts.")
            f("vllm:spec_decode_num_draft_tokens", "counter", "Number of draft tokens.")
            f("vllm:spec_decode_num_accepted_tokens", "counter", "Number of accepted tokens.")
            f("vllm:spec_decode_num_accepted_tokens_per_pos", "counter",
              "Accepted tokens per draft position.")
            for pos in range(max(1, cfg.num_spec_tokens)):
                self.inc("vllm:spec_decode_num_accepted_tokens_per_pos", 0, position=str(pos))
            for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                         "vllm:spec_decode_num_accepted_tokens"):
                self.inc(name, 0)
        mfu = "(for Model Flops Utilization calculations)."
        f("vllm:estimated_flops_per_gpu", "counter",
          f"Estimated number of floating point operations per GPU {mfu}")
        f("vllm:estimated_read_bytes_per_gpu", "counter",
          f"Estimated number of bytes read from memory per GPU {mfu}")
        f("vllm:estimated_write_bytes_per_gpu", "counter",
          f"Estimated number of bytes written to memory per GPU {mfu}")
        f("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.")
        f("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.")
        f("vllm:num_requests_waiting_by_reason", "gauge",
          "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
          "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV "
          "transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.")
        f("vllm:engine_sleep_state", "gauge",
          "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
          "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.")
        f("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.")
        f("vllm:prefix_cache_queries", "counter",
          "Prefix cache queries, in terms of number of queried tokens.")
        f("vllm:prefix_cache_hits", "counter",
          "Prefix cache hits, in terms of number of cached tokens.")
        f("vllm:external_prefix_cache_queries", "counter",
          "External prefix cache queries from KV connector cross-instance cache sharing, in terms "
          "of number of queried tokens.")
        f("vllm:external_prefix_cache_hits", "counter",
          "External prefix cache hits from KV connector cross-instance cache sharing, in terms of "
          "number of cached tokens.")
        f("vllm:mm_cache_queries", "counter",
          "Multi-modal cache queries, in terms of number of queried items.")
        f("vllm:mm_cache_hits", "counter",
          "Multi-modal cache hits, in terms of number of cached items.")
        f("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine.")
        f("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.")
        f("vllm:prompt_tokens_by_source", "counter", "Number of prompt tokens by source.")
        f("vllm:prompt_tokens_cached", "counter",
          "Number of cached prompt tokens (local + external).")
        f("vllm:generation_tokens", "counter", "Number of generation tokens processed.")
        f("vllm:request_success", "counter", "Count of successfully processed requests.")
        f("vllm:request_prompt_tokens", "histogram", "Number of prefill tokens processed.",
          token_buckets)
        f("vllm:request_generation_tokens", "histogram", "Number of generation tokens processed.",
          token_buckets)
        f("vllm:iteration_tokens_total", "histogram",
          "Histogram of number of tokens per engine_step.", buckets_iteration(8192))
        f("vllm:request_max_num_generation_tokens", "histogram",
          "Histogram of maximum number of requested generation tokens.", token_buckets)
        f("vllm:request_params_n", "histogram", "Histogram of the n request parameter.",
          BUCKETS_N)
        f("vllm:request_params_max_tokens", "histogram",
          "Histogram of the max_tokens request parameter.", token_buckets)
        f("vllm:time_to_first_token_seconds", "histogram",
          "Histogram of time to first token in seconds.", BUCKETS_TTFT)
        f("vllm:inter_token_latency_seconds", "histogram",
          "Histogram of inter-token latency in seconds.", BUCKETS_ITL)
        f("vllm:request_time_per_output_token_seconds", "histogram",
          "Histogram of time_per_output_token_seconds per request.", BUCKETS_ITL)
        f("vllm:e2e_request_latency_seconds", "histogram",
          "Histogram of e2e request latency in seconds.", BUCKETS_LATENCY)
        f("vllm:request_queue_time_seconds", "histogram",
          "Histogram of time spent in WAITING phase for request.", BUCKETS_LATENCY)
        f("vllm:request_inference_time_seconds", "histogram",
          "Histogram of time spent in RUNNING phase for request.", BUCKETS_LATENCY)
        f("vllm:request_prefill_time_seconds", "histogram",
          "Histogram of time spent in PREFILL phase for request.", BUCKETS_LATENCY)
        f("vllm:request_decode_time_seconds", "histogram",
          "Histogram of time spent in DECODE phase for request.", BUCKETS_LATENCY)
        f("vllm:request_prefill_kv_computed_tokens", "histogram",
          "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
          token_buckets)
        f("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig")
        no_pct = "Only value of header is respected. Otherwise ignored. No percentile calculated. "
        f("http_requests", "counter", "Total number of requests by method, status and handler.",
          labelled=False)
        f("http_request_size_bytes", "summary",
          f"Content length of incoming requests by handler. {no_pct}", labelled=False)
        f("http_response_size_bytes", "summary",
          f"Content length of outgoing responses by handler. {no_pct}", labelled=False)
        f("http_request_duration_highr_seconds", "histogram",
          "Latency with many buckets but no API specific labels. Made for more accurate "
          "percentile calculations. ", BUCKETS_HTTP_HIGHR, labelled=False)
        f("http_request_duration_seconds", "histogram",
          "Latency with only few buckets by handler. Made to be only used if aggregation by "
          "handler is important. ", BUCKETS_HTTP, labelled=False)
        if cfg.tool_call_parser:
            f("vllm:tool_call_parser_invocations", "counter",
              "Total number of ToolParser invocations. Non-streaming increments once per choice; "
              "streaming increments once per delta.", labelled=False)
            for mode in ("streaming", "non_streaming"):
                for outcome in ("tool_call", "no_tool_call"):
                    for rtype in ("chat_completions", "responses", "other"):
                        self._inc_raw("vllm:tool_call_parser_invocations", 0, {
                            "mode": mode, "model_name": cfg.name, "outcome": outcome,
                            "request_type": rtype})
        # zero samples that vLLM shows from the start
        for name in ("vllm:estimated_flops_per_gpu", "vllm:estimated_read_bytes_per_gpu",
                     "vllm:estimated_write_bytes_per_gpu", "vllm:prefix_cache_queries",
                     "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
                     "vllm:external_prefix_cache_hits", "vllm:mm_cache_queries",
                     "vllm:mm_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens",
                     "vllm:prompt_tokens_cached", "vllm:generation_tokens"):
            self.inc(name, 0)
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            self.inc("vllm:prompt_tokens_by_source", 0, source=source)
        for reason in ("stop", "length", "abort", "error", "repetition"):
            self.inc("vllm:request_success", 0, finished_reason=reason)
        for family in self.families.values():
            if family.kind == "histogram" and family.labelled:
                self._hist(family.name, self.base)

    # -- registration and updates (callers hold no lock; these take it)

    def _family(self, name: str, kind: str, help_text: str, bounds: list[float] | None = None,
                labelled: bool = True) -> None:
        self.families[name] = Family(name, kind, help_text, bounds or [], labelled)

    def _key(self, labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
        return tuple(sorted(labels.items()))

    def _inc_raw(self, name: str, amount: float, labels: dict[str, str]) -> None:
        family = self.families[name]
        key = self._key(labels)
        if key not in family.samples:
            family.samples[key] = 0.0
            family.created[key] = time.time()
        family.samples[key] += amount

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        with self.lock:
            self._inc_raw(name, amount, {**self.base, **labels})

    def _hist(self, name: str, labels: dict[str, str]) -> Histogram:
        family = self.families[name]
        key = self._key(labels)
        if key not in family.samples:
            family.samples[key] = Histogram(family.bounds)
        hist: Histogram = family.samples[key]
        return hist

    def observe(self, name: str, value: float, **labels: str) -> None:
        with self.lock:
            self._hist(name, {**self.base, **labels}).observe(value)

    def observe_http(self, handler: str, method: str, status: int, request_size: int,
                     response_size: int, seconds: float) -> None:
        # prometheus-fastapi-instrumentator leaves these endpoints out (see vllm-facts §5)
        if handler in ("/metrics", "/health", "/load", "/ping", "/version", "/server_info"):
            return
        with self.lock:
            self._inc_raw("http_requests", 1,
                          {"handler": handler, "method": method, "status": f"{status // 100}xx"})
            for name, size in (("http_request_size_bytes", request_size),
                               ("http_response_size_bytes", response_size)):
                family = self.families[name]
                key = self._key({"handler": handler})
                if key not in family.samples:
                    family.samples[key] = [0, 0.0]
                    family.created[key] = time.time()
                family.samples[key][0] += 1
                family.samples[key][1] += size
            self._hist("http_request_duration_highr_seconds", {}).observe(seconds)
            self._hist("http_request_duration_seconds",
                       {"handler": handler, "method": method}).observe(seconds)

    # -- rendering

    def cache_info_labels(self) -> dict[str, str]:
        cfg = self.cfg
        blocks = cfg.kv_cache_tokens // cfg.block_size
        return {
            "_block_size_resolved": "True", "block_size": str(cfg.block_size),
            "cache_dtype": cfg.kv_cache_dtype, "calculate_kv_scales": "False",
            "enable_prefix_caching": str(cfg.prefix_caching), "engine": "0",
            "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
            "is_attention_free": "False", "kv_cache_dtype_skip_layers": "[]",
            "kv_cache_max_concurrency": repr(cfg.kv_cache_tokens / cfg.max_model_len),
            "kv_cache_memory_bytes": "None", "kv_cache_size_tokens": str(cfg.kv_cache_tokens),
            "kv_offloading_backend": "native", "kv_offloading_size": "None",
            "kv_sharing_fast_prefill": "False",
            # A hybrid's Mamba layers cache in their own (16-token) kernel blocks.
            "mamba_block_size": "16" if cfg.mamba_cache_mode == "align" else "None",
            "mamba_cache_dtype": "auto", "mamba_cache_mode": cfg.mamba_cache_mode,
            "mamba_page_size_padded": "None", "mamba_ssm_cache_dtype": "auto",
            "num_cpu_blocks": "None", "num_gpu_blocks": str(blocks),
            "num_gpu_blocks_override": "None", "prefix_caching_hash_algo": "sha256",
            "prefix_match_unit": "None", "replayssm_buffer_len": "16",
            "skip_page_size_padded": "None", "sliding_window": "None",
            "use_replayssm": "False", "user_specified_block_size": "False",
            "user_specified_mamba_block_size": "False",
        }

    def render(self) -> str:
        lines: list[str] = []
        lines += render_process_families(self.start_time)
        with self.lock:
            blocks_total = max(1, self.cfg.kv_cache_tokens // self.cfg.block_size)
            gauges = {
                "vllm:num_requests_running": {self._key(self.base): float(self.running)},
                "vllm:num_requests_waiting": {self._key(self.base): float(self.waiting)},
                "vllm:num_requests_waiting_by_reason": {
                    self._key({**self.base, "reason": "capacity"}): float(self.waiting),
                    self._key({**self.base, "reason": "deferred"}): 0.0},
                "vllm:engine_sleep_state": {
                    self._key({**self.base, "sleep_state": "awake"}):
                        float(self.sleep_state == "awake"),
                    self._key({**self.base, "sleep_state": "weights_offloaded"}):
                        float(self.sleep_state == "weights_offloaded"),
                    self._key({**self.base, "sleep_state": "discard_all"}): 0.0},
                "vllm:kv_cache_usage_perc": {
                    self._key(self.base): min(1.0, self.kv_blocks_used / blocks_total)},
                "vllm:cache_config_info": {self._key(self.cache_info_labels()): 1.0},
            }
            for family in self.families.values():
                lines += self._render_family(family, gauges.get(family.name))
        return "\n".join(lines) + "\n"

    def _render_family(self, family: Family, gauge: dict[Any, float] | None) -> list[str]:
        out: list[str] = []
        name = family.name
        if family.kind == "gauge":
            out.append(f"# HELP {name} {family.help}")
            out.append(f"# TYPE {name} gauge")
            for key, value in (gauge or {}).items():
                out.append(f"{name}{format_labels(dict(key))} {go_float(value)}")
            return out
        if family.kind == "counter":
            out.append(f"# HELP {name}_total {family.help}")
            out.append(f"# TYPE {name}_total counter")
            for key, value in family.samples.items():
                out.append(f"{name}_total{format_labels(dict(key))} {go_float(value)}")
            out += self._created_lines(name, family.help,
                                       [(k, family.created[k]) for k in family.samples])
            return out
        if family.kind == "summary":
            out.append(f"# HELP {name} {family.help}")
            out.append(f"# TYPE {name} summary")
            for key, (count, total) in family.samples.items():
                labels = format_labels(dict(key))
                out.append(f"{name}_count{labels} {go_float(count)}")
                out.append(f"{name}_sum{labels} {go_float(total)}")
            out += self._created_lines(name, family.help,
                                       [(k, family.created[k]) for k in family.samples])
            return out
        out.append(f"# HELP {name} {family.help}")
        out.append(f"# TYPE {name} histogram")
        for key, hist in family.samples.items():
            labels = dict(key)
            cumulative = 0
            for bound, count in zip([*hist.bounds, float("inf")], hist.counts, strict=True):
                cumulative += count
                bucket_labels = format_labels({**labels, "le": go_float(bound)})
                out.append(f"{name}_bucket{bucket_labels} {go_float(cumulative)}")
            out.append(f"{name}_count{format_labels(labels)} {go_float(hist.n)}")
            out.append(f"{name}_sum{format_labels(labels)} {go_float(hist.total)}")
        out += self._created_lines(name, family.help,
                                   [(k, h.created) for k, h in family.samples.items()])
        return out

    @staticmethod
    def _created_lines(name: str, help_text: str, items: list[tuple[Any, float]]) -> list[str]:
        out = [f"# HELP {name}_created {help_text}", f"# TYPE {name}_created gauge"]
        for key, created in items:
            out.append(f"{name}_created{format_labels(dict(key))} {go_float(created)}")
        return out


def render_process_families(start_time: float) -> list[str]:
    """The python_gc_*, python_info and process_* families prometheus_client adds by default."""
    out = [
        "# HELP python_gc_objects_collected_total Objects collected during gc",
        "# TYPE python_gc_objects_collected_total counter",
    ]
    stats = gc.get_stats()
    out += [f'python_gc_objects_collected_total{{generation="{i}"}} {go_float(s["collected"])}'
            for i, s in enumerate(stats)]
    out += ["# HELP python_gc_objects_uncollectable_total Uncollectable objects found during GC",
            "# TYPE python_gc_objects_uncollectable_total counter"]
    out += [f'python_gc_objects_uncollectable_total{{generation="{i}"}} '
            f'{go_float(s["uncollectable"])}' for i, s in enumerate(stats)]
    out += ["# HELP python_gc_collections_total Number of times this generation was collected",
            "# TYPE python_gc_collections_total counter"]
    out += [f'python_gc_collections_total{{generation="{i}"}} {go_float(s["collections"])}'
            for i, s in enumerate(stats)]
    v = sys.version_info
    out += ["# HELP python_info Python platform information", "# TYPE python_info gauge",
            f'python_info{{implementation="CPython",major="{v.major}",minor="{v.minor}",'
            f'patchlevel="{v.micro}",version="{v.major}.{v.minor}.{v.micro}"}} 1.0']
    vsize = rss = 0.0
    try:
        with open("/proc/self/statm") as statm:
            pages = statm.read().split()
        page = os.sysconf("SC_PAGE_SIZE")
        vsize, rss = float(pages[0]) * page, float(pages[1]) * page
    except (OSError, IndexError, ValueError):
        pass
    try:
        fds = float(len(os.listdir("/proc/self/fd")))
    except OSError:
        fds = 0.0
    times = os.times()
    max_fds = float(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    for name, kind, help_text, value in (
        ("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", vsize),
        ("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", rss),
        ("process_start_time_seconds", "gauge",
         "Start time of the process since unix epoch in seconds.", start_time),
        ("process_cpu_seconds_total", "counter",
         "Total user and system CPU time spent in seconds.", times.user + times.system),
        ("process_open_fds", "gauge", "Number of open file descriptors.", fds),
        ("process_max_fds", "gauge", "Maximum number of open file descriptors.", max_fds),
    ):
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                f"{name} {go_float(value)}"]
    return out


# --------------------------------------------------------------------------------------------
# what the "model" says


@dataclass
class Piece:
    """One generated token and what it adds to the visible output."""

    kind: str  # reasoning | content | tool_name | tool_args | silent
    text: str = ""


@dataclass
class ToolCall:
    name: str
    arguments: str
    call_id: str


def example_arguments(schema: Any) -> dict[str, Any]:
    """Deterministic arguments that fit a JSON schema's properties."""
    out: dict[str, Any] = {}
    if not isinstance(schema, dict):
        return out
    for key, prop in (schema.get("properties") or {}).items():
        kind = prop.get("type") if isinstance(prop, dict) else None
        if isinstance(prop, dict) and prop.get("enum"):
            out[key] = prop["enum"][0]
        elif kind in ("integer", "number"):
            out[key] = 1
        elif kind == "boolean":
            out[key] = True
        elif kind == "array":
            out[key] = []
        elif kind == "object":
            out[key] = {}
        else:
            out[key] = "sim"
    return out


def choose_tool(tools: list[Any], tool_choice: Any, prompt: str) -> dict[str, Any] | None:
    """The tool the request asks for: forced by tool_choice, or named in the last user turn."""
    functions = [t.get("function", {}) for t in tools if isinstance(t, dict)]
    functions = [fn for fn in functions if isinstance(fn, dict) and fn.get("name")]
    if not functions or tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):
        wanted = (tool_choice.get("function") or {}).get("name")
        return next((fn for fn in functions if fn["name"] == wanted), None)
    if tool_choice == "required":
        return functions[0]
    lowered = prompt.lower()
    for fn in functions:
        if fn["name"].lower() in lowered:
            return fn
    return None


_TOOL_PIECE = re.compile(r"\s*\w+|\s*[^\w\s]")


def plan_pieces(rng: random.Random, budget: int, *, reasoning: int, tool: ToolCall | None,
                loop_after: int = -1, loop_ngram: int = 4, stop_after: int = 0,
                mismatch_rng: random.Random | None = None) -> tuple[list[Piece], str]:
    """The tokens of one answer and its finish reason. Deterministic for a given rng seed."""
    pieces: list[Piece] = []
    words: list[str] = []

    def next_word() -> str:
        n = len(words)
        if 0 <= loop_after <= n and n >= loop_ngram:
            word = words[n - loop_ngram]
        else:
            source = mismatch_rng if (mismatch_rng is not None and n >= 2) else rng
            word = VOCAB[source.getrandbits(16) % len(VOCAB)]
            if mismatch_rng is not None and n >= 2:
                rng.getrandbits(16)
        words.append(word)
        return " " + word

    while len(pieces) < budget and len(pieces) < reasoning:
        pieces.append(Piece("reasoning", next_word()))
    if tool is not None:
        header = '<tool_call>\n{"name": "' + tool.name + '", "arguments": '
        trailer = "}\n</tool_call>"
        plan = [Piece("silent") for _ in _TOOL_PIECE.findall(header)]
        plan[-1] = Piece("tool_name", tool.name)
        plan += [Piece("tool_args", t) for t in _TOOL_PIECE.findall(tool.arguments)]
        plan += [Piece("silent") for _ in _TOOL_PIECE.findall(trailer)]
        plan.append(Piece("silent"))  # EOS
        room = budget - len(pieces)
        if len(plan) > room:
            return pieces + plan[:room], "length"
        return pieces + plan, "tool_calls"
    while len(pieces) < budget:
        if stop_after and len(pieces) >= stop_after:
            pieces.append(Piece("eos"))
            return pieces, "stop"
        kind = "reasoning" if len(pieces) < reasoning else "content"
        pieces.append(Piece(kind, next_word()))
    return pieces, "length"


# --------------------------------------------------------------------------------------------
# the engine: admission (max_num_seqs), pacing and accounting


class EngineDeadError(Exception):
    pass


@dataclass
class Request:
    kind: str                 # chat | completion
    prompt_tokens: list[Any]
    max_tokens: int | None
    budget: int
    arrival: float
    admitted: float = 0.0
    cached: int = 0
    blocks: int = 0
    first_token: float = 0.0
    last_emit: float = 0.0
    generated: int = 0
    finished: bool = False


class Engine:
    def __init__(self, cfg: Config, log: Log, metrics: Metrics) -> None:
        self.cfg = cfg
        self.log = log
        self.metrics = metrics
        self.cache = PrefixCache(cfg.block_size, cfg.kv_cache_tokens // cfg.block_size,
                                 cfg.prefix_caching, drop_last=cfg.eagle,
                                 align=cfg.mamba_cache_mode == "align")
        self.cond = threading.Condition()
        self.running = 0
        self.dead = False
        self.in_flight = 0
        self.request_counter = 0

    def admit(self, req: Request) -> None:
        with self.cond:
            if self.dead:
                raise EngineDeadError
            self.metrics.waiting += 1
            queued = False
            try:
                while self.running >= self.cfg.max_num_seqs and not self.dead:
                    queued = True
                    self.cond.wait(0.5)
                if self.dead:
                    raise EngineDeadError
                self.running += 1
            finally:
                self.metrics.waiting -= 1
            self.metrics.running = self.running
        # A request that found a free slot is paced from its arrival, so the simulator's own
        # parsing and tokenizing stay inside SIM_TTFT_MS instead of adding to it.
        req.admitted = time.monotonic() if queued else req.arrival
        req.cached = self.cache.lookup(req.prompt_tokens)
        self._set_blocks(req, len(req.prompt_tokens))

    def _set_blocks(self, req: Request, tokens: int) -> None:
        blocks = -(-tokens // self.cfg.block_size)
        with self.metrics.lock:
            self.metrics.kv_blocks_used += blocks - req.blocks
        req.blocks = blocks

    def first_token_deadline(self, req: Request) -> float:
        computed = len(req.prompt_tokens) - req.cached
        prefill = computed / self.cfg.prefill_tps if self.cfg.prefill_tps > 0 else 0.0
        return req.admitted + self.cfg.ttft_ms / 1000 + prefill + self.cfg.role_delay_ms / 1000

    def step_deadline(self, req: Request, step: int) -> float:
        gap_ms = self.cfg.itl_ms + self.cfg.decode_depth_slowdown * len(req.prompt_tokens) / 1000
        return self.first_token_deadline(req) + step * gap_ms / 1000

    def record_prefill(self, req: Request) -> None:
        """Counters vLLM updates when the prompt has been processed."""
        prompt = len(req.prompt_tokens)
        m = self.metrics
        if self.cfg.prefix_caching:
            m.inc("vllm:prefix_cache_queries", prompt)
            m.inc("vllm:prefix_cache_hits", req.cached)
        m.inc("vllm:prompt_tokens", prompt)
        m.inc("vllm:prompt_tokens_by_source", prompt - req.cached, source="local_compute")
        m.inc("vllm:prompt_tokens_by_source", req.cached, source="local_cache_hit")
        m.inc("vllm:prompt_tokens_cached", req.cached)
        m.observe("vllm:iteration_tokens_total", float(prompt - req.cached + 1))
        self.cache.insert(req.prompt_tokens, prefill=True)

    def record_step(self, req: Request, tokens: int, now: float, first: bool) -> None:
        m = self.metrics
        m.inc("vllm:generation_tokens", tokens)
        if first:
            req.first_token = now
        else:
            m.observe("vllm:inter_token_latency_seconds", now - req.last_emit)
            m.observe("vllm:iteration_tokens_total", float(tokens))
            k = self.cfg.num_spec_tokens
            if k:
                accepted = min(k, tokens - 1)
                m.inc("vllm:spec_decode_num_drafts", 1)
                m.inc("vllm:spec_decode_num_draft_tokens", k)
                m.inc("vllm:spec_decode_num_accepted_tokens", accepted)
                for pos in range(accepted):
                    m.inc("vllm:spec_decode_num_accepted_tokens_per_pos", 1, position=str(pos))
        req.last_emit = now
        req.generated += tokens
        self._set_blocks(req, len(req.prompt_tokens) + req.generated)

    def finish(self, req: Request, reason: str, generated_tokens: Sequence[Any]) -> None:
        if req.finished:
            return
        req.finished = True
        now = time.monotonic()
        m = self.metrics
        if req.admitted:
            if reason in ("stop", "length", "tool_calls"):
                self.cache.insert(list(req.prompt_tokens) + list(generated_tokens))
            label = "stop" if reason == "tool_calls" else reason
            m.inc("vllm:request_success", 1, finished_reason=label)
            first = req.first_token or now
            m.observe("vllm:request_prompt_tokens", float(len(req.prompt_tokens)))
            m.observe("vllm:request_generation_tokens", float(req.generated))
            m.observe("vllm:request_max_num_generation_tokens", float(req.budget))
            m.observe("vllm:request_params_n", 1.0)
            if req.max_tokens is not None:
                m.observe("vllm:request_params_max_tokens", float(req.max_tokens))
            m.observe("vllm:time_to_first_token_seconds", first - req.arrival)
            if req.generated > 1:
                m.observe("vllm:request_time_per_output_token_seconds",
                          (now - first) / (req.generated - 1))
            m.observe("vllm:e2e_request_latency_seconds", now - req.arrival)
            m.observe("vllm:request_queue_time_seconds", req.admitted - req.arrival)
            m.observe("vllm:request_inference_time_seconds", now - req.admitted)
            m.observe("vllm:request_prefill_time_seconds", first - req.admitted)
            m.observe("vllm:request_decode_time_seconds", now - first)
            m.observe("vllm:request_prefill_kv_computed_tokens",
                      float(len(req.prompt_tokens) - req.cached))
            self._set_blocks(req, 0)
            with self.cond:
                self.running -= 1
                m.running = self.running
                self.cond.notify()

    def kill(self) -> None:
        with self.cond:
            self.dead = True
            self.cond.notify_all()


def sleep_until(deadline: float, engine: Engine) -> None:
    """Sleep to an absolute monotonic deadline (so per-step errors never accumulate)."""
    while True:
        if engine.dead:
            raise EngineDeadError
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.25))


# --------------------------------------------------------------------------------------------
# HTTP


class ClientGoneError(Exception):
    pass


def error_body(message: str, err_type: str, param: str | None, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class ApiError(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, error_body(message, "BadRequestError", param, 400))


def dumps(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], sim: Simulator) -> None:
        self.sim = sim
        super().__init__(address, Handler, bind_and_activate=False)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""
    server: Server
    received = 0.0  # set per request in dispatch

    # -- plumbing

    def setup(self) -> None:
        super().setup()
        # Without TCP_NODELAY, small SSE writes wait for delayed ACKs (~40 ms) and pacing is gone.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the access log below is written in uvicorn's format instead

    def version_string(self) -> str:
        return "uvicorn"

    def access_log(self, status: int) -> None:
        host, port = self.client_address[:2]
        try:
            phrase = self.responses[status][0]
        except KeyError:
            phrase = ""
        path = self.path
        self.server.sim.log.uvicorn(
            f'{host}:{port} - "{self.command} {path} HTTP/1.1" {status} {phrase}')

    def send_body(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response_only(status)
        self.send_header("date", self.date_time_string())
        self.send_header("server", "uvicorn")
        self.send_header("content-length", str(len(body)))
        if body or content_type != "application/json":
            self.send_header("content-type", content_type)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.response_size = len(body)
        self.status = status
        self.access_log(status)

    def send_json(self, status: int, data: Any) -> None:
        self.send_body(status, dumps(data).encode())

    def start_stream(self) -> None:
        self.send_response_only(200)
        self.send_header("date", self.date_time_string())
        self.send_header("server", "uvicorn")
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        self.status = 200
        self.access_log(200)

    def send_event(self, payload: str) -> None:
        self.send_chunk(f"data: {payload}\n\n".encode())

    def send_chunk(self, data: bytes) -> None:
        """One piece of a chunked body; with the trickle fault, one byte per chunk, spaced."""
        cfg = self.server.sim.cfg
        try:
            if cfg.fault != "trickle":
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                return
            for i in range(len(data)):
                self.wfile.write(b"1\r\n" + data[i:i + 1] + b"\r\n")
                time.sleep(cfg.trickle_ms / 1000)
        except OSError as exc:
            raise ClientGoneError from exc

    def end_stream(self) -> None:
        try:
            self.wfile.write(b"0\r\n\r\n")
        except OSError as exc:
            raise ClientGoneError from exc

    def read_json(self) -> Any:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        self.request_size = length
        try:
            return json.loads(raw or b"null")
        except ValueError as exc:
            raise bad_request(f"JSON decode error: {exc}") from None

    # -- dispatch

    def do_GET(self) -> None:
        self.dispatch("GET")

    def do_POST(self) -> None:
        self.dispatch("POST")

    def do_HEAD(self) -> None:
        self.dispatch("HEAD")

    def dispatch(self, method: str) -> None:
        sim = self.server.sim
        started = time.monotonic()
        self.received = started  # arrival time of a generation request (pacing starts here)
        self.request_size = 0
        self.response_size = 0
        self.status = 0
        path = self.path.split("?", 1)[0]
        routes: dict[str, dict[str, Callable[[], None]]] = {
            **({"/sleep": {"POST": self.post_sleep}, "/wake_up": {"POST": self.post_wake},
                "/is_sleeping": {"GET": self.get_is_sleeping}} if sim.cfg.dev_mode else {}),
            "/health": {"GET": self.get_health},
            "/ping": {"GET": self.get_health, "POST": self.get_health},
            "/load": {"GET": self.get_load},
            "/version": {"GET": self.get_version},
            "/metrics": {"GET": self.get_metrics},
            "/v1/models": {"GET": self.get_models},
            "/tokenize": {"POST": self.post_tokenize},
            "/v1/chat/completions": {"POST": self.post_chat},
            "/v1/completions": {"POST": self.post_completions},
        }
        handlers = routes.get(path)
        generating = path in ("/v1/chat/completions", "/v1/completions")
        if generating:
            with sim.engine.cond:
                sim.engine.in_flight += 1
        try:
            if generating and sim.sleep.asleep:
                sim.sleep.while_asleep += 1
                sim.log.api("WARNING", "api_server.py:1051",
                            f"a request reached {path} while the engine sleeps")
                self.send_json(503, error_body("The engine is sleeping; wake it up first.",
                                               "ServiceUnavailableError", None, 503))
            elif handlers is None:
                self.send_json(404, {"detail": "Not Found"})
            elif method == "HEAD" and "GET" in handlers:
                handlers["GET"]()
            elif method not in handlers:
                self.send_json(405, {"detail": "Method Not Allowed"})
            else:
                handlers[method]()
        except ApiError as exc:
            self.send_json(exc.status, exc.body)
        except ClientGoneError:
            self.close_connection = True
        except EngineDeadError:
            if not self.status:
                self.send_json(500, error_body(ENGINE_ERROR_TEXT, "InternalServerError", None,
                                               500))
        except Exception as exc:  # a simulator bug: answer like vLLM's generic 500, keep serving
            sim.log.api("ERROR", "serving.py:208", f"Error in simulator: {exc!r}")
            traceback.print_exc()
            if not self.status:
                self.send_json(500, error_body(str(exc), "InternalServerError", None, 500))
            self.close_connection = True
        finally:
            if generating:
                with sim.engine.cond:
                    sim.engine.in_flight -= 1
            if handlers is not None and self.status:
                sim.metrics.observe_http(path, method, self.status, self.request_size,
                                         self.response_size, time.monotonic() - started)

    # -- sleep mode

    def post_sleep(self) -> None:
        sim = self.server.sim
        query = self.path.partition("?")[2]
        level = next((int(v) for k, _, v in (p.partition("=") for p in query.split("&"))
                      if k == "level" and v.isdigit()), 1)
        if not sim.cfg.sleep_mode:
            raise ApiError(400, error_body("Sleep mode is not enabled (--enable-sleep-mode)",
                                           "BadRequestError", None, 400))
        sim.sleep.go_to_sleep(level)
        self.send_body(200, b"")

    def post_wake(self) -> None:
        sim = self.server.sim
        if not sim.cfg.sleep_mode:
            raise ApiError(400, error_body("Sleep mode is not enabled (--enable-sleep-mode)",
                                           "BadRequestError", None, 400))
        sim.sleep.wake_up()
        self.send_body(200, b"")

    def get_is_sleeping(self) -> None:
        state = self.server.sim.sleep
        self.send_json(200, {"is_sleeping": state.asleep, "sim": {
            "sleeps": state.sleeps, "wakes": state.wakes, "levels": state.levels,
            "frees": state.frees,
            "requests_while_asleep": state.while_asleep}})

    # -- simple endpoints

    def get_health(self) -> None:
        if self.server.sim.engine.dead:
            self.send_body(503, b"")
        else:
            self.send_body(200, b"")

    def get_load(self) -> None:
        # vLLM counts in-flight generation requests here (with --enable-server-load-tracking)
        self.send_json(200, {"server_load": self.server.sim.engine.in_flight})

    def get_version(self) -> None:
        self.send_json(200, {"version": self.server.sim.cfg.version})

    def get_metrics(self) -> None:
        body = self.server.sim.metrics.render().encode()
        self.send_body(200, body, "text/plain; version=0.0.4; charset=utf-8")

    def get_models(self) -> None:
        sim = self.server.sim
        created = int(sim.started)
        cards = [{
            "id": name, "object": "model", "created": created, "owned_by": "vllm",
            "root": sim.cfg.model, "parent": None, "max_model_len": sim.cfg.max_model_len,
            "permission": [{
                "id": f"modelperm-{sim.random_hex()}", "object": "model_permission",
                "created": created, "allow_create_engine": False, "allow_sampling": True,
                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                "allow_fine_tuning": False, "organization": "*", "group": None,
                "is_blocking": False,
            }],
        } for name in sim.cfg.names]
        self.send_json(200, {"object": "list", "data": cards})

    def post_tokenize(self) -> None:
        sim = self.server.sim
        body = self.read_json()
        if not isinstance(body, dict):
            raise bad_request("Request body must be a JSON object")
        if "messages" in body:
            text = render_chatml(body.get("messages") or [], body.get("tools"),
                                 thinking_enabled(body))
            tokens = sim.tokenizer.encode(text)
        else:
            tokens = sim.tokenizer.encode(str(body.get("prompt", "")),
                                          add_special_tokens=bool(
                                              body.get("add_special_tokens", True)))
        self.send_json(200, {"count": len(tokens), "max_model_len": sim.cfg.max_model_len,
                             "tokens": sim.tokenizer.ids(tokens), "token_strs": None})

    # -- generation

    def check_model(self, body: dict[str, Any]) -> None:
        sim = self.server.sim
        model = body.get("model")
        if model is not None and model not in sim.cfg.names:
            message = f"The model `{model}` does not exist."
            sim.log.api("ERROR", "serving.py:208",
                        f"Error with model error=ErrorInfo(message='{message}', "
                        "type='NotFoundError', param='model', code=404)")
            raise ApiError(404, error_body(message, "NotFoundError", "model", 404))

    def maybe_drop(self) -> bool:
        sim = self.server.sim
        with sim.engine.cond:
            sim.engine.request_counter += 1
            count = sim.engine.request_counter
        if sim.cfg.fault == "drop-requests" and count % sim.cfg.drop_every == 0:
            # close the connection without writing a status line
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            return True
        return False

    def budget_for(self, body: dict[str, Any], prompt_len: int) -> tuple[int | None, int]:
        cfg = self.server.sim.cfg
        raw = body.get("max_completion_tokens", body.get("max_tokens"))
        if raw is not None and (not isinstance(raw, int) or isinstance(raw, bool) or raw < 1):
            raise bad_request("max_tokens must be at least 1, got " + json.dumps(raw),
                              "max_tokens")
        requested = raw if raw is not None else 0
        if prompt_len + requested > cfg.max_model_len or prompt_len >= cfg.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, "
                f"you requested {requested} output tokens and your prompt contains at least "
                f"{prompt_len} input tokens, for a total of at least {prompt_len + requested} "
                "tokens. Please reduce the length of the input prompt or the number of "
                f"requested output tokens. (parameter=input_tokens, value={prompt_len})",
                "input_tokens")
        budget = raw if raw is not None else cfg.max_model_len - prompt_len
        return raw, budget

    def generation_body(self) -> dict[str, Any] | None:
        """The request body of a generation call after the checks vLLM makes first; None when the
        drop-requests fault swallowed the request."""
        body = self.read_json()
        if not isinstance(body, dict):
            raise bad_request("Request body must be a JSON object")
        if self.maybe_drop():
            return None
        if self.server.sim.cfg.fault == "html-page":
            self.send_body(200, HTML_PAGE, "text/html; charset=utf-8")
            return None
        if self.server.sim.engine.dead:
            raise EngineDeadError
        self.check_model(body)
        return body

    def post_chat(self) -> None:
        sim = self.server.sim
        body = self.generation_body()
        if body is None:
            return
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("Field required: messages", "messages")
        tools = body.get("tools")
        if tools is not None and (not isinstance(tools, list) or not tools):
            raise bad_request(
                "`tools` must not be an empty array. Either provide at least one tool or omit "
                "the field entirely. (parameter=tools)", "tools")
        thinking = thinking_enabled(body)
        prompt_text = render_chatml(messages, tools, thinking)
        prompt_tokens = sim.tokenizer.encode(prompt_text)
        max_tokens, budget = self.budget_for(body, len(prompt_tokens))
        stream = bool(body.get("stream"))
        last_user = next((content_text(m.get("content")) for m in reversed(messages)
                          if isinstance(m, dict) and m.get("role") == "user"), "")
        tool = None
        if tools:
            fn = choose_tool(tools, body.get("tool_choice", "auto"), last_user)
            if fn is not None:
                arguments = json.dumps(example_arguments(fn.get("parameters")))
                tool = ToolCall(fn["name"], arguments, f"chatcmpl-tool-{sim.random_hex()}")
        reasoning = sim.cfg.reasoning_tokens if (sim.cfg.reasoning_parser and thinking) else 0
        pieces, finish = sim.plan(prompt_tokens, budget, reasoning, tool, stream, body)
        req = Request("chat", prompt_tokens, max_tokens, budget, self.received)
        rid = f"chatcmpl-{sim.random_hex()}"
        if stream:
            self.stream_chat(req, rid, body, pieces, finish, tool)
        else:
            self.complete_chat(req, rid, pieces, finish, tool)

    def post_completions(self) -> None:
        sim = self.server.sim
        body = self.generation_body()
        if body is None:
            return
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_tokens: list[Any] = list(prompt)
        else:
            if isinstance(prompt, list):
                prompt = prompt[0] if prompt else ""
            if not isinstance(prompt, str):
                raise bad_request("Field required: prompt", "prompt")
            prompt_tokens = sim.tokenizer.encode(prompt, add_special_tokens=True)
        max_tokens = body.get("max_tokens", 16)  # the OpenAI/vLLM default for completions
        body = {**body, "max_tokens": max_tokens}
        max_tokens, budget = self.budget_for(body, len(prompt_tokens))
        stream = bool(body.get("stream"))
        pieces, finish = sim.plan(prompt_tokens, budget, 0, None, stream, body)
        req = Request("completion", prompt_tokens, max_tokens, budget, self.received)
        rid = f"cmpl-{sim.random_hex()}"
        if stream:
            self.stream_completion(req, rid, body, pieces, finish)
        else:
            self.complete_text(req, rid, pieces, finish)

    def run_steps(self, req: Request, pieces: list[Piece],
                  emit: Callable[[list[Piece] | None, bool], None]) -> None:
        """Admit, then hand the pieces out step by step at their deadlines.

        `emit(None, False)` marks the moment of the role chunk; `emit(step, last)` each step.
        """
        engine = self.server.sim.engine
        engine.admit(req)
        try:
            per_step = self.server.sim.cfg.tokens_per_chunk
            steps: list[list[Piece]] = []
            if pieces:
                steps.append(pieces[:1])
                rest = pieces[1:]
                steps += [rest[i:i + per_step] for i in range(0, len(rest), per_step)]
            first = engine.first_token_deadline(req)
            role_at = first - self.server.sim.cfg.role_delay_ms / 1000
            sleep_until(role_at, engine)
            emit(None, False)
            for index, step in enumerate(steps):
                sleep_until(engine.step_deadline(req, index), engine)
                now = time.monotonic()
                emit(step, index == len(steps) - 1)
                # Bookkeeping after the write: hashing a long prompt into the prefix cache must
                # not delay the token the client is timing.
                if index == 0:
                    engine.record_prefill(req)
                engine.record_step(req, len(step), now, index == 0)
        except ClientGoneError:
            engine.finish(req, "abort", [])
            raise
        except EngineDeadError:
            engine.finish(req, "error", [])
            raise

    def generated_ids(self, pieces: list[Piece]) -> list[Any]:
        text = "".join(p.text for p in pieces if p.kind in ("content", "reasoning"))
        return self.server.sim.tokenizer.encode(text)

    def usage(self, req: Request, completion: int) -> dict[str, int]:
        prompt = len(req.prompt_tokens)
        if self.server.sim.cfg.fault == "usage-overcount":
            completion *= 2
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                "completion_tokens": completion}

    def stream_chat(self, req: Request, rid: str, body: dict[str, Any], pieces: list[Piece],
                    finish: str, tool: ToolCall | None) -> None:
        sim = self.server.sim
        opts = body.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage"))
        continuous = bool(opts.get("continuous_usage_stats"))
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": sim.cfg.name}
        sent = [0]
        self.start_stream()

        def emit(step: list[Piece] | None, last: bool) -> None:
            if step is None:
                choice: dict[str, Any] = {"index": 0,
                                          "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}
                chunk: dict[str, Any] = {**head, "choices": [choice]}
                if continuous:
                    chunk["usage"] = self.usage(req, 0)
                chunk["prompt_token_ids"] = None
                chunk["prompt_text"] = None
                self.send_event(dumps(chunk))
                return
            sent[0] += len(step)
            delta = chat_delta(step, tool)
            if not delta and not last:
                return  # tokens with no visible text (tool-call markup) make no chunk in vLLM
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": finish if last else None}
            if last:
                choice["stop_reason"] = None
            choice["token_ids"] = None
            chunk = {**head, "choices": [choice]}
            if continuous:
                chunk["usage"] = self.usage(req, sent[0])
            if sim.cfg.fault == "wrong-types":
                chunk["usage"] = 5
            self.send_event(dumps(chunk))

        if self.stream_steps(req, pieces, emit, head, finish, include_usage):
            sim.count_tool_parser(tool is not None, streaming=True)

    def complete_chat(self, req: Request, rid: str, pieces: list[Piece], finish: str,
                      tool: ToolCall | None) -> None:
        sim = self.server.sim
        self.run_steps(req, pieces, lambda step, last: None)
        sim.engine.finish(req, finish, self.generated_ids(pieces))
        reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
        content = "".join(p.text for p in pieces if p.kind == "content")
        message: dict[str, Any] = {
            "role": "assistant", "content": content or None, "refusal": None,
            "annotations": None, "audio": None, "function_call": None,
        }
        if tool is not None:
            args = "".join(p.text for p in pieces if p.kind == "tool_args")
            if finish == "length" and sim.cfg.fault == "tool-truncation":
                args = ""  # the fault: partial arguments are dropped here but not when streaming
            if any(p.kind == "tool_name" for p in pieces):
                message["tool_calls"] = [{"id": tool.call_id, "type": "function",
                                          "function": {"name": tool.name, "arguments": args}}]
        message["reasoning"] = reasoning or None
        data = {
            "id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": sim.cfg.name,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": finish, "stop_reason": None, "token_ids": None,
                         "routed_experts": None}],
            "service_tier": None, "system_fingerprint": sim.fingerprint,
            "usage": {**self.usage(req, len(pieces)), "prompt_tokens_details": None},
            "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
        }
        if sim.cfg.fault == "wrong-types":
            data["choices"] = "abc"
        self.send_json(200, data)
        sim.count_tool_parser(tool is not None, streaming=False)

    def stream_completion(self, req: Request, rid: str, body: dict[str, Any],
                          pieces: list[Piece], finish: str) -> None:
        sim = self.server.sim
        opts = body.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage"))
        continuous = bool(opts.get("continuous_usage_stats"))
        head = {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": sim.cfg.name}
        sent = [0]
        self.start_stream()

        def emit(step: list[Piece] | None, last: bool) -> None:
            if step is None:
                return  # completions have no role chunk
            sent[0] += len(step)
            choice = {"index": 0, "text": "".join(p.text for p in step), "logprobs": None,
                      "finish_reason": finish if last else None, "stop_reason": None,
                      "prompt_token_ids": None, "token_ids": None}
            chunk: dict[str, Any] = {**head, "choices": [choice]}
            if continuous:
                chunk["usage"] = self.usage(req, sent[0])
            self.send_event(dumps(chunk))

        self.stream_steps(req, pieces, emit, head, finish, include_usage)

    def stream_steps(self, req: Request, pieces: list[Piece], emit: Any, head: dict[str, Any],
                     finish: str, include_usage: bool) -> bool:
        """Send the paced chunks, the usage chunk and [DONE]; False when the engine died midway."""
        sim = self.server.sim
        if sim.cfg.fault == "keepalive":
            self.keep_alive(req, emit)
            return False
        try:
            self.run_steps(req, pieces, emit)
        except EngineDeadError:
            self.send_event(dumps(error_body(ENGINE_ERROR_TEXT, "InternalServerError", None,
                                             500)))
            self.send_event("[DONE]")
            self.end_stream()
            self.close_connection = True
            return False
        sim.engine.finish(req, finish, self.generated_ids(pieces))
        if include_usage:
            self.send_event(dumps({**head, "choices": [], "usage": self.usage(req, len(pieces)),
                                   "system_fingerprint": sim.fingerprint}))
        self.send_event("[DONE]")
        self.end_stream()
        return True

    def keep_alive(self, req: Request, emit: Any) -> None:
        """The keepalive fault: a slot, the role chunk, then SSE comments until the client goes."""
        engine = self.server.sim.engine
        engine.admit(req)
        try:
            emit(None, False)
            while True:
                sleep_until(time.monotonic() + self.server.sim.cfg.keepalive_ms / 1000, engine)
                self.send_chunk(b": ping\n\n")
        except (ClientGoneError, EngineDeadError):
            engine.finish(req, "abort", [])
            raise ClientGoneError from None

    def complete_text(self, req: Request, rid: str, pieces: list[Piece], finish: str) -> None:
        sim = self.server.sim
        self.run_steps(req, pieces, lambda step, last: None)
        sim.engine.finish(req, finish, self.generated_ids(pieces))
        data = {
            "id": rid, "object": "text_completion", "created": int(time.time()),
            "model": sim.cfg.name,
            "choices": [{"index": 0, "text": "".join(p.text for p in pieces), "logprobs": None,
                         "finish_reason": finish, "stop_reason": None, "token_ids": None,
                         "prompt_logprobs": None, "prompt_token_ids": None}],
            "service_tier": None, "system_fingerprint": sim.fingerprint,
            "usage": {**self.usage(req, len(pieces)), "prompt_tokens_details": None},
            "kv_transfer_params": None,
        }
        self.send_json(200, data)


def thinking_enabled(body: dict[str, Any]) -> bool:
    """False when the request turns thinking off (chat_template_kwargs or reasoning_effort)."""
    kwargs = body.get("chat_template_kwargs") or {}
    if isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False:
        return False
    effort = body.get("reasoning_effort")
    return not (isinstance(effort, str) and effort.lower() in ("none", "off"))


def chat_delta(step: list[Piece], tool: ToolCall | None) -> dict[str, Any]:
    """The `delta` of one streamed chat chunk, with vLLM's field names."""
    delta: dict[str, Any] = {}
    reasoning = "".join(p.text for p in step if p.kind == "reasoning")
    content = "".join(p.text for p in step if p.kind == "content")
    if reasoning:
        delta["reasoning"] = reasoning
    if content:
        delta["content"] = content
    if tool is not None:
        calls = []
        for piece in step:
            if piece.kind == "tool_name":
                calls.append({"id": tool.call_id, "type": "function", "index": 0,
                              "function": {"name": tool.name}})
            elif piece.kind == "tool_args":
                calls.append({"index": 0, "function": {"arguments": piece.text}})
        if calls:
            merged: list[dict[str, Any]] = []
            for call in calls:
                if merged and "id" not in call:
                    fn = merged[-1].setdefault("function", {})
                    fn["arguments"] = fn.get("arguments", "") + call["function"]["arguments"]
                else:
                    merged.append(call)
            delta["tool_calls"] = merged
    if not delta and any(p.kind == "eos" for p in step):
        delta["content"] = ""
    return delta


# --------------------------------------------------------------------------------------------
# the process


class SleepState:
    """Sleep mode and the stand-in card (SIM_GPU_MEMORY_DIR): what this engine holds there."""

    def __init__(self, cfg: Config, log: Log, metrics: Metrics) -> None:
        self.cfg, self.log, self.metrics = cfg, log, metrics
        self.asleep = False
        self.sleeps = self.wakes = self.while_asleep = 0
        self.levels: list[int] = []
        self.frees: list[str] = []  # per sleep: kv (the weights stayed) or all
        self.lock = threading.Lock()
        self.total = 0
        self.budget = 0

    def _path(self) -> str:
        return os.path.join(self.cfg.gpu_memory_dir, f"{os.getpid()}.used")

    def _hold(self, held: int) -> None:
        if not self.cfg.gpu_memory_dir:
            return
        temp = self._path() + ".tmp"
        with open(temp, "w") as handle:
            handle.write(f"{held}\n")
        os.replace(temp, self._path())

    def claim(self) -> bool:
        """At boot: take --gpu-memory-utilization of the stand-in card, as vLLM does, or refuse
        with vLLM's error when less than that is free."""
        folder = self.cfg.gpu_memory_dir
        if not folder:
            return True
        with open(os.path.join(folder, "total")) as handle:
            self.total = int(handle.read().split()[0])
        others = 0
        for name in os.listdir(folder):
            pid = name.removesuffix(".used")
            if not name.endswith(".used") or not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    if stat.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                        continue
                with open(os.path.join(folder, name)) as handle:
                    others += int(handle.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue
        free = self.total - others
        self.budget = -(-int(self.total * self.cfg.gpu_memory_utilization) // 1)
        if free < self.budget:
            gib = 1024**3
            self.log.core("ERROR", "core.py:1349", "EngineCore failed to start.")
            self.log.core("ERROR", "core.py:1349", (
                f"ValueError: Free memory on device cuda:0 ({free / gib:.2f}/"
                f"{self.total / gib:.2f} GiB) on startup is less than desired GPU memory "
                f"utilization ({self.cfg.gpu_memory_utilization}, {self.budget / gib:.2f} GiB). "
                "Decrease GPU memory utilization or reduce GPU memory used by other processes."))
            self.log.raw(f"(APIServer pid={self.log.pid}) {CORE_FAILED_TEXT}", sys.stderr)
            return False
        self._hold(self.budget)
        return True

    def go_to_sleep(self, level: int) -> None:
        with self.lock:
            first = self.sleeps == 0
            time.sleep((self.cfg.first_sleep_ms if first else self.cfg.sleep_ms) / 1000)
            self.sleeps += 1
            self.levels.append(level)
            self.asleep = True
            self.metrics.sleep_state = "weights_offloaded"
            kv = self.cfg.sleep_plugin and level == 1 and self._asked_frees() != "all"
            self.frees.append("kv" if kv else "all")
            weights = int(self.cfg.weights_mib * 1024**2)
            residue = int(self.cfg.sleep_residue_mib * 1024**2) + (weights if kv else 0)
            kept = self.budget if self.cfg.sleep_fault == "keep-memory" else min(residue,
                                                                                  self.budget)
            self._hold(kept)
            freed = (self.budget - kept) / 1024**3
            if kv:  # the plugin's own line (engine-plugins/vllmstack_sleep)
                self.log.api("INFO", "__init__.py:68", f"vllmstack_sleep: freed {freed:.2f} GiB "
                             f"of KV cache, kept {weights / 1024**3:.2f} GiB mapped (weights) "
                             "on the card")
                return
            backed = weights / 1024**3 if weights else 0.93
            self.log.api("INFO", "cumem.py:263", f"CuMemAllocator: sleep freed {freed:.2f} GiB "
                         f"memory in total, of which {backed:.2f} GiB is backed up in CPU and the "
                         f"rest of {freed - backed:.2f} GiB is discarded directly.")

    def _asked_frees(self) -> str:
        """What the router wrote for this sleep (the plugin reads the same file), kv without."""
        try:
            with open(self.cfg.sleep_frees_file, encoding="utf-8") as handle:
                words = handle.read(64).split()
        except OSError:
            return "kv"
        return words[0] if words else "kv"

    def wake_up(self) -> None:
        with self.lock:
            time.sleep(self.cfg.wake_ms / 1000)
            self.wakes += 1
            self.asleep = False
            self.metrics.sleep_state = "awake"
            self._hold(self.budget)

    def release(self) -> None:
        if self.cfg.gpu_memory_dir:
            with contextlib.suppress(OSError):
                os.unlink(self._path())


class Simulator:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.log = Log()
        self.metrics = Metrics(cfg)
        self.engine = Engine(cfg, self.log, self.metrics)
        self.tokenizer = Tokenizer(cfg.tokenizer_path)
        self.started = time.time()
        self.fingerprint = f"vllm-{cfg.version}-{BUILD_HASH}"
        self._rand = random.Random()
        self._rand_lock = threading.Lock()
        self.server: Server | None = None
        self.sleep = SleepState(cfg, self.log, self.metrics)

    def random_hex(self) -> str:
        with self._rand_lock:
            return f"{self._rand.getrandbits(64):016x}"

    def plan(self, prompt_tokens: list[Any], budget: int, reasoning: int, tool: ToolCall | None,
             stream: bool, body: dict[str, Any]) -> tuple[list[Piece], str]:
        cfg = self.cfg
        seed = zlib.crc32("\x1f".join(str(t) for t in prompt_tokens).encode()) ^ cfg.seed
        mismatch = None
        if cfg.fault == "stream-mismatch" and stream:
            mismatch = random.Random(seed ^ 0x5A5A5A5A)
        stop_after = 0 if body.get("ignore_eos") else cfg.stop_after
        pieces, finish = plan_pieces(
            random.Random(seed), budget, reasoning=reasoning, tool=tool,
            loop_after=cfg.loop_after if cfg.fault == "token-loop" else -1,
            loop_ngram=cfg.loop_ngram, stop_after=stop_after, mismatch_rng=mismatch)
        if cfg.textless_tokens:
            # Tokens with no text (a stripped </think>, a special token) still count in usage.
            cut = min(cfg.textless_tokens, len(pieces))
            pieces = [Piece("silent") for _ in range(cut)] + pieces[cut:]
        return pieces, finish

    def count_tool_parser(self, called: bool, streaming: bool) -> None:
        if not self.cfg.tool_call_parser:
            return
        with self.metrics.lock:
            self.metrics._inc_raw("vllm:tool_call_parser_invocations", 1, {
                "mode": "streaming" if streaming else "non_streaming",
                "model_name": self.cfg.name,
                "outcome": "tool_call" if called else "no_tool_call",
                "request_type": "chat_completions"})

    # -- boot

    def log_boot(self) -> None:
        cfg, log = self.cfg, self.log
        where = "api_utils.py:345"
        for line in ("", "       █     █     █▄   ▄█",
                     f" ▄▄ ▄█ █     █     █ ▀▄▀ █  version {cfg.version}",
                     f"  █▄█▀ █     █     █     █  model   {cfg.model}",
                     "   ▀▀  ▀▀▀▀▀ ▀▀▀▀▀ ▀     ▀", ""):
            log.api("INFO", where, line)
        log.api("INFO", "api_utils.py:273", f"non-default args: {cfg.non_default!r}")
        log.api("INFO", "model.py:645", "Resolved architecture: Qwen3ForCausalLM")
        log.api("INFO", "model.py:1883", f"Using max model len {cfg.max_model_len}")
        log.api("INFO", "scheduler.py:242",
                "Chunked prefill is enabled with max_num_batched_tokens=8192.")
        spec = "None"
        if cfg.spec_config:
            spec = (f"SpeculativeConfig(method='{cfg.spec_config.get('method')}', "
                    f"model={cfg.spec_config.get('model')!r}, "
                    f"num_spec_tokens={cfg.num_spec_tokens})")
        log.core("INFO", "core.py:121",
                 f"Initializing a V1 LLM engine (v{cfg.version}) with config: "
                 f"model='{cfg.model}', speculative_config={spec}, tokenizer='{cfg.model}', "
                 f"max_seq_len={cfg.max_model_len}, "
                 f"tensor_parallel_size={cfg.tensor_parallel_size}, "
                 f"kv_cache_dtype={cfg.kv_cache_dtype}, served_model_name={cfg.name}, "
                 f"enable_prefix_caching={cfg.prefix_caching}, enable_chunked_prefill=True")
        log.core("INFO", "model_runner.py:308", "Loading model from scratch...")

    def log_engine_ready(self) -> None:
        cfg, log = self.cfg, self.log
        gib = cfg.kv_cache_tokens * 2 * 8 * 128 * 2 * 28 / 2**30  # a plausible figure only
        log.core("INFO", "default_loader.py:430", "Loading weights took 0.01 seconds")
        log.core("INFO", "gpu_worker.py:563", f"Available KV cache memory: {gib:.2f} GiB")
        log.core("INFO", "kv_cache_utils.py:2235",
                 f"GPU KV cache size: {cfg.kv_cache_tokens:,} tokens")
        log.core("INFO", "kv_cache_utils.py:2236",
                 f"Maximum concurrency for {cfg.max_model_len:,} tokens per request: "
                 f"{cfg.kv_cache_tokens / cfg.max_model_len:.2f}x")
        log.core("INFO", "core.py:348",
                 f"init engine (profile, create kv cache, warmup model) took "
                 f"{cfg.boot_seconds:.2f} s (compilation: 0.00 s)")
        log.api("INFO", "api_server.py:678", "Supported tasks: ['generate']")
        if cfg.auto_tool_choice:
            log.api("INFO", "parser_manager.py:37", '"auto" tool choice has been enabled.')
        host = cfg.host or "0.0.0.0"
        log.api("INFO", "api_server.py:682", f"Starting vLLM server on http://{host}:{cfg.port}")
        log.api("INFO", "launcher.py:37", "Available routes are:")
        for route, methods in (("/load", "GET"), ("/version", "GET"), ("/health", "GET"),
                               ("/metrics", "GET"), ("/tokenize", "POST"),
                               ("/v1/models", "GET"), ("/ping", "GET"), ("/ping", "POST"),
                               ("/v1/chat/completions", "POST"), ("/v1/completions", "POST")):
            log.api("INFO", "launcher.py:46", f"Route: {route}, Methods: {methods}")
        log.api("INFO", "launcher.py:99", "API server: waiting for HTTP server to start")
        log.uvicorn(f"Started server process [{log.pid}]")
        log.uvicorn("Waiting for application startup.")
        log.uvicorn("Application startup complete.")
        log.api("INFO", "launcher.py:105", "API server: HTTP server started")

    def crash_at_boot(self) -> None:
        log = self.log
        text = self.cfg.fault_log.replace("\\n", "\n") or KV_MEMORY_ERROR
        log.core("ERROR", "core.py:1349", "EngineCore failed to start.")
        log.core("ERROR", "core.py:1349", "Traceback (most recent call last):")
        for line in text.splitlines():
            log.core("ERROR", "core.py:1349", line)
        log.raw(f"(APIServer pid={log.pid}) Traceback (most recent call last):", sys.stderr)
        log.raw(f'(APIServer pid={log.pid})   File "/opt/venv/lib/python3.12/site-packages/vllm/'
                'v1/engine/utils.py", line 1253, in wait_for_engine_startup', sys.stderr)
        log.raw(f"(APIServer pid={log.pid})     raise RuntimeError(", sys.stderr)
        log.raw(f"(APIServer pid={log.pid}) {CORE_FAILED_TEXT}", sys.stderr)

    def die(self) -> None:
        """die-after: the engine core goes away; vLLM reports it and the API server exits."""
        log = self.log
        log.core("ERROR", "core.py:1138", "EngineCore encountered a fatal error.")
        log.core("ERROR", "core.py:1138", "RuntimeError: simulated engine failure (SIM_FAULT=die-after)")
        log.api("ERROR", "async_llm.py:705", "AsyncLLM output_handler failed.")
        log.api("ERROR", "async_llm.py:705",
                f"vllm.v1.engine.exceptions.EngineDeadError: {ENGINE_ERROR_TEXT}")
        self.engine.kill()
        time.sleep(self.cfg.dead_linger_s)
        log.api("INFO", "launcher.py:112", "[shutdown] API server: shutdown triggered")
        sys.stdout.flush()
        os._exit(1)

    def shutdown(self, signum: int) -> None:
        log = self.log
        name = signal.Signals(signum).name
        log.api("INFO", "launcher.py:112", "[shutdown] API server: shutdown triggered")
        log.core("INFO", "core.py:1332", f"[shutdown] EngineCore: trigger received signal={name}")
        log.uvicorn("Shutting down")
        log.uvicorn("Waiting for application shutdown.")
        log.uvicorn("Application shutdown complete.")
        sys.stdout.flush()
        sys.stderr.flush()
        self.sleep.release()
        # os._exit: streaming threads may be mid-sleep; a prompt exit is what Compose needs.
        os._exit(0)

    def run(self) -> int:
        cfg = self.cfg
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda s, _frame: self.shutdown(s))
        server = Server((cfg.host, cfg.port), self)
        # Bind now (vLLM reserves its port early) but listen only when "loaded": until then a
        # client gets "connection refused", as with the real engine.
        server.server_bind()
        self.server = server
        self.log_boot()
        time.sleep(cfg.boot_seconds)
        if cfg.fault in ("crash-at-boot", "crash-loop"):
            self.crash_at_boot()
            return 1
        if cfg.fault == "hang":
            while True:
                time.sleep(3600)
        if not self.sleep.claim():
            return 1
        self.log_engine_ready()
        server.server_activate()
        if cfg.fault == "die-after":
            threading.Timer(cfg.die_after_s, self.die).start()
        server.serve_forever(poll_interval=0.2)
        return 0


def main(argv: Sequence[str], environ: dict[str, str]) -> int:
    try:
        cfg = load_config(argv, environ)
    except ConfigError as exc:
        sys.stderr.write(f"vllm serve: error: {exc}\n")
        return 2
    sim = Simulator(cfg)
    try:
        return sim.run()
    except OSError as exc:
        sim.log.api("ERROR", "api_server.py:682", f"OSError: {exc}")
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], dict(os.environ)))
