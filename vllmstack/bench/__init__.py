"""Benchmarks, regression probes and stability runs against an OpenAI-compatible endpoint.

Modules: `client` (streaming HTTP client and per-request timings), `prompts` (tokenizer lookup and
exact-length prompts from the shipped corpus), `stats` (summaries), `ladders` (depth and
concurrency rungs), `runs` (bench / depth / conc), `probes`, `stability`, `report`.
Nothing here runs at import time.
"""

from __future__ import annotations
