"""`python -m vllmstack.bench ...`: the same entry the invoke tasks and the dashboard use."""

from __future__ import annotations

from vllmstack.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
