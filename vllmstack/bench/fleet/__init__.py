"""Several profiles measured one resident at a time, each brought up and down through serve's lifecycle.

  vs.py         `invoke bench-vs`: the same measurements on each target, one table
  vs_report.py  what bench-vs compares (checkpoint, draft, pair kind) and the markdown it writes
  burn.py       `invoke burn`: every profile made for a platform, a few runs each, PASS/FAIL
  resident.py   the steps both share: bring one up, measure, take it down, stop on a signal

Above `runs`, whose measurements it reuses.
"""

from __future__ import annotations
