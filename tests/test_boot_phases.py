"""Where a boot's time went, read from real engine logs (serve.boot_phases, serve.boot_markers).

The logs, all real (copies kept with the tests; none is read from ../shared at run time):
* boot.log, boot-spec-decode.log: shared/reference/vllm-captures, vLLM 0.27.1 on an H200 (a cold
  torch.compile; an eager boot with n-gram speculation);
* boot-tp2-hybrid-eager.log: the 27B hybrid on TP=2 (two workers logging the same phases);
* boot-cpu-cold.log, boot-cpu-recompile.log: the CPU engine (vLLM 0.32.0+cpu, `invoke up --runtime
  native --platform cpu --model tiny` on this project's 2-core CI box, 2026-12-04) with an empty
  compile cache, then again with the cache the first boot filled: vLLM could not load its AOT
  artefact (`Compiling model again due to a load failure`) and compiled again, a cold boot;
* boot-cpu-noaot-cold.log, boot-cpu-noaot-warm.log: the same two boots with
  ENGINE_ENV=VLLM_USE_AOT_COMPILE=0: the second one loaded the compile cache (21 s of compiling
  became 3 s), though vLLM logs neither a hit nor a miss that way;
* boot-h200-cold.log, boot-h200-warm.log: vLLM 0.27.1 on an H200 (the device machine,
  2026-12-04), `vllm serve` of the Qwen3-0.6B geometry (dummy weights, TRITON_ATTN) on a fresh
  machine, then again with the compile cache the first filled; launched and healthy at H200_TIMES
  (epoch seconds, the machine's clock in UTC, as `up` would have measured them);
* llamacpp/boot-tiny-cpu.log: llama-server on CPU.
"""

from __future__ import annotations

import calendar
import re
from pathlib import Path

import pytest

from vllmstack.serve.boot_markers import (
    API,
    CAPTURE,
    COMPILE,
    INIT,
    KV,
    OTHER,
    PARSING,
    PROFILE,
    SERVING,
    STARTING,
    WARM_UP,
    WEIGHTS,
    live_phase,
)
from vllmstack.serve.boot_phases import AGREE_SHARE, Boot, measure_boot

DATA = Path(__file__).parent / "data"
# Every real boot log the tests hold, and the engine whose log it is.
REAL_BOOTS = {
    "boot.log": "vllm",
    "boot-spec-decode.log": "vllm",
    "boot-tp2-hybrid-eager.log": "vllm",
    "boot-cpu-cold.log": "vllm",
    "boot-cpu-recompile.log": "vllm",
    "boot-cpu-noaot-cold.log": "vllm",
    "boot-cpu-noaot-warm.log": "vllm",
    "boot-h200-cold.log": "vllm",
    "boot-h200-warm.log": "vllm",
    "llamacpp/boot-tiny-cpu.log": "llamacpp",
}
H200_TIMES = {"boot-h200-cold.log": (1796419776.533, 1796419961.649),
              "boot-h200-warm.log": (1796419965.207, 1796420078.598)}


def lines(name: str) -> list[str]:
    return (DATA / name).read_text(errors="replace").splitlines()


def stamp(month: int, day: int, clock: str, *, year: int = 2026) -> float:
    """Epoch seconds of a vLLM stamp read as UTC (the engine's clock)."""
    hour, minute, second = (int(x) for x in clock.split(":"))
    return float(calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0)))


def phase_seconds(boot: Boot) -> dict[str, float]:
    return {p.name: p.seconds for p in boot.phases}


def assert_sound(boot: Boot) -> None:
    """What every boot holds: phases in order, none negative, summing to the wall."""
    assert boot.agrees, (boot.sum_s, boot.wall_s)
    assert abs(boot.sum_s - boot.wall_s) <= AGREE_SHARE * boot.wall_s
    assert all(p.seconds >= 0 for p in boot.phases)
    starts = [p.start_s for p in boot.phases]
    assert starts == sorted(starts) or OTHER in {p.name for p in boot.phases}
    assert len({p.name for p in boot.phases}) == len(boot.phases)  # one row per phase


