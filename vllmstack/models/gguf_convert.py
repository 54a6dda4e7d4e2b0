"""`invoke gguf-convert MODEL_DIR`: a Hugging Face checkpoint to GGUF with llama.cpp's own converter.

The converter is `convert_hf_to_gguf.py` of the pinned llama.cpp source (with patches/llamacpp
applied; vllmstack.image.llamacpp_source), its `gguf` package from the same tree, so the file is
exactly what that llama-server reads. It needs torch, transformers and numpy, which the stack's
own Python need not have: it runs with `--python`, else the first engine environment that has
them (.cache/engines/vllm-*+cpu first, then other vllm-* ones), else this Python.

`gguf_convert_runner.py` (shipped beside this module) wraps the converter for `--pre-tokenizer`:
a tokenizer whose pre-tokenizer hash the converter does not know is written under that name
instead of refused. A model made by `invoke make-model` records its name, so it needs no flag.
The output goes to MODELS_DIR/<name>-<outtype>.gguf (without MODELS_DIR: ~/.cache/vllmstack-models,
where llama.cpp profiles look too) unless `out` says otherwise; it is written
beside its destination and renamed into place, then read back with the `gguf` package.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllmstack.config.llamacpp_args import default_models_dir
from vllmstack.config.profiles import Resolved
from vllmstack.core.errors import StackError
from vllmstack.core.files import writable_file, write_json
from vllmstack.core.paths import Project, home_dir
from vllmstack.core.runner import Runner
from vllmstack.image.llamacpp_source import prepare_source
from vllmstack.models.tiny import GGUF_PRE_TOKENIZER, MODEL_RECORD, PRESETS, cached_snapshot
from vllmstack.runtime.engine_env import stack_paths

OUTTYPES = ("f16", "bf16", "q8_0", "f32")
RUNNER = Path(__file__).with_name("gguf_convert_runner.py")
# What the converter imports from the Python that runs it (module -> pip package).
NEEDED = {"torch": "torch", "transformers": "transformers", "numpy": "numpy", "yaml": "pyyaml"}
FIND_SCRIPT = ("import importlib.util, json, sys; print(json.dumps([m for m in sys.argv[1:] "
               "if importlib.util.find_spec(m) is None]))")
UNRECOGNIZED = "BPE pre-tokenizer was not recognized"


class ConvertError(StackError):
    """The checkpoint cannot be converted as asked; `fix` says what to do."""


@dataclass
class Converted:
    path: Path
    source: Path  # the checkpoint folder
    outtype: str
    python: str
    pre_tokenizer: str  # what was asked for ("" = the converter's own detection)
    seconds: float
    header: dict[str, Any] = field(default_factory=dict)
    made: bool = True  # False: the same conversion was already there (see `converted_before`)

    def as_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "source": str(self.source), "outtype": self.outtype,
                "python": self.python, "pre_tokenizer": self.pre_tokenizer,
                "seconds": round(self.seconds, 1), "header": self.header, "made": self.made}


def resolve_model(resolved: Resolved, environ: Mapping[str, str], model: str) -> tuple[Path, str]:
    """(checkpoint folder, the name its GGUF gets): a folder, a preset of `invoke make-model`
    (tiny), or a Hugging Face id in the stack's cache (vllmstack/tiny-qwen3)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConvertError(f"{path} has no config.json, so it is not a Hugging Face checkpoint",
                               "give the folder that holds config.json, the *.safetensors and the "
                               "tokenizer files")
        return path.resolve(), path.resolve().name
    repo = PRESETS[model].repo if model in PRESETS else model
    if re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
        snapshot = cached_snapshot(stack_paths(resolved, environ).hf_cache, repo)
        if snapshot is not None:
            return snapshot, repo.split("/")[-1]
    raise ConvertError(f"{model} is neither a checkpoint folder nor a model in the stack's "
                       "Hugging Face cache",
                       "give a folder with config.json, or make one first: invoke make-model tiny")


def record_pre_tokenizer(folder: Path) -> str:
    """The pre-tokenizer a made model records (tiny.MODEL_RECORD), else ""."""
    try:
        data = json.loads((folder / MODEL_RECORD).read_text())
    except (OSError, ValueError):
        return ""
    return str(data.get("gguf_pre_tokenizer") or "") if isinstance(data, dict) else ""


def converted_before(target: Path, folder: Path, outtype: str, ref: str) -> bool:
    """Whether `target` is this very conversion: its sidecar names the same checkpoint, outtype
    and converter, and no file of the checkpoint changed after it was written."""
    try:
        sidecar = json.loads(target.with_name(target.name + ".json").read_text())
        written = target.stat().st_mtime
        changed = max((f.stat().st_mtime for f in folder.iterdir() if f.is_file()), default=0.0)
    except (OSError, ValueError):
        return False
    return (isinstance(sidecar, dict) and sidecar.get("source") == str(folder.resolve())
            and sidecar.get("outtype") == outtype and sidecar.get("converter") == f"llama.cpp {ref}"
            and changed <= written)


