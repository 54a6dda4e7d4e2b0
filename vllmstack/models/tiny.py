"""A tiny random Qwen3 that a real vLLM engine serves on the CPU: `invoke make-model tiny`.

The folder is a complete Hugging Face model: config.json (Qwen3ForCausalLM at a small geometry),
model.safetensors (random bf16 weights, written here without torch or numpy), tokenizer.json (the
corpus BPE of `workload.selftest_tokenizer` plus Qwen's special tokens),
tokenizer_config.json with the chat template, and generation_config.json. It goes into the Hugging
Face cache as the repo `vllmstack/tiny-qwen3` (refs/main -> a snapshot named by the content's
hash), so the `tiny` profile names it like any hub model: both runtimes already see that cache (the
container mounts it), the profile holds no host path, and HF_HUB_OFFLINE=1 serves it without a
network. `--out` writes the same files into a plain folder instead (e.g. under MODELS_DIR).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import struct
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from vllmstack.config.profiles import Resolved
from vllmstack.core.errors import StackError
from vllmstack.core.files import file_head, writable_folder
from vllmstack.core.safetensors_file import Tensor, write_safetensors
from vllmstack.models.chat_template import CHAT_TEMPLATE
from vllmstack.runtime.engine_env import stack_paths
from vllmstack.workload.selftest_tokenizer import train_corpus_tokenizer

# Qwen's control tokens: <|endoftext|> comes from the corpus trainer (id 0); these are added.
# The chat markers are special (skipped when decoding); the thinking and tool markers are not,
# as in Qwen3, so vLLM's qwen3 reasoning parser and hermes tool parser find them in the text.
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")
MARKER_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                 "</tool_response>")
INIT_STD = 0.02  # the usual initializer range: logits stay small, so no NaN and no runaway token
# What the made model records about itself, beside its files: llama.cpp's name for its
# pre-tokenizer. The corpus BPE splits like GPT-2 (ByteLevel with GPT-2's regex: "gpt-2" in the
# pinned llama.cpp's src/llama-vocab.cpp), but llama.cpp's converter knows pre-tokenizers only by
# the hash of a test string's tokens and refuses this one; `invoke gguf-convert` reads the record
# and, while tokenizer.json is the one recorded (its sha256), names it without a warning.
MODEL_RECORD = "vllmstack-model.json"
GGUF_PRE_TOKENIZER = "gpt-2"


class ModelMakerError(StackError):
    """The model cannot be made as asked; `fix` says what to do."""


@dataclass(frozen=True)
class Geometry:
    repo: str  # the Hugging Face id it is cached under
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    max_position: int
    vocab_target: int  # what the BPE trainer is asked for (the corpus may give fewer)


PRESETS = {
    # ~2.2 M parameters: boots in about a minute on 2 cores, decodes hundreds of tokens a second.
    "tiny": Geometry("vllmstack/tiny-qwen3", hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64,
                     intermediate=768, max_position=8192, vocab_target=1200),
}


@dataclass
class MadeModel:
    preset: str
    repo: str
    folder: Path  # the files (a snapshot of the HF cache, or --out)
    vocab: int
    parameters: int
    bytes: int
    seconds: float
    made: bool  # False: the same model was already there

    def as_json(self) -> dict[str, object]:
        return {"preset": self.preset, "repo": self.repo, "folder": str(self.folder),
                "vocab": self.vocab, "parameters": self.parameters, "bytes": self.bytes,
                "seconds": round(self.seconds, 2), "made": self.made}


def hub_repo_folder(hf_cache: Path, repo: str) -> Path:
    """Where huggingface_hub keeps `repo`: HF_HOME/hub/models--ORG--NAME."""
    return hf_cache / "hub" / ("models--" + repo.replace("/", "--"))


def cached_snapshot(hf_cache: Path, repo: str) -> Path | None:
    """The snapshot refs/main points at, when it is complete (config.json and weights present)."""
    folder = hub_repo_folder(hf_cache, repo)
    try:
        revision = (folder / "refs" / "main").read_text().strip()
    except OSError:
        return None
    snapshot = folder / "snapshots" / revision
    if revision and (snapshot / "config.json").is_file() and (snapshot / "model.safetensors").is_file():
        return snapshot
    return None


# --- the files ----------------------------------------------------------------------------------

def model_config(geometry: Geometry, vocab: int, eos_id: int, pad_id: int) -> dict[str, object]:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab,
        "hidden_size": geometry.hidden, "intermediate_size": geometry.intermediate,
        "num_hidden_layers": geometry.layers, "num_attention_heads": geometry.heads,
        "num_key_value_heads": geometry.kv_heads, "head_dim": geometry.head_dim,
        "max_position_embeddings": geometry.max_position, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "initializer_range": INIT_STD, "use_sliding_window": False,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": None,
        "eos_token_id": eos_id, "pad_token_id": pad_id,
    }


def tensor_shapes(geometry: Geometry, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen3ForCausalLM's weights; lm_head is its own (untied), see `lm_head_tensor`."""
    g = geometry
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, g.hidden))]
    for i in range(g.layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (g.hidden,)),
            (p + "self_attn.q_proj.weight", (g.heads * g.head_dim, g.hidden)),
            (p + "self_attn.k_proj.weight", (g.kv_heads * g.head_dim, g.hidden)),
            (p + "self_attn.v_proj.weight", (g.kv_heads * g.head_dim, g.hidden)),
            (p + "self_attn.o_proj.weight", (g.hidden, g.heads * g.head_dim)),
            (p + "self_attn.q_norm.weight", (g.head_dim,)),
            (p + "self_attn.k_norm.weight", (g.head_dim,)),
            (p + "post_attention_layernorm.weight", (g.hidden,)),
            (p + "mlp.gate_proj.weight", (g.intermediate, g.hidden)),
            (p + "mlp.up_proj.weight", (g.intermediate, g.hidden)),
            (p + "mlp.down_proj.weight", (g.hidden, g.intermediate)),
        ]
    shapes += [("model.norm.weight", (g.hidden,)), ("lm_head.weight", (vocab, g.hidden))]
    return shapes


