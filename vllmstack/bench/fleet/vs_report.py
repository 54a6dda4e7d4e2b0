"""What `bench-vs` compares and how its table reads: the checkpoint each target loads, its
speculative draft, which kind of pair two rows are, and the markdown it writes.

A pair is "identical weights" only when both targets load the same checkpoint unquantized: the
vLLM profile's VLLM_MODEL (no MODEL_QUANT) and a GGUF whose recorded source is that checkpoint and
whose tensors are F32/F16/BF16. A GGUF names its source in its metadata (`general.source.url`,
`general.source.repo_url`) or in a sidecar `<file>.gguf.json` with {"source": ...} that
`invoke gguf-convert` writes; the source may be a folder, a Hugging Face id or a snapshot folder of
the HF cache (`models--ORG--NAME`), all compared as the same id. Anything else is "different
quantization/checkpoint": the table then compares quantizations as much as kernels.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import LlamaFileType

from vllmstack.bench.client.row import BenchRow, Stat, mean_of
from vllmstack.bench.fleet.resident import append_text, md_table, one_line, stamp, vram_text
from vllmstack.checks.gguf_header import GgufError, open_header
from vllmstack.checks.gguf_header import shown as quoted
from vllmstack.config.engines.table import display_name, engine_kind
from vllmstack.config.profiles import Resolved
from vllmstack.runtime.engine_env import stack_paths

IDENTICAL = "identical weights"
DIFFERENT = "different quantization/checkpoint"
HISTORY_MD = "bench-vs-history.md"
RESULTS_MD = "bench-vs-results.md"
SIDECAR_SUFFIX = ".json"  # tiny-qwen3-f16.gguf -> tiny-qwen3-f16.gguf.json
# GGUF file types that hold the checkpoint's weights without quantizing them.
LOSSLESS_GGUF = {"ALL_F32", "MOSTLY_F16", "MOSTLY_BF16"}
HF_URL = re.compile(r"^https?://(?:www\.)?huggingface\.co/([^/\s]+/[^/\s]+)")
HF_SNAPSHOT = re.compile(r"models--([^/]+?)--([^/]+)")
HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")



def header(concurrency: Any) -> list[str]:
    return ["engine · checkpoint", "spec draft", "decode t/s", "prefill t/s", "TTFT ms",
            "decode @ctx t/s", f"{concurrency}-stream t/s", "VRAM used", "load time", "pair"]


@dataclass
class Checkpoint:
    label: str  # what the table shows
    ids: set[str] = field(default_factory=set)  # canonical source ids, for pairing
    lossless: bool = True  # weights as the checkpoint has them (no quantization on the way)
    notes: list[str] = field(default_factory=list)

    def as_record(self) -> dict[str, Any]:
        return {"label": self.label, "ids": sorted(self.ids), "lossless": self.lossless,
                "notes": self.notes}


def canonical_ids(spec: str) -> set[str]:
    """Every name `spec` (a folder, an HF id, an HF URL, an HF cache snapshot) is known by."""
    spec = spec.strip()
    if not spec:
        return set()
    out: set[str] = set()
    match = HF_URL.match(spec)
    if match:
        return {match.group(1).lower()}
    snapshot = HF_SNAPSHOT.search(spec)
    if snapshot:
        out.add(f"{snapshot.group(1)}/{snapshot.group(2)}".lower())
    path = Path(spec).expanduser()
    if path.is_absolute() or path.exists():
        out.add(str(path.resolve()))
    elif HF_ID.match(spec):
        out.add(spec.lower())
    return out


def gguf_path(resolved: Resolved, environ: Mapping[str, str]) -> Path | None:
    raw = resolved.get_raw("LLAMACPP_MODEL")
    if not raw:
        return None
    path = Path(raw).expanduser()
    models = stack_paths(resolved, environ).models_dir
    return path if path.is_absolute() or models is None else models / path


def read_gguf_source(path: Path) -> tuple[str | None, list[str], list[str]]:
    """(file type name, source specs, notes) from the GGUF header and its sidecar."""
    notes: list[str] = []
    sources: list[str] = []
    file_type: str | None = None
    sidecar = path.with_name(path.name + SIDECAR_SUFFIX)
    if sidecar.is_file():
        try:
            data = json.loads(sidecar.read_text())
            if isinstance(data, dict) and isinstance(data.get("source"), str):
                sources.append(data["source"])
        except (OSError, ValueError) as exc:
            notes.append(f"{sidecar.name} unreadable: {exc}")
    try:
        # The bounded reader of the llama.cpp checks: a hostile LLAMACPP_MODEL (a count of 2^62,
        # a FIFO) is a named error here too, never a MemoryError or a hang.
        with open_header(path) as header:
            for key in ("general.source.url", "general.source.repo_url"):
                found = header.string(key)
                if found is not None:
                    sources.append(found)
            kind = header.count("general.file_type")
        if kind is not None:
            try:
                file_type = LlamaFileType(kind).name
            except ValueError:
                file_type = f"file type {kind}"
    except GgufError as exc:
        notes.append(f"{quoted(path.name)}: header not readable ({quoted(exc.cause, 300)})")
    return file_type, sources, notes


def checkpoint_of(resolved: Resolved, environ: Mapping[str, str]) -> Checkpoint:
    if not engine_kind(resolved).model_file:
        model = resolved.get_str("VLLM_MODEL")
        quant = resolved.get_raw("MODEL_QUANT")
        label = model + (f" ({quant})" if quant else "")
        return Checkpoint(label, canonical_ids(model), lossless=not quant)
    path = gguf_path(resolved, environ)
    if path is None:
        return Checkpoint("(no LLAMACPP_MODEL)", lossless=False)
    if not path.is_file():
        return Checkpoint(path.name, lossless=False, notes=[f"{path} not found"])
    file_type, sources, notes = read_gguf_source(path)
    ids: set[str] = set()
    for source in sources:
        ids |= canonical_ids(source)
    shown = file_type.removeprefix("MOSTLY_").removeprefix("ALL_") if file_type else "?"
    return Checkpoint(f"{path.name} ({shown})", ids, lossless=file_type in LOSSLESS_GGUF,
                      notes=notes)


def spec_draft(resolved: Resolved) -> str:
    """The speculative draft a profile runs with, as the table shows it ("-": none)."""
    return one_line(engine_kind(resolved).draft_label(resolved), 60)


def assign_pairs(rows: list[dict[str, Any]]) -> None:
    """Each row's pair kind against the other rows (one row alone: "-")."""
    for row in rows:
        if len(rows) < 2:
            row["pair_kind"] = "-"
            continue
        mine = row.get("checkpoint") or {}
        same = any(
            other is not row and set(mine.get("ids") or ()) & set(other_cp.get("ids") or ())
            and mine.get("lossless") and other_cp.get("lossless")
            for other in rows for other_cp in [other.get("checkpoint") or {}])
        row["pair_kind"] = IDENTICAL if same else DIFFERENT