def record_is_current(folder: Path) -> bool:
    """Whether a made model's record still describes its tokenizer (tokenizer.json has the
    digest recorded): then its pre-tokenizer name is the stack's own fact, applied quietly."""
    try:
        data = json.loads((folder / MODEL_RECORD).read_text())
        digest = hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("tokenizer_sha256") == digest


def known_pre_tokenizers(tree: Path) -> list[str]:
    """The pre-tokenizer names the pinned llama.cpp implements (its src/llama-vocab.cpp)."""
    try:
        text = (tree / "src" / "llama-vocab.cpp").read_text(errors="replace")
    except OSError:
        return []
    return sorted(set(re.findall(r'tokenizer_pre\s*==\s*"([^"]+)"', text)))


def candidate_pythons(project: Project) -> list[str]:
    """Where torch and transformers may be: the CPU engine environments, other engine
    environments, then this Python."""
    engines = project.cache / "engines"
    found = sorted(engines.glob("vllm-*+cpu/bin/python"), reverse=True)
    found += [p for p in sorted(engines.glob("vllm-*/bin/python"), reverse=True) if p not in found]
    return [*(str(p) for p in found), sys.executable]


def missing_modules(runner: Runner, python: str, environ: Mapping[str, str]) -> list[str] | None:
    """The NEEDED modules `python` lacks, or None when it does not run."""
    result = runner.run([python, "-c", FIND_SCRIPT, *NEEDED], mutates=False, timeout=120,
                        env={**environ, "PYTHONNOUSERSITE": "1"})
    try:
        missing = json.loads(result.stdout) if result.ok else None
    except ValueError:
        return None
    return [str(m) for m in missing] if isinstance(missing, list) else None


def pick_python(project: Project, runner: Runner, python: str | None,
                environ: Mapping[str, str]) -> str:
    """`python` when given (it must have NEEDED), else the first candidate that has them."""
    tried: list[str] = []
    for candidate in [python] if python else candidate_pythons(project):
        missing = missing_modules(runner, candidate, environ)
        if missing == []:
            return candidate
        tried.append(f"{candidate}: " + ("does not run" if missing is None else
                                         f"no {', '.join(missing)}"))
    packages = " ".join(NEEDED.values())
    raise ConvertError("no Python with what llama.cpp's converter needs (torch, transformers, "
                       f"numpy, pyyaml): {'; '.join(tried)}",
                       f"pass --python with one that has them, install them (pip install "
                       f"{packages}), or install the CPU engine: invoke install-engine --platform cpu")


def read_header(path: Path) -> dict[str, Any]:
    """What the file says about itself, read with the `gguf` package (empty when it is missing)."""
    try:
        import gguf
    except ImportError:
        return {}
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, OSError) as exc:
        raise ConvertError(f"{path} does not read back as GGUF ({type(exc).__name__}: {exc})",
                           "convert again with --force; if it repeats, the converter is at fault: "
                           "read its output") from exc

    def value(key: str) -> Any:
        found = reader.fields.get(key)
        return found.contents() if found is not None else None

    file_type = value("general.file_type")
    try:
        type_name = gguf.LlamaFileType(int(file_type)).name if file_type is not None else None
    except ValueError:
        type_name = None
    arch = value("general.architecture")
    return {"architecture": arch, "tensors": len(reader.tensors), "file_type": file_type,
            "file_type_name": type_name, "pre_tokenizer": value("tokenizer.ggml.pre"),
            "context_length": value(f"{arch}.context_length") if arch else None,
            "bytes": path.stat().st_size}


def output_path(resolved: Resolved, environ: Mapping[str, str], name: str, outtype: str,
                out: Path | None) -> Path:
    """`out`, else MODELS_DIR/<name>-<outtype>.gguf, else the same name in the default models
    folder, where a llama.cpp profile's relative LLAMACPP_MODEL is read from too
    (llamacpp_args.default_models_dir). Refused before anything runs: a folder as `out` (the
    converter would fill a .partial beside it for minutes, then fail), or a parent that is a
    file."""
    if out is None:
        models_dir = (stack_paths(resolved, environ).models_dir
                      or default_models_dir(resolved, home_dir(environ)))
        return models_dir / f"{name}-{outtype}.gguf"
    target = out.expanduser()
    if target.is_dir():
        raise ConvertError(f"--out {out} is a folder; it names the .gguf file to write",
                           f"pass a file name: --out {target / f'{name}-{outtype}.gguf'}")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConvertError(f"--out {out}: {parent} is a file, not a folder, so nothing "
                                   "can be written below it", "pass --out a path in a folder")
            break
    writable_file(target, "--out")  # a FIFO or device there, a folder in /dev or /proc
    return target