@pytest.mark.parametrize("name", sorted(REAL_BOOTS))
def test_every_real_boot_log_is_placed_and_sums_to_its_wall(name: str) -> None:
    boot = measure_boot(lines(name))
    assert boot.engine == REAL_BOOTS[name] and boot.complete, boot.notes
    assert_sound(boot)
    named = {p.name for p in boot.phases} - {OTHER}
    assert {WEIGHTS, API} <= named  # every engine loads weights, then serves
    assert phase_seconds(boot).get(OTHER, 0.0) <= 0.1 * boot.wall_s  # the table places most of it
    # The same with the times `up` measures: a launch 20 s before the first line, /health 0.4 s
    # after the last ready line, a warm-up: wall is what `up` measured, still the phases' sum.
    first, last = _first_and_ready(name)
    measured = measure_boot(lines(name), launched=first - 20.0, ready=last + 0.4, warmup_s=0.25)
    assert_sound(measured)
    assert measured.wall_s == pytest.approx(last + 0.4 - (first - 20.0) + 0.25, abs=0.01)
    assert phase_seconds(measured)[WARM_UP] == 0.25
    if REAL_BOOTS[name] == "vllm":  # its stamps are wall-clock times: the 20 s are the start's
        assert phase_seconds(measured)[STARTING] == pytest.approx(20.0, abs=1.0)


def _first_and_ready(name: str) -> tuple[float, float]:
    """Epoch seconds of the log's first stamp and of its ready line, as `up` would see them."""
    if REAL_BOOTS[name] == "llamacpp":
        return 1_000.0, 1_000.0 + 0.149554  # process-relative stamps: any launch time will do
    boot = measure_boot(lines(name))
    found = re.search(r"(\d\d)-(\d\d) (\d\d:\d\d:\d\d)", "\n".join(lines(name)))
    assert found is not None
    month, day, clock = found.groups()
    first = stamp(int(month), int(day), clock, year=2000) + 0.5
    return first, first + boot.wall_s


@pytest.mark.parametrize("name", sorted(REAL_BOOTS))
def test_up_s_live_progress_names_the_phases_the_boot_is_measured_in(name: str) -> None:
    """serve.watch shows `live_phase` while `up` waits: the same table, the same names."""
    live: list[str] = []
    for line in lines(name):
        phase = live_phase(line)
        if phase is not None and (not live or live[-1] != phase):
            live.append(phase)
        if phase == SERVING:
            break
    assert live[-1] == SERVING and live[0] == PARSING
    measured = {p.name for p in measure_boot(lines(name)).phases if p.seconds >= 1.0}
    assert measured - {STARTING, OTHER} <= set(live), (measured, live)


def test_the_cold_h200_boot_phase_by_phase() -> None:
    """boot.log: the engine's own figures where it logs them, the stamps elsewhere."""
    boot = measure_boot(lines("boot.log"))
    seconds = phase_seconds(boot)
    assert boot.compile == "cold"  # `Compiling a graph for compile range (1, 8192) takes 10.62 s`
    assert boot.wall_s == pytest.approx(65.0)  # 16:10:03 (non-default args) to 16:11:08
    assert seconds[COMPILE] == pytest.approx(13.66)  # `torch.compile took 13.66 s in total`
    assert seconds[CAPTURE] == pytest.approx(5.0)  # `Graph capturing finished in 5 secs`
    assert seconds[WEIGHTS] == pytest.approx(1.59, abs=0.01)  # `Model loading took ... 1.587746 s`
    assert seconds[PARSING] == pytest.approx(20.0)  # to `Initializing a V1 LLM engine` 16:10:23
    logged = {p.name: p.logged_s for p in boot.phases}
    assert logged[COMPILE] == 13.66 and logged[CAPTURE] == 5.0
    assert [p.name for p in boot.phases if p.name != OTHER] == [
        PARSING, INIT, WEIGHTS, COMPILE, PROFILE, KV, CAPTURE, "warming up kernels", API]


def test_the_h200_boots_cold_then_warm_from_the_compile_cache() -> None:
    """A warm boot of the pinned engine, for real: `Directly load the compiled graph(s) ... from
    the cache`, `torch.compile took 5.50 s` against 36.05 s cold; launch to /health measured."""
    cold, warm = (measure_boot(lines(name), launched=H200_TIMES[name][0],
                               ready=H200_TIMES[name][1]) for name in sorted(H200_TIMES))
    assert (cold.compile, warm.compile) == ("cold", "warm") and not cold.notes + warm.notes
    assert cold.wall_s == pytest.approx(185.1, abs=0.1) and warm.wall_s == pytest.approx(113.4, abs=0.1)
    assert phase_seconds(cold)[COMPILE] == pytest.approx(36.05, abs=0.01)
    assert phase_seconds(warm)[COMPILE] == pytest.approx(5.50, abs=0.01)
    # Python's start and imports on the machine's slow file system, before vLLM's first line.
    assert phase_seconds(cold)[STARTING] == pytest.approx(36.0, abs=1.0)
    assert phase_seconds(warm)[STARTING] == pytest.approx(31.3, abs=1.0)
    for boot in (cold, warm):
        assert_sound(boot)
        assert phase_seconds(boot)[CAPTURE] >= 15.0  # `Graph capturing finished in 15 secs`


