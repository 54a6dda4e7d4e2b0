"""Diagnosis and the boot progress line against real vLLM 0.27.1 logs from 2x H200 (native runtime).

Fixtures (tests/data/), all real engine output:
* fail-tp2-mtp-flashattention.log: Qwen3.6-27B-like hybrid, TP=2, MTP-2, the draft model on
  FlashAttention without its kernels (shared/gpu/runs-2026-11-30/raw-engine-log-...); the TP
  workers' tracebacks interleave, some lines carry two process prefixes, some none.
* fail-tp2-gdn-flashinfer.log: the same model without `--gdn-prefill-backend triton` and without
  flashinfer (device run of 2026-11-30); lines 1-106 and 1880-2323 of the 2,323-line log (the
  middle repeats the per-layer warm-up warning traceback another 90 times).
* boot-tp2-hybrid-eager.log: the healthy boot that followed, with the GDN flag.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from vllmstack.serve import diagnosis, watch

DATA = Path(__file__).parent / "data"
GENERIC = "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
# Words that only make sense on an AMD box: none of them may reach an NVIDIA user's fix line.
AMD_WORDS = ("HSA_OVERRIDE", "gfx", "/dev/kfd", "RENDER_GID", "ROCm", "AITER", "HIP_VISIBLE")
# Signatures whose log text itself only exists on AMD (so their fix may name AMD things).
AMD_ONLY = {"device-permission", "llvm-double-registration", "aiter-jit-race"}


def lines(name: str) -> list[str]:
    return (DATA / name).read_text().splitlines()


def without(monkeypatch: pytest.MonkeyPatch, *codes: str) -> None:
    """As if the table had no signature for these failures (a failure nobody has seen yet)."""
    monkeypatch.setattr(diagnosis, "SIGNATURES",
                        tuple(s for s in diagnosis.SIGNATURES if s.code not in codes))


# --- the two failures the generic line used to hide ----------------------------------------


def test_flashattention_without_kernels_names_an_explicit_backend() -> None:
    found = diagnosis.diagnose(lines("fail-tp2-mtp-flashattention.log"), 1, "nvidia")
    assert found.code == "flash-attn-unavailable"
    assert "AssertionError: FlashAttention version not detected." in (found.line or "")
    assert "ATTENTION_BACKEND=TRITON_ATTN" in found.fix and "draft model" in found.fix
    assert not [w for w in AMD_WORDS if w in found.fix]
    # Already on TRITON_ATTN: it is not offered again, and the fix says it is in use.
    named = diagnosis.diagnose(lines("fail-tp2-mtp-flashattention.log"), 1, "nvidia",
                               "TRITON_ATTN")
    assert "ATTENTION_BACKEND=FLASHINFER (it uses TRITON_ATTN already)" in named.fix


def test_gdn_prefill_without_flashinfer_gives_vllms_own_hint() -> None:
    log = lines("fail-tp2-gdn-flashinfer.log")
    # vLLM printed the way out itself; the fix must name the same flag and value.
    hint = re.search(r"Set (--gdn-prefill-backend \w+) to skip JIT", "\n".join(log))
    assert hint is not None
    found = diagnosis.diagnose(log, 1, "nvidia")
    assert found.code == "gdn-prefill-needs-flashinfer"
    assert hint.group(1) in found.fix and "VLLM_EXTRA_ARGS" in found.fix
    # A longer log whose tail holds only the fatal traces (no warm-up warning with the GDN file
    # in its header) is still recognised, from the GDN frames of the traceback.
    fatal = log[-350:]
    assert not any("[qwen_gdn_linear_attn.py:" in line for line in fatal)
    tail = diagnosis.diagnose(fatal, 1, "nvidia")
    assert tail.code == "gdn-prefill-needs-flashinfer" and "ERROR" in (tail.line or "")


# --- an unknown failure: the last exception of an engine process, quoted verbatim ----------


def test_unknown_failure_quotes_the_workers_exception_not_the_wrappers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    without(monkeypatch, "flash-attn-unavailable")
    log = lines("fail-tp2-mtp-flashattention.log")
    found = diagnosis.diagnose(log, 1, "nvidia")
    assert found.code == "engine-exception"
    # The worker's own error, verbatim: not EngineCore's "Worker failed with error '...'"
    # wrapper, and not the API server's generic line below it.
    assert found.cause.endswith("was: AssertionError: FlashAttention version not detected.")
    assert "in Worker_TP" in found.cause
    assert found.line_number is not None
    generic_at = next(i for i, line in enumerate(log, 1) if "Failed core proc" in line)
    assert found.line_number < generic_at
    assert found.line is not None and diagnosis.split_line(found.line).level == "ERROR"


def test_unknown_failure_prefers_the_fatal_error_over_a_warned_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    without(monkeypatch, "gdn-prefill-needs-flashinfer", "flashinfer-missing")
    log = lines("fail-tp2-gdn-flashinfer.log")
    found = diagnosis.diagnose(log, 1, "nvidia")
    assert found.code == "engine-exception"
    assert found.cause.endswith("was: ModuleNotFoundError: No module named 'flashinfer'")
    # The same text was logged earlier as a WARNING (a failed, caught kernel warm-up) and later
    # as harmless deep_gemm ImportErrors: the quote is the ERROR the worker died of.
    assert "[multiproc_executor.py:" in (found.line or "")
    assert diagnosis.split_line(found.line or "").level == "ERROR"


def test_process_prefixes_of_interleaved_workers_are_read_like_vllm_writes_them() -> None:
    log = lines("fail-tp2-mtp-flashattention.log")
    doubled = next(line for line in log if line.startswith("(Worker_TP0 pid=1788) (Worker_TP1 pid=1789)"))
    parsed = diagnosis.split_line(doubled)
    assert parsed.process == "Worker_TP1" and parsed.level == "ERROR"
    assert not parsed.text.startswith(("(", "ERROR"))
    bare = next(line for line in log if line.startswith("ERROR ") and "AssertionError" in line)
    parsed = diagnosis.split_line(bare)
    assert (parsed.process, parsed.level, parsed.text) == (
        None, "ERROR", "AssertionError: FlashAttention version not detected.")


def test_a_signal_killed_engine_is_not_blamed_on_an_old_caught_exception() -> None:
    log = lines("boot-tp2-hybrid-eager.log")
    cut = next(i for i, line in enumerate(log) if "ImportError:" in line) + 3  # killed soon after
    assert diagnosis.diagnose(log[:cut], 139, "nvidia").code == "native-crash"


# --- hints follow the platform's vendor ------------------------------------------------------


@pytest.mark.parametrize("name", ["fail-tp2-mtp-flashattention.log", "fail-tp2-gdn-flashinfer.log",
                                  "fail-no-kv-memory.log", "fail-max-model-len.log",
                                  "fail-unknown-flag.log"])
def test_an_nvidia_box_never_gets_an_amd_hint(name: str) -> None:
    found = diagnosis.diagnose(lines(name), 1, "nvidia")
    assert not [w for w in AMD_WORDS if w in found.fix], found.fix


def test_every_signature_has_a_vendor_neutral_nvidia_fix() -> None:
    for signature in diagnosis.SIGNATURES:
        if signature.code in AMD_ONLY:
            continue
        fix = signature.fix_for("nvidia")
        assert not [w for w in AMD_WORDS if w in fix], (signature.code, fix)


def test_silent_death_hint_per_vendor() -> None:
    log = ["(EngineCore pid=7) INFO 11-30 10:00:00 [core.py:121] Initializing a V1 LLM engine",
           f"(APIServer pid=6) {GENERIC}"]
    amd, nvidia = diagnosis.diagnose(log, 1, "amd"), diagnosis.diagnose(log, 1, "nvidia")
    assert amd.code == nvidia.code == "engine-core-died"
    assert "HSA_OVERRIDE_GFX_VERSION" in amd.fix
    assert "HSA" not in nvidia.fix and "CUDA" in nvidia.fix
    cuda = diagnosis.diagnose(["RuntimeError: CUDA error: no kernel image is available for "
                               "execution on the device"], 1, "nvidia")
    assert cuda.code == "missing-gfx-kernels" and "gfx" not in cuda.fix.lower()


# --- the progress line ------------------------------------------------------------------------


def replay(log: list[str], *, seconds_per_line: float, tty: bool = False) -> list[str]:
    """Feed a real log to Progress as `up` polls it (every 0.5 s, the last 200 lines)."""
    out = io.StringIO()
    progress = watch.Progress(out, tty)
    shown = 0
    elapsed = 0.0
    while shown < len(log):
        shown = min(len(log), shown + max(1, int(0.5 / seconds_per_line)))
        tail = log[max(0, shown - 200):shown]
        progress.show(elapsed, watch.phase_of(tail, progress.phase or "starting"), tail)
        elapsed += 0.5
    return out.getvalue().splitlines()


def message(printed: str) -> str:
    """The log text of a printed progress line (after the phase and its duration)."""
    return printed.split(")  ", 1)[1] if ")  " in printed else ""


def test_progress_names_phase_and_duration_and_never_repeats_a_line() -> None:
    printed = replay(lines("boot-tp2-hybrid-eager.log"), seconds_per_line=1.0)
    assert printed, "nothing printed"
    pattern = re.compile(r"^\[\s*\d+\.\ds\] [a-zA-Z ]+ \(\d+ s\)")
    assert all(pattern.match(p) for p in printed), printed
    texts = [message(p) for p in printed if message(p)]
    assert len(texts) == len(set(texts)), "the same log line was printed twice"
    phases = [p.split("] ", 1)[1].split(" (")[0] for p in printed]
    for phase in ("parsing arguments", "initialising engine", "loading weights",
                  "allocating KV cache", "starting API server"):
        assert phase in phases, phases


def test_progress_cuts_at_a_word_never_mid_word() -> None:
    log = lines("boot-tp2-hybrid-eager.log")
    originals = {diagnosis.split_line(line).text for line in log}
    printed = replay(log, seconds_per_line=1.0) + replay(log, seconds_per_line=1.0, tty=True)
    # The line the old progress showed as "inking_token_budget request parameter...".
    assert not [p for p in printed if "inking_token_budget" in p and "thinking_token_budget" not in p]
    cuts = 0
    for text in (message(p.strip()) for p in printed):
        shown = re.sub(r"^(TP\d+|EngineCore|Worker): ", "", text)
        if not shown.endswith("…"):
            continue
        cuts += 1
        head = shown[:-1]
        full = next((o for o in originals if o.startswith(head)), None)
        assert full is not None, shown
        assert full[len(head)] in " ,;:", f"cut mid-word: {shown!r}"
    assert cuts  # long lines were shortened (the real log has many)


def test_a_silent_phase_prints_a_heartbeat_not_the_same_line_again() -> None:
    out = io.StringIO()
    progress = watch.Progress(out, False)
    log = lines("boot-tp2-hybrid-eager.log")
    stuck = log[: next(i for i, line in enumerate(log) if "Padding mamba page size" in line) + 1]
    for step in range(0, 400):  # 200 s without a new line (the 60 s shm-broadcast wait, longer)
        progress.show(step * 0.5, "loading weights", stuck)
    printed = out.getvalue().splitlines()
    assert len(printed) == 1 + 3  # the line once, then a heartbeat per minute
    assert "Padding mamba page size" in printed[0]
    assert all("no new log line for 60 s" in p for p in printed[1:])
    assert [p.split("(")[1].split(")")[0] for p in printed[1:]] == ["60 s", "120 s", "180 s"]
