"""The measuring client: what is sent and what each request's timings are.

  http.py    a small HTTP/1.1 client on asyncio protocols, made for timing token streams
  stream.py  the per-request measurements (`RequestResult`) and the SSE parser that fills them
  client.py  `ChatClient` (one pooled connection set), the request bodies, the endpoint errors
  stats.py   summaries of timing samples: mean, spread, percentiles
  row.py     `BenchRow`: the typed, versioned row every run builds and every reader reads

The bottom of bench: imports nothing else of it.
"""

from __future__ import annotations