def test_an_eager_boot_has_no_compile_and_the_tp2_workers_count_once() -> None:
    eager = measure_boot(lines("boot-spec-decode.log"))  # --enforce-eager
    assert eager.compile is None and COMPILE not in phase_seconds(eager)
    assert eager.wall_s == pytest.approx(35.0)  # 16:17:43 to 16:18:18
    tp2 = measure_boot(lines("boot-tp2-hybrid-eager.log"))
    seconds = phase_seconds(tp2)
    # Both workers log `Model loading took`; the phase is not counted twice.
    assert seconds[WEIGHTS] < 5.0
    # 12:40:38 (TP1's weights) to 12:42:23 (`Available KV cache memory`): the profiling run.
    assert seconds[PROFILE] == pytest.approx(105.0, abs=1.0)
    assert tp2.wall_s == pytest.approx(197.0)  # 12:39:35 to 12:42:52


def test_the_cpu_engine_boots_cold_and_a_cache_it_cannot_load_is_cold_again() -> None:
    cold, again = measure_boot(lines("boot-cpu-cold.log")), measure_boot(lines("boot-cpu-recompile.log"))
    assert (cold.compile, again.compile) == ("cold", "cold")
    # 20:59:22 `Warming up model for the compilation...` to 20:59:44 `saved AOT compiled function`
    assert phase_seconds(cold)[COMPILE] == pytest.approx(22.0)
    assert phase_seconds(again)[COMPILE] < phase_seconds(cold)[COMPILE]  # inductor's own cache
    assert cold.wall_s == pytest.approx(61.0)  # 20:58:59 to `Application startup complete` 21:00:00
    for boot in (cold, again):
        assert_sound(boot)
        assert {PARSING, INIT, WEIGHTS, COMPILE, KV, API} <= set(phase_seconds(boot))


def test_a_cache_vllm_does_not_report_still_shows_in_the_compile_phase() -> None:
    cold = measure_boot(lines("boot-cpu-noaot-cold.log"))
    warm = measure_boot(lines("boot-cpu-noaot-warm.log"))
    assert cold.compile is None and warm.compile is None  # no line says hit or miss
    # `Warming up model for the compilation...` to `Warming up done.`: 21:02:54 to 21:03:15,
    # then 21:03:55 to 21:03:58 with the cache.
    assert phase_seconds(cold)[COMPILE] == pytest.approx(21.0)
    assert phase_seconds(warm)[COMPILE] == pytest.approx(3.0)
    assert phase_seconds(cold).get(PROFILE, 0.0) < 1.0  # the compile is not the profiling run's


def test_a_compile_loaded_from_the_cache_is_a_warm_boot() -> None:
    """boot.log with its compile lines as a warm boot logs them (vLLM's own texts:
    compilation/backends.py, decorators.py): nothing compiled, so the boot is warm."""
    warm = []
    for line in lines("boot.log"):
        if "Cache the graph of compile range" in line or "saved AOT compiled function" in line:
            continue
        warm.append(line.replace(
            "Compiling a graph for compile range (1, 8192) takes 10.62 s",
            "Directly load the compiled graph(s) for compile range (1, 8192) from the cache, "
            "took 0.717 s").replace("torch.compile took 13.66 s in total",
                                    "torch.compile took 3.40 s in total"))
    boot = measure_boot(warm)
    assert boot.compile == "warm"
    assert {p.name: p.logged_s for p in boot.phases}[COMPILE] == 3.40
    assert_sound(boot)


def test_a_llama_server_boot_counts_from_its_process_start() -> None:
    boot = measure_boot(lines("llamacpp/boot-tiny-cpu.log"))
    seconds = phase_seconds(boot)
    assert boot.engine == "llamacpp" and boot.compile is None
    assert boot.wall_s == pytest.approx(0.149554)  # `llama_server: model loaded` at 0.00.149.554
    assert seconds[WEIGHTS] == pytest.approx(0.143499 - 0.008671, abs=1e-6)
    assert seconds[STARTING] == pytest.approx(0.007058, abs=1e-6)  # before its first line


