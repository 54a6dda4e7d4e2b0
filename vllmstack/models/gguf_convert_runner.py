"""Run llama.cpp's convert_hf_to_gguf.py from a source tree, optionally naming the pre-tokenizer.

  python gguf_convert_runner.py --source TREE [--pre-tokenizer NAME] -- CONVERTER ARGS...

The converter knows a BPE tokenizer's pre-tokenizer only by the hash of a test string's tokens,
and refuses one it has no hash for ("BPE pre-tokenizer was not recognized"), even where the split
rule is one llama.cpp implements. With --pre-tokenizer NAME, and only when the hash is unknown,
the file gets tokenizer.ggml.pre = NAME instead, said loudly; a known hash keeps its own name.
With --quiet as well (the stack's own made model, whose record names its split and whose
tokenizer.json is the one recorded), nothing is said: neither the converter's warning box nor ours.
The converter's log line that prints the whole chat template is cut to its length.

`invoke gguf-convert` runs this file by path with a Python that has torch and transformers (an
engine's environment, not necessarily the stack's), so it imports nothing from vllmstack and only
the standard library and the converter's own modules.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import runpy
import sys
from pathlib import Path
from typing import Any

# What the converter's get_vocab_base_pre raises for a hash it does not know.
UNKNOWN = NotImplementedError


def use_pre_tokenizer(name: str, *, quiet: bool = False) -> None:
    """Make the converter name an unknown pre-tokenizer `name` (see the module docstring)."""
    base: Any = importlib.import_module("conversion.base")
    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self: Any, tokenizer: Any) -> str:
        if quiet:  # the converter logs its warning box before it raises
            logging.disable(logging.WARNING)
        try:
            return str(original(self, tokenizer))
        except UNKNOWN:
            if quiet:
                return name
            rule = "!" * 78
            print(f"\n{rule}\nvllmstack: llama.cpp does not know this tokenizer's pre-tokenizer "
                  f"hash (see its warning above);\nwriting tokenizer.ggml.pre = {name!r} as asked "
                  "(--pre-tokenizer, or the made model's record).\nIf llama-server tokenizes "
                  f"differently from the original, the name is wrong.\n{rule}\n",
                  file=sys.stderr, flush=True)
            return name
        finally:
            if quiet:
                logging.disable(logging.NOTSET)

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre


class ShortChatTemplate(logging.Filter):
    """gguf-py logs "Setting chat_template to <the whole template>": a screenful of Jinja."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        prefix = "Setting chat_template to "
        if text.startswith(prefix):
            record.msg, record.args = (f"Setting chat_template ({len(text) - len(prefix)} "
                                       "characters)"), None
        return True


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    cut = words.index("--") if "--" in words else len(words)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", required=True, help="the llama.cpp tree (convert_hf_to_gguf.py)")
    parser.add_argument("--pre-tokenizer", default="", help="name for an unknown pre-tokenizer")
    parser.add_argument("--quiet", action="store_true",
                        help="use --pre-tokenizer without a warning (the stack's own model)")
    args = parser.parse_args(words[:cut])
    source = Path(args.source).resolve()
    script = source / "convert_hf_to_gguf.py"
    # The converter imports its `conversion` package from beside it and gguf-py from the tree.
    sys.path[:0] = [str(source), str(source / "gguf-py")]
    if args.pre_tokenizer:
        use_pre_tokenizer(args.pre_tokenizer, quiet=args.quiet)
    logging.getLogger("gguf.vocab").addFilter(ShortChatTemplate())
    sys.argv = [str(script), *words[cut + 1:]]
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
