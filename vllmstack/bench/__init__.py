"""Benchmarks, regression probes and stability runs against an OpenAI-compatible endpoint.

Modules: `client` (streaming HTTP client and per-request timings), `prompts` (tokenizer lookup and
exact-length prompts from the shipped corpus), `stats` (summaries), `ladders` (depth and
concurrency rungs), `session` (run options, overhead correction, summary rows), `runs` (bench,
and `execute` for every kind), `depth_runs`, `conc_runs`, `probes`, `stability`, `report`,
`target` (what a run or the dashboard talks to), `options` (every command-line option, declared
once for `python -m vllmstack.bench` and the invoke tasks), `cli`. Nothing here runs at import time.
"""

from __future__ import annotations