def bf16_bytes(values: array[float]) -> bytes:
    """float32 values as bfloat16 (the upper half of each float32), little-endian."""
    if sys.byteorder != "little":
        values = array("f", values)
        values.byteswap()
    raw = values.tobytes()
    out = bytearray(len(raw) // 2)
    out[0::2] = raw[2::4]
    out[1::2] = raw[3::4]
    return bytes(out)


def random_tensor(rng: random.Random, name: str, count: int) -> bytes:
    if name.endswith("norm.weight"):  # RMSNorm scales start at one, as a trained model's roughly do
        return b"\x80\x3f" * count
    return bf16_bytes(array("f", (rng.gauss(0.0, INIT_STD) for _ in range(count))))


# The safetensors format caps its JSON header at 100 MB (safetensors' MAX_HEADER_SIZE).
MAX_SAFETENSORS_HEADER = 100_000_000


def read_safetensors_header(path: Path) -> dict[str, dict[str, object]]:
    head = file_head(path, 8)  # a FIFO or a folder: PathKindError, never a blocking read
    if head is None or len(head) < 8:
        raise ModelMakerError(f"{path} is not a safetensors file (shorter than its 8-byte header length)",
                              "make the model again: invoke make-model --force")
    (size,) = struct.unpack("<Q", head)
    if size > MAX_SAFETENSORS_HEADER:
        raise ModelMakerError(f"{path} claims a {size}-byte header, more than safetensors allows "
                              f"({MAX_SAFETENSORS_HEADER})",
                              "make the model again: invoke make-model --force")
    with path.open("rb") as f:
        f.seek(8)
        header: dict[str, dict[str, object]] = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def build_tokenizer(path: Path, vocab_target: int) -> tuple[int, dict[str, int], list[int]]:
    """The corpus BPE plus Qwen's control tokens.

    Returns the vocabulary size, the ids of the control tokens, and the "quiet" ids that the
    output head never picks (see `lm_head_tensor`).
    """
    try:
        from tokenizers import AddedToken, Tokenizer
    except ImportError as exc:
        raise ModelMakerError("the `tokenizers` package is not installed",
                              "pip install -e '.[bench]' (or '.[dev]')") from exc
    train_corpus_tokenizer(path, vocab_size=vocab_target)
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    tokenizer.save(str(path))
    ids = {}
    for token in ("<|endoftext|>", *SPECIAL_TOKENS, *MARKER_TOKENS):
        found = tokenizer.token_to_id(token)
        if found is None or tokenizer.encode(token).ids != [found]:
            raise ModelMakerError(f"the made tokenizer does not keep {token} as one token",
                                  "report this: the tokenizers package may have changed")
        ids[token] = found
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    quiet = sorted(set(ids.values()) | {
        i for i in range(vocab)
        if not (text := tokenizer.decode([i], skip_special_tokens=False)).strip() or "\ufffd" in text})
    return vocab, ids, quiet


def lm_head_tensor(rng: random.Random, vocab: int, hidden: int, quiet: list[int]) -> bytes:
    """The output head: random rows, and zero rows for the quiet tokens.

    A random model decodes greedily into one token over and over; when that token is a newline
    the answer is blank, and a control token (<|im_end|>, <think>, <tool_call>) would end the
    answer or send it to the reasoning or tool parser. A zero row scores 0 while the best of the
    random rows scores above it, so greedy output is always visible text, of the length asked.
    """
    zero = set(quiet)
    values = array("f")
    for token in range(vocab):
        if token in zero:
            values.extend([0.0] * hidden)
        else:
            values.extend(rng.gauss(0.0, INIT_STD) for _ in range(hidden))
    return bf16_bytes(values)


def write_model_files(folder: Path, geometry: Geometry, *, seed: int = 0) -> tuple[int, int, int]:
    """Every file of the model into `folder`; returns (vocab, parameters, bytes written)."""
    vocab, ids, quiet = build_tokenizer(folder / "tokenizer.json", geometry.vocab_target)
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    files = {
        "config.json": model_config(geometry, vocab, eos, pad),
        "generation_config.json": {"eos_token_id": [eos, pad], "pad_token_id": pad,
                                   "bos_token_id": None},
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None,
            "model_max_length": geometry.max_position, "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE},
        # The tokenizer's digest binds the pre-tokenizer name to this very tokenizer:
        # gguf-convert applies it without a warning only while tokenizer.json is unchanged.
        MODEL_RECORD: {"made_by": "invoke make-model", "repo": geometry.repo,
                       "gguf_pre_tokenizer": GGUF_PRE_TOKENIZER,
                       "tokenizer_sha256": file_sha256(folder / "tokenizer.json")},
    }
    for name, data in files.items():
        (folder / name).write_text(json.dumps(data, indent=1) + "\n")
    rng = random.Random(seed)
    tensors = []
    parameters = 0
    for name, shape in tensor_shapes(geometry, vocab):
        count = _count(shape)
        parameters += count
        data = (lm_head_tensor(rng, vocab, geometry.hidden, quiet) if name == "lm_head.weight"
                else random_tensor(rng, name, count))
        tensors.append(Tensor(name, "BF16", shape, data))
    written = write_safetensors(folder / "model.safetensors", tensors)
    return vocab, parameters, written + sum((folder / n).stat().st_size for n in files)


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def content_hash(folder: Path) -> str:
    digest = hashlib.sha1()
    for path in sorted(folder.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def make_model(preset: str, *, hf_cache: Path | None = None, out: Path | None = None,
               force: bool = False, seed: int = 0, repo: str | None = None,
               post: Callable[[Path], None] | None = None) -> MadeModel:
    """Write the preset's model into the HF cache (or `out`); an existing one is kept unless `force`."""
    geometry = PRESETS.get(preset)
    if geometry is None:
        raise ModelMakerError(f"unknown model preset {preset!r}", f"use one of: {', '.join(PRESETS)}")
    if (hf_cache is None) == (out is None):
        raise ModelMakerError("give either the Hugging Face cache or an output folder", None)
    if out is not None:
        out = checked_out(out)
    started = time.monotonic()
    # `repo` and `post` make a variant (make-model --trained: trains the files in `post`, before
    # they are hashed into a snapshot or renamed into place).
    repo = repo or geometry.repo
    existing = cached_snapshot(hf_cache, repo) if hf_cache is not None else (
        out if out is not None and (out / "model.safetensors").is_file() else None)
    if existing is not None and not force:
        config = json.loads((existing / "config.json").read_text())
        size = sum(p.stat().st_size for p in existing.iterdir())
        params = sum(_count(s) for _, s in tensor_shapes(geometry, int(config["vocab_size"])))
        return MadeModel(preset, repo, existing, int(config["vocab_size"]), params, size,
                         time.monotonic() - started, made=False)
    parent = hub_repo_folder(hf_cache, repo) if hf_cache is not None else out.parent  # type: ignore[union-attr]
    parent.mkdir(parents=True, exist_ok=True)
    # Built beside its destination and renamed into place, so a reader never sees half a model.
    staging = Path(tempfile.mkdtemp(prefix=".making-", dir=parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide the model from a container running as another user
    try:
        vocab, parameters, size = write_model_files(staging, geometry, seed=seed)
        if post is not None:
            post(staging)
        if hf_cache is not None:
            revision = content_hash(staging)
            target = parent / "snapshots" / revision
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
            refs = parent / "refs"
            refs.mkdir(exist_ok=True)
            (refs / "main.tmp").write_text(revision)
            (refs / "main.tmp").replace(refs / "main")
        else:
            assert out is not None
            target = out
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return MadeModel(preset, repo, target, vocab, parameters, size,
                     time.monotonic() - started, made=True)


def checked_out(out: Path) -> Path:
    """`--out` as a folder the model may be written into (absolute). Refused: what
    writable_folder refuses (PathKindError: a file, a device, a path under a file or in /proc),
    and a folder that holds files make-model did not write (ModelMakerError), which making the
    model there would delete."""
    out = writable_folder(out, "--out")
    if out.is_dir() and not any((out / name).is_file() for name in (MODEL_RECORD, "model.safetensors")):
        try:
            held = next(out.iterdir(), None)
        except OSError as exc:
            raise ModelMakerError(f"--out {out} cannot be read ({exc.strerror or exc})",
                                  "name another folder for --out") from None
        if held is not None:
            raise ModelMakerError(
                f"--out {out} is a folder that holds files make-model did not write (e.g. "
                f"{held.name}); it is left as it is",
                f"name a new or empty folder for the model, e.g. --out {out / 'tiny-qwen3'}")
    return out


def make_for_stack(resolved: Resolved, environ: Mapping[str, str], preset: str, *,
                   out: Path | None = None, force: bool = False) -> MadeModel:
    """`invoke make-model`: into the stack's Hugging Face cache (HF_CACHE_DIR), or into `out`."""
    hf_cache = None if out is not None else stack_paths(resolved, environ).hf_cache
    return make_model(preset, hf_cache=hf_cache, out=out, force=force)


def _count(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def render_made(model: MadeModel) -> str:
    verb = "made" if model.made else "already there (use --force to make it again):"
    return "\n".join([
        f"{verb} {model.repo} ({model.preset}): {model.parameters / 1e6:.1f} M parameters, vocab "
        f"{model.vocab}, {model.bytes / 2**20:.1f} MiB"
        + (f" in {model.seconds:.1f} s" if model.made else ""),
        f"  files: {model.folder}",
        # The native runtime: the container runtime's image (`invoke build --platform cpu`) is
        # not there on a fresh machine, and its build is not the quick start.
        "serve it: invoke up --runtime native --platform cpu --model tiny "
        "(vLLM's CPU build first: invoke install-engine --platform cpu)"])
