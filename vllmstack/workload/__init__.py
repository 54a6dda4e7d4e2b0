"""What a run sends: exact-length prompts from the shipped corpus, and the ladders that size them.

  prompts.py             tokenizer lookup (from disk only) and prompts of an exact token length
  selftest_tokenizer.py  a byte-level BPE tokenizer trained on the corpus, where no model's exists
                         (the test suite, the benchmark scripts, `invoke make-model`)
  ladders.py             depth and concurrency rungs that follow the live profile
  corpus.py              the bundled corpus's path and the training/held-out split (stdlib only)
  corpus/                the shipped prose (package data)

A low layer (it imports only `core`), so that bench, models, maintenance and tune share it without
reaching into each other. This file imports nothing: the runners in the engine's Python import
corpus.py, which loads this package first.
"""

from __future__ import annotations
