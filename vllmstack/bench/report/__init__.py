"""What runs leave behind and how it reads: the history store, the report and its charts.

  history.py   one JSON-lines file per kind, appended atomically under a lock
  report.py    markdown tables and PNG charts from the history (`report`)
  png.py       a standard-library RGB canvas that writes PNG (charts, the multi-image probe's pictures)
  roofline.py  % of what the card allows at best, per row; the cited card table

Imports nothing else of bench.
"""

from __future__ import annotations
