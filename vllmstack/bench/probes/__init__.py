"""Live checks that end in a verdict: regression probes and stability runs.

  probes.py       `PROBES`: the registry and the small probes; a large one has its own module:
  probe_stall.py  itl-stall (decoders keep streaming while a huge prompt is prefilled)
  probe_cache.py  prefix-cache (a multi-turn chat reuses its previous turns)
  probe_decay.py  depth-decay (decode at 8K/32K/64K as a share of 8K; measured by bench-depth's
                  run, which the caller hands in as `ProbeContext.depth_rows`)
  probe_base.py   `ProbeContext`: what every probe and stability run is handed
  stability.py    smoke, stress and long
  params.py       the `-p KEY=VALUE` settings each probe and stability mode takes, checked up front
  verdict.py      pass / fail / inconclusive with a check table

Imports `client`, `workload` and `report` (the PNG canvas), never `runs` or `fleet`.
"""

from __future__ import annotations
