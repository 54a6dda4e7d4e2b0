"""What a run sends: exact-length prompts from the shipped corpus, and the ladders that size them.

  prompts.py             tokenizer lookup (from disk only) and prompts of an exact token length
  selftest_tokenizer.py  a byte-level BPE tokenizer trained on the corpus, where no model's exists
                         (the test suite, the benchmark scripts, `invoke make-model`)
  ladders.py             depth and concurrency rungs that follow the live profile
  corpus/                the shipped prose (package data)

Imports nothing else of bench.
"""

from __future__ import annotations
