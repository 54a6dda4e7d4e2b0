"""The log lines that place a boot's phases, per engine (serve.boot_phases reads them).

The texts come from real logs: shared/reference/vllm-captures and tests/data (vLLM 0.27.1 on an
H200, its TP=2 hybrid boot), tests/data/boot-cpu-*.log (the CPU engine, cold and warm),
tests/data/llamacpp/ (llama-server), and vLLM's and llama.cpp's source. vLLM rewords these lines
between releases: a line no marker matches is never an error, its time goes to the phase in
progress, or to `other` when none is (serve.boot_phases).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

STARTING, PARSING, INIT, WEIGHTS = "starting", "parsing arguments", "initialising engine", "loading weights"
COMPILE, PROFILE, KV, CAPTURE = "compiling", "profiling memory", "allocating KV cache", "capturing graphs"
KERNELS, API, WARM_UP, OTHER = "warming up kernels", "starting API server", "warm-up", "other"


@dataclass(frozen=True)
class Marker:
    """A log line that places the boot: the phase it marks and/or ends, and what else it says."""

    pattern: re.Pattern[str]
    marks: str | None = None  # the phase in progress at this line
    ends: str | None = None  # the phase that ran up to this line
    took: bool = False  # the pattern's group `s`: seconds its phase had run by this line
    logged: bool = False  # ... and those are the engine's own figure for the whole phase
    cache: str | None = None  # torch.compile's cache: "hit" or "miss"
    ready: bool = False  # the server answers: the boot ends here
    boot: bool = False  # the first line of a boot (a container's log may hold several)
    then: str | None = None  # what `up`'s live progress names after the phase this one ends


def _m(text: str, **kwargs: Any) -> Marker:
    return Marker(re.compile(text), **kwargs)


# The first pattern that matches a line decides; a line may name several things, so the specific
# ones come first.
VLLM_MARKERS: tuple[Marker, ...] = (
    _m(r"non-default args", marks=PARSING, boot=True),
    _m(r"Initializing a V1 LLM engine", marks=INIT),
    # The profiling run follows (torch.compile compiles in its first forward pass).
    _m(r"Model loading took .*? and (?P<s>\d+(?:\.\d+)?) seconds", ends=WEIGHTS, took=True,
       logged=True, then=PROFILE),
    _m(r"Loading weights took (?P<s>\d+(?:\.\d+)?) seconds", marks=WEIGHTS, took=True),
    _m(r"Starting to load model|Loading model from scratch|Loading drafter model|"
       r"Loading safetensors checkpoint shards|Initializing model took", marks=WEIGHTS),
    # 0.27: `torch.compile took 13.66 s in total`; earlier `takes`, or `torch.compile and initial
    # profiling run took 3.37 s in total`.
    _m(r"torch\.compile (?:and initial profiling run )?(?:took|takes) (?P<s>\d+(?:\.\d+)?) s in "
       r"total", ends=COMPILE, took=True, logged=True, then=PROFILE),
    _m(r"Directly load the compiled graph|Directly load AOT compilation", marks=COMPILE,
       cache="hit"),
    _m(r"Compiling a graph for|Cache the graph of compile range|saved AOT compiled function|"
       r"Compiling model again", marks=COMPILE, cache="miss"),
    _m(r"Dynamo bytecode transform time: (?P<s>\d+(?:\.\d+)?) s", marks=COMPILE, took=True),
    _m(r"for vLLM's torch\.compile|Starting torch\.compile|Warming up model for the compilation",
       marks=COMPILE),
    # The CPU model runner compiles in its warm-up (`Warming up model for the compilation...`).
    _m(r"Warming up done", ends=COMPILE, then=KV),
    _m(r"Initial profiling/warmup run took (?P<s>\d+(?:\.\d+)?) s", marks=PROFILE, took=True,
       logged=True),
    # Logged once the profiling run has measured what is left (GPU; the CPU worker's own line).
    _m(r"Available KV cache memory|GiB for KV cache on node", ends=PROFILE, marks=KV),
    _m(r"KV cache size: [\d,]+ tokens|Maximum concurrency for", marks=KV),
    _m(r"Graph capturing finished in (?P<s>\d+(?:\.\d+)?) secs", ends=CAPTURE, took=True,
       logged=True, then=KERNELS),
    _m(r"Capturing CUDA graph", marks=CAPTURE),
    _m(r"Free memory on device .* on startup|Compile and warming up model for size|"
       r"Warming up (?!done|model for the compilation)|Kernel JIT monitor activated", marks=KERNELS),
    _m(r"init engine \(profile, create kv cache, warmup model\) took|Supported tasks:|"
       r"Starting vLLM server on|Available routes are|Started server process|"
       r"Waiting for application startup", marks=API),
    _m(r"API server: HTTP server started|Application startup complete", marks=API, ready=True),
)
# llama-server (b9993 tools/server: `loading model`, `initializing, n_slots`, `model loaded`,
# which it logs once /health answers 200; its HTTP server listens before the model loads).
LLAMACPP_MARKERS: tuple[Marker, ...] = (
    _m(r"common_params_print_info", marks=PARSING),
    _m(r"load_model: loading model", marks=WEIGHTS),
    _m(r"load_model: initializing, n_slots", marks=INIT),
    _m(r"model loaded", marks=API, ready=True),
)


@dataclass(frozen=True)
class Dialect:
    """One engine's log: the lines that place its boot, and what its stamps count from."""

    engine: str  # the engine kind whose log it is (config/engines: ENGINE's value)
    markers: tuple[Marker, ...]
    process_clock: bool  # stamps count from the process's start, not the wall clock


VLLM = Dialect("vllm", VLLM_MARKERS, process_clock=False)
LLAMACPP = Dialect("llamacpp", LLAMACPP_MARKERS, process_clock=True)
DIALECTS = {d.engine: d for d in (VLLM, LLAMACPP)}

VLLM_STAMP = re.compile(r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)"
                        r"(\.\d+)? \[")
LLAMACPP_STAMP = re.compile(r"^(\d+)\.(\d\d)\.(\d{3})\.(\d{3}) [A-Z] ")
# Lines that close a boot: a later boot in the same log starts after them.
BOOT_OVER = re.compile(r"\[shutdown\]|Shutting down|Application shutdown complete|ERROR \d\d-\d\d|"
                       r"Traceback \(most recent call last\)")


SERVING = "serving"  # what the live progress says once the server answers


def live_phase(line: str) -> str | None:
    """The phase a log line says the boot is in (`up`'s live progress, serve.watch), of either
    engine's log: the one it marks, the one that follows the one it ends, `serving` once the
    server answers; None for a line that says nothing about it."""
    for dialect in DIALECTS.values():
        marker = next((m for m in dialect.markers if m.pattern.search(line)), None)
        if marker is not None:
            return SERVING if marker.ready else marker.marks or marker.then or marker.ends
    return None
