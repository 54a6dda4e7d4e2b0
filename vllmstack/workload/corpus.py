"""The bundled corpus's file and the split of a text corpus that training and KV calibration share.
Plain Python, no imports of the package: the runners that use it run in the engine's interpreter."""

from __future__ import annotations

from pathlib import Path

CORPUS_FILE = "essays.txt"
# A real file path, found from this module (not an importlib.resources handle): it is handed to the
# runners in the engine's Python as an argument and recorded in the calibrated copy's sidecar.
BUNDLED_CORPUS = Path(__file__).resolve().parent / "corpus" / CORPUS_FILE
HELDOUT_SHARE = 0.1  # the corpus's last tenth: never trained on, never calibrated on


def split_corpus(text: str) -> tuple[str, str]:
    """(training text, held-out text): cut at the first paragraph break after 90 % of the text."""
    at = int(len(text) * (1 - HELDOUT_SHARE))
    brk = text.find("\n\n", at)
    cut = brk if 0 <= brk < len(text) - 1 else at
    return text[:cut], text[cut:]
