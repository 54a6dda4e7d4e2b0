"""The measured runs: bench (pp/tg matrix), depth (context ladder), conc (concurrency ladder).

  runs.py        `execute`: one kind end to end (target, tokenizer, history record)
  session.py     the options, client, prompts, overhead correction and summary row of a session
  depth_runs.py  the depth run
  decay_runs.py  the depth run as the depth-decay probe's measurement (`ProbeContext.depth_rows`)
  conc_runs.py   the concurrency run

Imports `client`, `workload`, `report`, `target` and `options` (the token bound).
"""

from __future__ import annotations
