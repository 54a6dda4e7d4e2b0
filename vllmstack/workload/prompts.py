"""Prompts of an exact token length, built from the shipped corpus with the model's own tokenizer.

The tokenizer is read from disk only: a tokenizer.json file, a folder holding one, or a Hugging
Face id that is already in the local HF cache. Nothing is downloaded at bench time; a missing
tokenizer is an error that says where we looked.

Cache busting: every prompt starts with a unique marker, so two prompts share no prefix beyond
the chat template's header. (A marker at the end, as some tools do, leaves the whole prefix
cacheable and lets a prefix cache inflate pp.)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import stat
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from vllmstack.core.errors import StackError
from vllmstack.core.files import path_kind
from vllmstack.workload.corpus import CORPUS_FILE

PARAGRAPH_SEPARATOR = "\n\n"
MAX_FIT_ROUNDS = 12


class TokenizerError(StackError, ValueError):
    """No usable tokenizer; the message lists where we looked and how to fix it."""


def load_corpus() -> list[str]:
    """The shipped corpus as paragraphs (original prose, varied topics, no downloads)."""
    text = resources.files("vllmstack.workload").joinpath("corpus", CORPUS_FILE).read_text("utf-8")
    return [p.strip() for p in text.split(PARAGRAPH_SEPARATOR) if p.strip()]


def hf_cache_dirs(environ: Mapping[str, str]) -> list[Path]:
    """Hugging Face hub cache folders in the order huggingface_hub itself uses them."""
    dirs: list[Path] = []
    if environ.get("HF_HUB_CACHE"):
        dirs.append(Path(environ["HF_HUB_CACHE"]))
    if environ.get("HF_HOME"):
        dirs.append(Path(environ["HF_HOME"]) / "hub")
    home = environ.get("HOME") or os.path.expanduser("~")
    if environ.get("XDG_CACHE_HOME"):
        dirs.append(Path(environ["XDG_CACHE_HOME"]) / "huggingface" / "hub")
    dirs.append(Path(home) / ".cache" / "huggingface" / "hub")
    unique: list[Path] = []
    for d in dirs:
        if d not in unique:
            unique.append(d)
    return unique


def _snapshot_tokenizer(repo_dir: Path) -> Path | None:
    """tokenizer.json of the snapshot refs/main points at, else of the newest snapshot."""
    snapshots = repo_dir / "snapshots"
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        candidate = snapshots / ref.read_text().strip() / "tokenizer.json"
        if candidate.is_file():
            return candidate
    if not snapshots.is_dir():
        return None
    found = [s / "tokenizer.json" for s in snapshots.iterdir() if (s / "tokenizer.json").is_file()]
    if not found:
        return None
    return max(found, key=lambda p: p.stat().st_mtime)


def resolve_tokenizer(spec: str, environ: Mapping[str, str], hf_home: str | None = None) -> Path:
    """Path of tokenizer.json for a file, a folder, or an HF id present in the local cache
    (`hf_home`: the stack's own HF cache, looked in first)."""
    if not spec:
        raise TokenizerError(
            "no tokenizer given; pass --tokenizer PATH (tokenizer.json, a model folder, or a "
            "Hugging Face id already in the local cache) or set VLLM_TOKENIZER in the profile"
        )
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return path / "tokenizer.json"
        raise TokenizerError(
            f"{path} is a folder without tokenizer.json; point --tokenizer at the model folder "
            "that has it (slow-tokenizer-only models need a tokenizer.json exported once)"
        )
    looked: list[str] = []
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        repo = "models--" + spec.replace("/", "--")
        first = [Path(hf_home) / "hub"] if hf_home else []
        for cache in [*first, *(d for d in hf_cache_dirs(environ) if d not in first)]:
            looked.append(str(cache / repo))
            found = _snapshot_tokenizer(cache / repo)
            if found is not None:
                return found
    where = "; looked in " + ", ".join(looked) if looked else ""
    raise TokenizerError(
        f"tokenizer {spec!r} not found on this machine{where}. Nothing is downloaded at bench "
        "time: pass --tokenizer with a local tokenizer.json or model folder, or fetch the model "
        "into the Hugging Face cache beforehand"
    )


MAX_TOKENIZER_BYTES = 512 * 2**20


def load_tokenizer(path: Path) -> Any:
    """A `tokenizers.Tokenizer` from tokenizer.json (the `bench` extra provides the package)."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise TokenizerError(
            "the 'tokenizers' package is missing; install the bench extra: pip install -e '.[bench]'"
        ) from exc
    # The Rust reader takes whatever the path gives, all of it: /dev/zero or a FIFO would fill
    # memory or block, so only a regular file of a tokenizer's size reaches it.
    try:
        info = path.stat()
    except OSError as exc:
        raise TokenizerError(f"{path} cannot be read ({exc.strerror or exc})") from exc
    if not stat.S_ISREG(info.st_mode):
        raise TokenizerError(f"{path} is {path_kind(info.st_mode)}, not a tokenizer.json file")
    if info.st_size > MAX_TOKENIZER_BYTES:
        raise TokenizerError(f"{path} is {info.st_size} bytes, more than a tokenizer.json holds "
                             f"(at most {MAX_TOKENIZER_BYTES // 2**20} MiB; the largest published "
                             "ones are about 30 MB)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception subclasses
        raise TokenizerError(f"{path} is not a usable tokenizer.json: {exc}") from exc


@dataclass
class Prompt:
    text: str
    tokens: int  # counted with the tokenizer, without special tokens or chat template
    marker: str


@dataclass
class PromptBuilder:
    """Exact-length prompts: unique marker first, then corpus text from a seeded position."""

    tokenizer: Any
    seed: int = 0
    paragraphs: list[str] = field(default_factory=load_corpus)
    _stream: list[int] = field(default_factory=list, init=False, repr=False)
    _paragraph_ids: list[list[int]] = field(default_factory=list, init=False, repr=False)
    _separator_ids: list[int] = field(default_factory=list, init=False, repr=False)
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        if not self.paragraphs:
            raise ValueError("the prompt corpus is empty")

    def count(self, text: str) -> int:
        return len(self._encode_ids(text))

    def _encode_ids(self, text: str) -> list[int]:
        # The batch call of `tokenizers` releases the GIL (its single call holds it: 1.6 s for a
        # million tokens), so a prompt built on another thread leaves the main thread free to
        # take a signal. A tokenizer without it (llama-server's /tokenize) encodes one text.
        if hasattr(self.tokenizer, "encode_batch"):
            return list(self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _decode(self, ids: list[int]) -> str:
        if hasattr(self.tokenizer, "decode_batch"):
            batch: list[str] = self.tokenizer.decode_batch([ids])
            return batch[0]
        text: str = self.tokenizer.decode(ids)
        return text

    def _ensure_stream(self, needed: int) -> None:
        """Grow the token stream by whole shuffled passes over the corpus until it is long enough."""
        if not self._paragraph_ids:
            self._paragraph_ids = [self._encode_ids(p) for p in self.paragraphs]
            self._separator_ids = self._encode_ids(PARAGRAPH_SEPARATOR)
        shuffle = random.Random(self.seed + 1)
        while len(self._stream) < needed:
            order = list(range(len(self._paragraph_ids)))
            # A fresh paragraph order per pass, so very long prompts do not repeat one fixed cycle.
            shuffle.seed(self.seed + 1 + len(self._stream))
            shuffle.shuffle(order)
            for index in order:
                self._stream.extend(self._paragraph_ids[index])
                self._stream.extend(self._separator_ids)

    def _body(self, start: int, length: int) -> str:
        if length <= 0:
            return ""
        self._ensure_stream(start + length)
        return self._decode(self._stream[start:start + length])

    def build(self, tokens: int, *, marker: str | None = None) -> Prompt:
        """A prompt of exactly `tokens` tokens (or the closest reachable, at worst ±1)."""
        if tokens < 1:
            raise ValueError(f"prompt length must be at least 1 token, got {tokens}")
        marker = marker or f"[{uuid.uuid4().hex[:12]}]"
        head = marker + " "
        head_tokens = self.count(head)
        if head_tokens >= tokens:
            # Too short for a marker: uniqueness cannot be had, so use corpus text only.
            head, head_tokens = "", 0
        span = max(1, len(self.paragraphs) * 64)
        start = self._rng.randrange(span)
        body_len = tokens - head_tokens
        best: tuple[int, str] | None = None
        seen: set[int] = set()
        for _ in range(MAX_FIT_ROUNDS):
            text = (head + self._body(start, body_len)).rstrip()
            got = self.count(text)
            if best is None or abs(got - tokens) < abs(best[0] - tokens):
                best = (got, text)
            if got == tokens:
                break
            # Decoding and re-encoding can merge or split tokens at the joins; correct and retry.
            if body_len in seen:
                start += 1  # a cycle: shift the window so different joins come up
            seen.add(body_len)
            body_len = max(0, body_len + (tokens - got))
        assert best is not None
        return Prompt(text=best[1], tokens=best[0], marker=marker)

    async def build_async(self, tokens: int, *, marker: str | None = None) -> Prompt:
        """`build` off the event loop: a long prompt is seconds of tokenizer work, during which
        the loop must stay free to take SIGTERM or Ctrl-C (issue 28: `--pp 100000000` could not
        be stopped). A daemon thread of its own, not the loop's executor: `asyncio.run` waits for
        the executor's threads at exit, which would hold a stopped run until the prompt was done.
        One build at a time per builder (its token stream is shared)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Prompt] = loop.create_future()

        def deliver(settle: Any, value: Any) -> None:
            def apply() -> None:
                if not done.done():  # cancelled by a stop meanwhile
                    settle(value)

            with contextlib.suppress(RuntimeError):  # the loop closed after a stop
                loop.call_soon_threadsafe(apply)

        def work() -> None:
            try:
                prompt = self.build(tokens, marker=marker)
            except BaseException as exc:  # handed to the awaiting task as it is
                deliver(done.set_exception, exc)
            else:
                deliver(done.set_result, prompt)

        threading.Thread(target=work, name="prompt-build", daemon=True).start()
        return await done

    def filler(self, tokens: int) -> str:
        """Corpus text of about `tokens` tokens without a marker (follow-up turns, long answers)."""
        start = self._rng.randrange(max(1, len(self.paragraphs) * 64))
        return self._body(start, tokens).strip()