# --- markdown -------------------------------------------------------------------------------------


def _mean(stat: Stat | None, fmt: str) -> str | None:
    value = mean_of(stat)
    return None if value is None else format(value, fmt)


def _with_server(ours: str | None, timings: Any, key: str) -> str:
    """The stack's number, with llama.cpp's own in parentheses when it sent one."""
    text = ours or "-"
    if isinstance(timings, dict) and isinstance(timings.get(key), int | float):
        text += f" ({timings[key]:.1f})"
    return text


def _prefill(row: BenchRow | None) -> str:
    """pp t/s ± its uncertainty (the bench's estimate), or why there is none."""
    if row is None:
        return "-"
    mean = mean_of(row.pp_tps)
    if row.pp_tps is not None and mean is not None:
        std = row.pp_tps.std or 0.0
        if mean >= 10000:  # one unit for both, so the spread reads against the number
            return f"{mean / 1000:.1f}k ± " + (f"{std / 1000:.1f}k" if std >= 1000 else f"{std:.0f}")
        return f"{mean:.0f} ± {std:.0f}"
    return row.pp_note or "-"


def shape_row(row: Mapping[str, Any], key: str) -> BenchRow | None:
    """A target's measured shape ("single", "ctx", "conc") as a BenchRow; None when it was not
    measured (the target failed first)."""
    data = row.get(key)
    if not data:
        return None
    return BenchRow.from_json(data, f"bench-vs row {row.get('target')}, key {key!r}")