def test_an_engine_in_another_time_zone_is_matched_to_the_hosts_clock() -> None:
    """A container logging in UTC+5:30 while `up` measures epoch seconds."""
    first = stamp(11, 29, "16:10:03") + 0.5  # the log's first line, on the engine's clock
    zone = 5.5 * 3600
    launched = first - zone - 23.0  # 23 s before it: imports (the capture's health timeline: 88 s)
    ready = first - zone + 65.3
    boot = measure_boot(lines("boot.log"), launched=launched, ready=ready, warmup_s=0.4)
    assert not boot.notes
    seconds = phase_seconds(boot)
    assert seconds[STARTING] == pytest.approx(23.0, abs=0.01)
    assert boot.wall_s == pytest.approx(23.0 + 65.3 + 0.4, abs=0.01)
    assert seconds[COMPILE] == pytest.approx(13.66)
    assert_sound(boot)


def test_a_log_of_another_boot_keeps_its_phases_and_the_rest_is_other() -> None:
    """A clock that matches no time zone (another day's log): nothing is moved onto this boot."""
    launched = stamp(12, 3, "09:00:00")
    boot = measure_boot(lines("boot.log"), launched=launched, ready=launched + 90.0)
    assert any("does not match" in note for note in boot.notes)
    assert boot.wall_s == pytest.approx(90.0)
    # 90 s measured, 65 logged: the 25 s the log does not cover join the log's own `other`.
    own = phase_seconds(measure_boot(lines("boot.log")))[OTHER]
    assert phase_seconds(boot)[OTHER] == pytest.approx(25.0 + own, abs=0.01)
    assert phase_seconds(boot)[COMPILE] == pytest.approx(13.66)
    assert_sound(boot)


def test_lines_vllm_reworded_are_other_never_an_error() -> None:
    """Every known text changed: the stamps still give the wall, all of it `other`."""
    reworded = [line.replace("a", "4").replace("e", "3").replace("o", "0") for line in lines("boot.log")]
    boot = measure_boot(reworded)
    assert boot.engine == "vllm" and boot.compile is None and not boot.complete
    assert [p.name for p in boot.phases] == [OTHER]
    assert boot.sum_s == boot.wall_s > 60
    # One phase's line reworded: its time goes to the phase before it, the sum still holds.
    one = [line.replace("torch.compile took", "torch.compile needed") for line in lines("boot.log")]
    changed = measure_boot(one)
    assert_sound(changed)
    assert changed.wall_s == pytest.approx(65.0) and changed.compile == "cold"


@pytest.mark.parametrize("log", [
    [],
    ["garbage", "\x00\x01\xff not a log", "Traceback (most recent call last):"],
    ["INFO 13-45 99:99:99 [x.py:1] a stamp no calendar has"],
    ["(APIServer pid=1) INFO 11-29 16:10:03 [api_utils.py:273] non-default args: {}"],
])
def test_an_empty_or_garbled_log_is_other(log: list[str]) -> None:
    alone = measure_boot(log)
    assert alone.agrees and alone.sum_s == alone.wall_s
    measured = measure_boot(log, launched=1000.0, ready=1042.0, warmup_s=1.0)
    assert measured.wall_s == pytest.approx(43.0)
    assert phase_seconds(measured).get(OTHER, 0.0) + phase_seconds(measured).get(PARSING, 0.0) \
        + phase_seconds(measured).get(STARTING, 0.0) == pytest.approx(42.0)
    assert measured.agrees


def test_the_last_of_several_boots_in_one_log_is_measured() -> None:
    """A container's log keeps the boots before the last one (a restart, a failed boot)."""
    later = measure_boot(lines("boot.log") + lines("boot-spec-decode.log"))  # 16:10, then 16:17
    assert later.complete and later.wall_s == pytest.approx(35.0) and later.compile is None
    failed = measure_boot(lines("boot.log") + lines("fail-no-kv-memory.log"))  # then 16:12
    assert not failed.complete and any("before the server started" in n for n in failed.notes)
    assert failed.compile is None  # boot.log's cold compile is not this boot's
    assert_sound(failed)
    # A container restarted on a clock behind the first boot's: still the last boot.
    behind = measure_boot(lines("fail-no-kv-memory.log") + lines("boot.log"))
    assert behind.complete and behind.wall_s == pytest.approx(65.0) and behind.compile == "cold"


def test_a_recorded_boot_reads_back_and_a_damaged_one_is_named() -> None:
    boot = measure_boot(lines("boot.log"), launched=None, ready=None, warmup_s=0.5)
    again = Boot.from_json(boot.as_json())
    assert phase_seconds(again) == pytest.approx(phase_seconds(boot), abs=1e-3)
    assert (again.compile, again.engine, again.complete) == ("cold", "vllm", True)
    damaged = boot.as_json()
    damaged["wall_s"] = "long"
    with pytest.raises(ValueError, match="wall_s 'long'"):
        Boot.from_json(damaged)
    with pytest.raises(ValueError, match="not an object"):
        Boot.from_json([1, 2])
