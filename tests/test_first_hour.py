"""A newcomer's first hour (issue 23): the small things that went wrong on a fresh clone.

History in an ignored results/ folder (and what older versions left in benchmarks/ moved there
without losing a line), `.venv/` ignored, `make-model`'s next step runnable as printed, and
`up --dry-run` naming a missing image as missing."""

from __future__ import annotations

import io
import subprocess
from pathlib import Path

from helpers import ROOT

from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project, results_folder
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.models.tiny import MadeModel, render_made
from vllmstack.serve import lifecycle


def test_history_lives_in_an_ignored_results_folder() -> None:
    for path in (".venv/bin/python", "results/bench_history.jsonl", "results/bench-vs-history.md",
                 "results/burn-latest.md"):
        ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, check=False)
        assert ignored.returncode == 0, f"{path} would leave `git status` dirty"


def test_old_history_in_benchmarks_moves_to_results_without_losing_a_line(tmp_path: Path) -> None:
    project = Project(tmp_path)
    old = project.benchmarks
    old.mkdir()
    (old / "bench_history.jsonl").write_text('{"id": "old-1"}\n{"id": "old-2"}')  # no final \n
    (old / "bench-vs-results.md").write_text("old latest\n")
    (old / "bench-vs-history.md").write_text("## old run\n")
    (old / "burn-2026-11-29.md").write_text("old burn\n")
    (old / "bench_c1_agreement.py").write_text("# a tracked script stays\n")
    (old / "2026-11-30-h200-real-engine.md").write_text("a tracked report stays\n")
    results = project.results
    results.mkdir()
    (results / "bench_history.jsonl").write_text('{"id": "new-1"}\n')
    (results / "bench-vs-results.md").write_text("new latest\n")

    assert results_folder(project) == results
    lines = (results / "bench_history.jsonl").read_text().splitlines()
    assert lines == ['{"id": "old-1"}', '{"id": "old-2"}', '{"id": "new-1"}']  # oldest first
    assert (results / "bench-vs-results.md").read_text() == "new latest\n"
    assert (results / "bench-vs-results.md.from-benchmarks").read_text() == "old latest\n"
    assert (results / "bench-vs-history.md").read_text() == "## old run\n"
    assert (results / "burn-2026-11-29.md").read_text() == "old burn\n"
    assert sorted(p.name for p in old.iterdir()) == ["2026-11-30-h200-real-engine.md",
                                                     "bench_c1_agreement.py"]
    assert results_folder(project) == results  # a second call has nothing left to move


def test_make_model_names_the_runtime_that_works_on_a_fresh_machine() -> None:
    made = MadeModel("tiny", "vllmstack/tiny-qwen3", Path("/x"), 4200, 3_000_000, 4_000_000,
                     2.0, made=True)
    assert "invoke up --runtime native --platform cpu --model tiny" in render_made(made)


def test_up_dry_run_with_a_missing_image_says_it_is_missing_and_how_to_build_it(
        project: Project) -> None:
    resolved = resolve(project, platform="cpu", model="tiny",
                       overrides=["OTHER_ENGINE_PORTS=", f"HOST_CACHE_DIR={project.root}/cache"])
    runner = RecordingRunner(dry_run=True)
    runner.respond(["docker", "image", "inspect"], Result((), 1, "", "Error: No such image"))
    out = io.StringIO()
    stack = lifecycle.open_stack(project, resolved, {}, runner, runtime="compose", out=out)
    lifecycle.up(stack, dry_run=True, dashboard=False)
    said = out.getvalue()
    assert "localhost/vllm-cpu:latest does not exist on this host" in said
    assert "invoke build --platform cpu" in said
    assert "vllm-package label" not in said  # the old, misleading reason


def test_bench_vs_picks_the_platform_every_target_is_made_for(project: Project) -> None:
    from vllmstack.bench.target import TargetError, shared_platform

    # .env.example selects 2xr9700; tiny and tiny-gguf are made for cpu only.
    chosen, note = shared_platform(project, {}, ["tiny", "tiny-gguf"], None)
    assert chosen == "cpu" and note and "2xr9700" in note
    assert shared_platform(project, {}, ["qwen3-0.6b"], None) == (None, None)  # .env's fits
    assert shared_platform(project, {}, ["tiny"], "nvidia") == ("nvidia", None)  # given wins
    try:
        shared_platform(project, {}, ["tiny", "qwen3.8-27b"], None)
    except TargetError as exc:
        assert "share: none" in exc.cause and exc.fix
    else:
        raise AssertionError("profiles made for no common platform must be refused")
    try:
        shared_platform(project, {}, ["qwen3.6-27b-gguf", "qwen3.5-9b-gguf"], None)
    except TargetError as exc:
        assert "--platform" in (exc.fix or "") and "nvidia" in exc.cause
    else:
        raise AssertionError("several shared platforms, none .env's: ask which")