def table_row(row: Mapping[str, Any]) -> list[str]:
    checkpoint = row.get("checkpoint") or {}
    first = f"{display_name(str(row.get('engine')))} · {one_line(checkpoint.get('label', '?'), 80)}"
    load = row.get("load_s")
    load_text = f"{load:.1f} s ({row.get('load_kind')})" if isinstance(load, int | float) else "-"
    if row.get("status") not in ("ok", "partial"):
        why = one_line(row.get("diagnosis") or "failed", 200)
        state = "not run" if row.get("status") == "skipped" else "FAILED"
        return [first, str(row.get("spec_draft", "-")), f"{state}: {why}", "-", "-", "-", "-",
                vram_text(row.get("vram")) if row.get("vram") else "-", load_text,
                str(row.get("pair_kind", "-"))]
    single = shape_row(row, "single")
    ctx = shape_row(row, "ctx")
    conc = shape_row(row, "conc")
    timings = row.get("timings") or {}
    prefill_row = ctx if ctx is not None else single
    prefill_timings = timings.get("ctx") if ctx is not None else timings.get("single")
    total = conc.total_tg_tps if conc is not None else None
    return [
        first,
        str(row.get("spec_draft", "-")),
        _with_server(_mean(single.tg_tps, ".1f") if single else None, timings.get("single"),
                     "predicted_per_second"),
        _with_server(_prefill(prefill_row), prefill_timings, "prompt_per_second"),
        (_mean(single.ttft_ms, ".1f") if single else None) or "-",
        (_with_server(_mean(ctx.tg_tps, ".1f"), timings.get("ctx"), "predicted_per_second")
         + f" @{row.get('ctx_tokens')}") if ctx is not None else "-",
        f"{total:.1f}" if total is not None else "-",
        vram_text(row.get("vram")),
        load_text,
        str(row.get("pair_kind", "-")),
    ]


def render(record: Mapping[str, Any]) -> str:
    """One run as a markdown section: settings, the table, what each row noted."""
    opts = record.get("options") or {}
    rows: Sequence[Mapping[str, Any]] = record.get("rows") or []
    head = (f"## {stamp(record.get('started'))} · {record.get('platform')} · "
            f"{', '.join(str(r.get('target')) for r in rows)}\n\n"
            f"ctx {opts.get('ctx')}, concurrency {opts.get('concurrency')}, thinking "
            f"{'on' if opts.get('think') else 'off'}, pp {opts.get('pp')} / tg {opts.get('tg')}, "
            f"{opts.get('runs')} runs per shape (after a warm-up), N-stream for "
            f"{opts.get('duration_s')} s; runtime {_runtimes(rows, record)}.\n"
            "decode/prefill/TTFT: `invoke bench`'s definitions (tokens from usage); prefill is "
            "measured on the @ctx prompt; (numbers): llama.cpp's own `timings`; VRAM is read "
            "from the GPU while measuring (peak minus the use before `up`); load time is `up`'s "
            "boot (cold: compile caches empty or filled by this start).\n")
    table = md_table(header(opts.get("concurrency")), [table_row(r) for r in rows])
    notes = []
    for row in rows:
        lines = [*(row.get("notes") or []), *(row.get("warnings") or []),
                 *((row.get("checkpoint") or {}).get("notes") or [])]
        if row.get("status") == "partial" and row.get("diagnosis"):
            lines.insert(0, f"numbers from the requests that answered; {row['diagnosis']}")
        if row.get("status") != "ok" and row.get("fix"):
            lines.append(f"fix: {row['fix']}")
        notes += [f"* {row.get('target')}: {one_line(line, 400)}" for line in lines]
    return head + "\n" + table + "\n" + ("\n" + "\n".join(notes) + "\n" if notes else "")


def _runtimes(rows: Sequence[Mapping[str, Any]], record: Mapping[str, Any]) -> str:
    used = sorted({str(r["runtime"]) for r in rows if r.get("runtime")})
    return ", ".join(used) or str(record.get("runtime") or "-")


def write_markdown(folder: Path, record: Mapping[str, Any]) -> list[Path]:
    """Append the run to bench-vs-history.md and make it the whole of bench-vs-results.md."""
    section = render(record)
    history_md = folder / HISTORY_MD
    if not history_md.exists():
        append_text(history_md, "# bench-vs history\n\nvLLM vs llama.cpp, one engine resident at "
                    "a time (`invoke bench-vs`); newest last.\n\n")
    append_text(history_md, section + "\n")
    results = folder / RESULTS_MD
    folder.mkdir(parents=True, exist_ok=True)
    results.write_text("# bench-vs: latest results\n\n" + section, encoding="utf-8")
    return [history_md, results]
