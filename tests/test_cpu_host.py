"""What depends on the host's CPU, with its flags faked both ways: an AVX-512 host (with and without
BF16, with AMX) and an AVX2-only one (an AMD EPYC of CI's kind). Which kernel library vLLM's CPU
build loads, what the install check expects and says when the probe dies of a signal, whether the
CPU build holds an fp8 KV cache, and the test suite's own CPU skips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import cpu_missing

from vllmstack.core.cpu import cpu_flags, describe_isa, has_avx512, signal_name
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.image.cpu import KERNELS_SCRIPT, cpu_build_runs, fp8_kv_serves, kernel_library
from vllmstack.models.kv_calibration import CalibrationError, check_fp8_kv_engine
from vllmstack.runtime.native.cpu_build import CpuBuildError, check_cpu_engine

# /proc/cpuinfo flags as two real hosts list them (abridged to what matters and a few others).
EPYC_AVX2 = {"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "avx", "f16c", "fma", "avx2", "bmi1",
             "bmi2", "sha_ni"}
SAPPHIRE_RAPIDS = EPYC_AVX2 | {"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512_bf16",
                               "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"}
SKYLAKE_X = EPYC_AVX2 | {"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"}
FIX = "start over: invoke install-engine --platform cpu --force"


def test_the_kernel_library_is_the_one_vllms_own_loader_picks_for_the_cpu() -> None:
    assert kernel_library(SAPPHIRE_RAPIDS, "x86_64") == "_C"
    assert kernel_library(SKYLAKE_X, "x86_64") == "_C_AVX512"
    assert kernel_library(EPYC_AVX2, "x86_64") == "_C_AVX2"
    # avx512f alone is not torch's "AVX-512 supported" (VL, BW and DQ too): the AVX2 library.
    assert kernel_library(EPYC_AVX2 | {"avx512f"}, "x86_64") == "_C_AVX2"
    assert kernel_library(set(), "aarch64") == "_C"


def test_fp8_kv_needs_avx512_or_amx_and_the_avx2_library_has_neither() -> None:
    assert fp8_kv_serves(SAPPHIRE_RAPIDS, "x86_64") and fp8_kv_serves(SKYLAKE_X, "x86_64")
    assert fp8_kv_serves(EPYC_AVX2 | {"amx_tile"}, "x86_64")
    assert not fp8_kv_serves(EPYC_AVX2, "x86_64")
    assert not fp8_kv_serves(SAPPHIRE_RAPIDS, "aarch64")
    check_fp8_kv_engine("0.32.0+cpu", SKYLAKE_X)
    with pytest.raises(CalibrationError, match="needs AVX-512 or AMX"):
        check_fp8_kv_engine("0.32.0+cpu", EPYC_AVX2)
    check_fp8_kv_engine("0.32.0+cpu", set())  # unknown flags: the engine says for itself


def test_the_cpu_build_runs_on_avx2_and_not_below() -> None:
    assert cpu_build_runs(EPYC_AVX2, "x86_64") and cpu_build_runs(SKYLAKE_X, "x86_64")
    assert not cpu_build_runs({"sse4_2", "avx"}, "x86_64")
    assert cpu_build_runs(set(), "x86_64")  # unreadable cpuinfo: not held against it


def probe_answering(result: Result, folder: Path) -> RecordingRunner:
    runner = RecordingRunner()
    runner.respond([str(folder / "bin" / "python"), "-c", KERNELS_SCRIPT], result)
    return runner


def loaded(*libraries: str) -> Result:
    return Result((), 0, "INFO ...\n" + json.dumps({"device": "cpu", "libraries": list(libraries)}))


@pytest.mark.parametrize(("flags", "library"), [(EPYC_AVX2, "_C_AVX2"), (SAPPHIRE_RAPIDS, "_C"),
                                                (SKYLAKE_X, "_C_AVX512")])
def test_the_install_check_expects_the_library_for_the_cpu(tmp_path: Path, flags: set[str],
                                                           library: str) -> None:
    check_cpu_engine(probe_answering(loaded(library), tmp_path), tmp_path, {}, FIX, flags=flags)
    others = {"_C", "_C_AVX512", "_C_AVX2"} - {library}
    for other in others:
        with pytest.raises(CpuBuildError) as err:
            check_cpu_engine(probe_answering(loaded(other), tmp_path), tmp_path, {}, FIX, flags=flags)
        assert f"loaded {other}, not {library}" in err.value.cause
        assert "KERNEL_NEEDS" in err.value.fix and err.value.fix.endswith(FIX)


def test_a_probe_killed_by_sigill_names_the_signal_the_flags_and_what_the_build_needs(
        tmp_path: Path) -> None:
    # What `import vllm._C` did on an AVX2-only EPYC: SIGILL (subprocess: -4).
    runner = probe_answering(Result((), -4, "", ""), tmp_path)
    with pytest.raises(CpuBuildError) as err:
        check_cpu_engine(runner, tmp_path, {}, FIX, flags=EPYC_AVX2)
    cause = err.value.cause
    assert "killed by SIGILL" in cause and "exit -4" in cause
    assert "sse4_2 avx avx2 fma f16c" in cause and "avx512" not in cause.split("so vLLM")[0]
    assert "_C_AVX2, built for AVX2 (avx2, fma)" in cause
    assert err.value.fix.endswith(FIX)
    # Below AVX2 no library runs: the fix says what the CPU needs instead of a reinstall.
    with pytest.raises(CpuBuildError) as err:
        check_cpu_engine(probe_answering(Result((), 132, "", ""), tmp_path), tmp_path, {}, FIX,
                         flags={"sse4_2", "avx"})
    assert "killed by SIGILL" in err.value.cause and "without AVX2" in err.value.cause
    assert "AVX2 at least" in err.value.fix


def test_a_probe_that_fails_without_a_signal_keeps_its_own_message(tmp_path: Path) -> None:
    runner = probe_answering(Result((), 1, "", "OSError: libnuma.so.1: cannot open shared object "
                                                "file: No such file or directory"), tmp_path)
    with pytest.raises(CpuBuildError) as err:
        check_cpu_engine(runner, tmp_path, {}, FIX, flags=EPYC_AVX2)
    assert "does not load on the CPU (OSError: libnuma.so.1" in err.value.cause
    assert "apt install libnuma1" in err.value.fix


def test_signal_names_and_isa_descriptions() -> None:
    assert signal_name(-4) == "SIGILL" and signal_name(132) == "SIGILL"
    assert signal_name(-11) == "SIGSEGV" and signal_name(1) is None and signal_name(0) is None
    assert describe_isa(EPYC_AVX2) == "sse4_2 avx avx2 fma f16c"
    assert describe_isa(set()).startswith("none of sse4_2")
    assert has_avx512(SKYLAKE_X) and not has_avx512(EPYC_AVX2)


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu avx2 fma\n")
    assert cpu_flags(info) == {"fpu", "avx2", "fma"}
    assert cpu_flags(tmp_path / "missing") == set()


def test_a_test_that_needs_a_cpu_feature_is_skipped_naming_it_on_either_host() -> None:
    # tests/conftest.cpu_missing: the reason a test that needs an instruction set skips with
    # (a skip even in a full run: no install provides a CPU flag), or None where it can run.
    assert cpu_missing("fp8 KV on vLLM's CPU build", flags=SAPPHIRE_RAPIDS, machine="x86_64") is None
    reason = cpu_missing("fp8 KV on vLLM's CPU build", flags=EPYC_AVX2, machine="x86_64")
    assert reason is not None
    assert "needs AVX-512 or AMX" in reason and "sse4_2 avx avx2 fma f16c" in reason
    assert "no install provides it" in reason


def test_check_refuses_fp8_kv_on_the_cpu_build_where_the_cpu_holds_none(project: Project) -> None:
    # What `check` and so `up` say before a boot that vLLM's attention backend would end.
    from dataclasses import replace

    from vllmstack.checks.context import build_context
    from vllmstack.checks.kv_scales import rule_cpu_fp8_kv
    from vllmstack.config.profiles import resolve

    fp8 = resolve(project, platform="cpu", model="tiny", overrides=["VLLM_KV_CACHE_DTYPE=fp8"])
    ctx = build_context(project, fp8, {})
    (refused,) = rule_cpu_fp8_kv(replace(ctx, cpu_flags=frozenset(EPYC_AVX2)))
    assert (refused.severity, refused.code, refused.key) == ("error", "cpu-fp8-kv", "VLLM_KV_CACHE_DTYPE")
    assert refused.source == "--set" and "sse4_2 avx avx2 fma f16c" in refused.message
    assert "VLLM_KV_CACHE_DTYPE=auto" in (refused.fix or "")
    for fine in (SAPPHIRE_RAPIDS, SKYLAKE_X, set()):  # AVX-512, AMX, or flags unknown
        assert rule_cpu_fp8_kv(replace(ctx, cpu_flags=frozenset(fine))) == []
    bf16 = build_context(project, resolve(project, platform="cpu", model="tiny"), {})
    assert rule_cpu_fp8_kv(replace(bf16, cpu_flags=frozenset(EPYC_AVX2))) == []
    native = build_context(project, fp8, {}, runtime="native")
    native_codes = [f.code for f in rule_cpu_fp8_kv(replace(native, cpu_flags=frozenset(EPYC_AVX2)))]
    assert native_codes == ["cpu-fp8-kv"]
    # An engine that may not be vLLM's CPU build: a command of the user's own, an image they name
    # (the engine simulator of the container tests is one).
    for runtime, override in (("native", "NATIVE_ENGINE_COMMAND=/opt/my/vllm serve"),
                              ("compose", "VLLM_IMAGE=vllmstack/engine-sim:latest")):
        other = resolve(project, platform="cpu", model="tiny",
                        overrides=["VLLM_KV_CACHE_DTYPE=fp8", override])
        other_ctx = build_context(project, other, {}, runtime=runtime)
        assert rule_cpu_fp8_kv(replace(other_ctx, cpu_flags=frozenset(EPYC_AVX2))) == []
    gpu = resolve(project, platform="nvidia", model="qwen3-0.6b", overrides=["VLLM_KV_CACHE_DTYPE=fp8"])
    assert rule_cpu_fp8_kv(replace(build_context(project, gpu, {}), cpu_flags=frozenset(EPYC_AVX2))) == []
