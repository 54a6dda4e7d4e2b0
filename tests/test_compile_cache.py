"""`check` says whether the next boot will hit the compile cache (runtime.compile_cache,
checks/compile_cache.py), from the boots `up` recorded with the profile's compile key; the
verdicts are taken on the real boots of tests/data (test_boot_phases.py says what each one is)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from vllmstack.checks.compile_cache import rule_compile_cache
from vllmstack.checks.registry import render_report, run_checks
from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project
from vllmstack.runtime.compile_cache import (
    COMPILE_PHASE,
    cache_has_compiles,
    compile_argv,
    compile_key,
    predict_next_boot,
    read_boots_with,
)
from vllmstack.serve.boot_history import BootRecord, append_boot
from vllmstack.serve.boot_markers import COMPILE
from vllmstack.serve.boot_phases import measure_boot

DATA = Path(__file__).parent / "data"


def boot_of(name: str) -> dict[str, Any]:
    return measure_boot((DATA / name).read_text().splitlines()).as_json()


def test_the_key_follows_what_changes_the_compiled_graphs_only(project: Project,
                                                               tmp_path: Path) -> None:
    resolved = resolve(project, platform="cpu", model="tiny")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 256}')
    argv = ["vllm", "serve", str(model), "--port", "8000", "--max-model-len", "4096",
            "--api-key=secret", "--enable-auto-tool-choice", "--served-model-name", "tiny"]
    assert compile_argv(argv) == ["vllm", "serve", str(model), "--max-model-len", "4096"]
    key = compile_key(resolved, argv)
    assert len(key) == 16
    # The server's own flags change nothing that is compiled.
    assert compile_key(resolved, [*argv[:3], "--port", "9000", *argv[5:]]) == key
    assert compile_key(resolved, [*argv, "--chat-template", "/x.jinja"]) == key
    # The shapes, the mode, the engine's program, torch, the model's geometry: each changes it.
    assert compile_key(resolved, [*argv, "--enforce-eager"]) != key
    assert compile_key(resolved, [a.replace("4096", "8192") for a in argv]) != key
    assert compile_key(resolved, ["/venv/bin/vllm", *argv[1:]]) != key
    other_torch = resolve(project, platform="cpu", model="tiny", overrides=["TORCH_VERSION=9.9.9"])
    assert compile_key(other_torch, argv) != key
    (model / "config.json").write_text('{"hidden_size": 512}')
    assert compile_key(resolved, argv) != key


def test_the_verdicts_on_the_real_boots() -> None:
    cold = boot_of("boot-cpu-cold.log")
    again = boot_of("boot-cpu-recompile.log")
    assert predict_next_boot([], True).verdict == "cold"
    assert predict_next_boot([cold], True).verdict == "warm"  # it filled the cache
    gone = predict_next_boot([cold], False)
    assert gone.verdict == "cold" and "clear-caches" in gone.reason
    # vLLM 0.32's CPU build compiled again although the cache was there: it does not take.
    stuck = predict_next_boot([cold, again], True)
    assert stuck.verdict == "cold" and "VLLM_USE_AOT_COMPILE=0" in stuck.reason
    assert predict_next_boot([boot_of("boot-cpu-noaot-warm.log")], True).verdict == "unknown"
    assert predict_next_boot([boot_of("boot-spec-decode.log")], False).verdict == "eager"
    h200 = [boot_of("boot-h200-cold.log"), boot_of("boot-h200-warm.log")]
    assert predict_next_boot(h200[:1], True).verdict == "warm"  # and the H200's next one was
    assert predict_next_boot(h200, True).verdict == "warm"
    assert COMPILE_PHASE == COMPILE


def test_the_cache_folder_counts_only_with_a_compile_in_it(tmp_path: Path) -> None:
    cache = tmp_path / "vllmstack-engine"
    assert not cache_has_compiles(cache)
    (cache / "native" / "vllm-0.32.0+cpu" / "vllm" / "torch_compile_cache").mkdir(parents=True)
    assert not cache_has_compiles(cache)
    (cache / "native" / "vllm-0.32.0+cpu" / "vllm" / "torch_compile_cache" / "5d3d36c9").mkdir()
    assert cache_has_compiles(cache)


def test_check_says_whether_the_next_boot_will_hit_the_cache(project: Project,
                                                            tmp_path: Path) -> None:
    resolved = resolve(project, platform="cpu", model="tiny",
                       overrides=[f"HOST_CACHE_DIR={tmp_path / 'cache'}"])
    findings, ctx = run_checks(project, resolved, {"HOME": str(tmp_path)}, runtime="compose")
    [said] = [f for f in findings if f.code == "compile-cache"]
    assert "will compile (a cold boot): no boot with this engine" in said.message
    assert "compile-cache" in render_report(resolved, findings)  # shown without --verbose
    assert ctx.command is not None
    key = compile_key(resolved, ctx.command.argv)
    boot = measure_boot((DATA / "boot-cpu-cold.log").read_text().splitlines())
    append_boot(project, BootRecord(time.time(), "tiny", "", boot, key))
    append_boot(project, BootRecord(time.time(), "other", "", boot, "0" * 16))  # not this key
    assert len(read_boots_with(project, key)) == 1
    (tmp_path / "cache" / "vllmstack-engine" / "vllm" / "torch_compile_cache" / "8cebd03b78").mkdir(
        parents=True)
    [said] = rule_compile_cache(ctx)
    assert said.message.startswith("the next boot on the compose runtime should hit the compile "
                                   "cache: its last boot compiled and filled the cache")
    assert f"compile key {key}; 1 recorded boot(s)" in said.message


@pytest.mark.parametrize("line", ["", "{", '{"compile_key": 5}', '[1]', '{"compile_key": "k"}'])
def test_a_history_line_that_is_not_a_boot_is_skipped(project: Project, line: str) -> None:
    project.results.mkdir(parents=True, exist_ok=True)
    (project.results / "boot_history.jsonl").write_text(line + "\n")
    assert read_boots_with(project, "k") == []