def gguf_convert(project: Project, resolved: Resolved, runner: Runner, *, model: str,
                 environ: Mapping[str, str], outtype: str = "f16", out: Path | None = None,
                 pre_tokenizer: str | None = None, python: str | None = None,
                 force: bool = False, stream: bool = True,
                 say: Callable[[str], None] = print) -> Converted:
    """Convert `model` (see resolve_model) to GGUF with the pinned converter."""
    if outtype not in OUTTYPES:
        raise ConvertError(f"--outtype {outtype!r} is not one of {', '.join(OUTTYPES)}",
                           "f16 keeps the weights as they are for a bf16/f16 checkpoint; q8_0 "
                           "halves them")
    folder, name = resolve_model(resolved, environ, model)
    target = output_path(resolved, environ, name, outtype, out)
    ref = resolved.get_str("LLAMACPP_REF")
    if target.exists() and not force:
        if converted_before(target, folder, outtype, ref):  # as `make-model` is, a second run is a no-op
            return Converted(target, folder, outtype, "", "", 0.0, read_header(target), made=False)
        raise ConvertError(f"{target} already exists (not converted from {folder} as {outtype} "
                           f"by llama.cpp {ref})", "pass --force to convert again, or --out "
                           "another path")
    tree = prepare_source(project, runner, ref, environ=environ, say=say).folder
    asked = pre_tokenizer if pre_tokenizer is not None else record_pre_tokenizer(folder)
    # The stack's own model: its split is known (tests hold llama-server to its tokenizer.json),
    # so the converter's "not recognized" box would only alarm (issue 23).
    quiet = pre_tokenizer is None and bool(asked) and record_is_current(folder)
    known = known_pre_tokenizers(tree)
    if asked and known and asked not in known:
        raise ConvertError(f"--pre-tokenizer {asked!r} is not a pre-tokenizer llama.cpp {ref} "
                           "implements", f"use one of its names: {', '.join(known)}")
    interpreter = pick_python(project, runner, python, environ)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    partial.unlink(missing_ok=True)
    argv = [interpreter, str(RUNNER), "--source", str(tree),
            *(["--pre-tokenizer", asked] if asked else []), *(["--quiet"] if quiet else []), "--",
            str(folder), "--outfile", str(partial), "--outtype", outtype]
    say(f"converting {folder} to {target} ({outtype}) with llama.cpp {ref}'s converter"
        + (f", pre-tokenizer {asked} (the made model's)" if quiet else
           f", pre-tokenizer {asked} if its hash is unknown" if asked else ""))
    started = time.monotonic()
    try:
        result = runner.run(argv, capture=not stream, env={**environ, "PYTHONNOUSERSITE": "1"})
    except BaseException:  # Ctrl-C mid-way: a half-written file the size of the model stays not
        partial.unlink(missing_ok=True)
        raise
    if not result.ok:
        partial.unlink(missing_ok=True)
        said = (result.stderr or result.stdout).strip()
        unknown = UNRECOGNIZED in said or stream
        raise ConvertError(
            f"llama.cpp's converter failed (exit {result.returncode})"
            + (f":\n{said[-1500:]}" if said else "; its output is above"),
            (f"if it says '{UNRECOGNIZED}', name the pre-tokenizer: --pre-tokenizer NAME (a "
             f"ByteLevel BPE with GPT-2's split is {GGUF_PRE_TOKENIZER}; llama.cpp {ref} knows: "
             f"{', '.join(known) or '?'})") if unknown and not asked else
            "read the converter's error above; --python picks another environment")
    if not partial.is_file():
        raise ConvertError(f"the converter ended without writing {partial}",
                           "read its output above")
    partial.replace(target)
    # Where the weights came from, for `bench-vs` to tell a pair of identical weights (the GGUF
    # header keeps only the model's name).
    write_json(target.with_name(target.name + ".json"),
               {"source": str(folder.resolve()), "outtype": outtype, "converter": f"llama.cpp {ref}"})
    return Converted(target, folder, outtype, interpreter, asked, time.monotonic() - started,
                     read_header(target))


def render_converted(done: Converted) -> str:
    head = done.header
    if not done.made:
        return (f"already converted: {done.path} from {done.source} ({done.outtype}); "
                "--force converts again")
    facts = ", ".join(f"{k} {head[k]}" for k in ("architecture", "tensors", "file_type_name",
                                                   "pre_tokenizer", "context_length")
                      if head.get(k) is not None)
    return "\n".join([f"wrote {done.path} ({done.path.stat().st_size / 2**20:.1f} MiB) in "
                      f"{done.seconds:.1f} s", f"  from {done.source}",
                      f"  GGUF: {facts or 'not read (the gguf package is not installed)'}",
                      f"  python: {done.python}"])
