"""The dashboard: live engine metrics and benchmark history in a browser.

Modules: `live` (polls the engine's /metrics, derives rates, keeps a ring of
points), `runs` (starts and cancels benchmark runs under one lock), `app`
(the FastAPI app and its endpoints), `__main__` (`python -m vllmstack.dashboard`).
The page and the vendored Chart.js are in `static/`. Nothing runs at import time.
"""

from __future__ import annotations
