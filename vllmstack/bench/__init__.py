"""Benchmarks, regression probes and stability runs against an OpenAI-compatible endpoint.

Subpackages, bottom to top (each imports only those before it; import-linter checks):

  client/    the measuring client: HTTP, SSE parsing, per-request timings, their statistics
  report/    the JSONL history, the report and its PNG charts, % of the roofline
  probes/    regression probes and stability runs, their settings and verdicts
  runs/      bench, depth and conc runs and the session they share
  fleet/     profiles measured one resident at a time: bench-vs and burn

What a run sends (exact-length prompts from the shipped corpus, tokenizers, depth/concurrency
ladders) is the lower package `vllmstack.workload`, which models and maintenance share.

Beside them: `target.py` (what a run or the dashboard talks to: a URL or the running stack),
`options.py` (every command-line option, declared once for `python -m vllmstack.bench` and the
invoke tasks; below `runs`, above `probes`) and `cli.py` (the command line, on top of all).
Nothing here runs at import time.
"""

from __future__ import annotations
