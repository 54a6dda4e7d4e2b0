"""`invoke make-model --trained`: the training runs in the engine's Python on the made files before
they become a snapshot; an undertrained model is refused; the numbers land in the model's record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.models import tiny, trained


def fake_training(final_ppl: float) -> RecordingRunner:
    runner = RecordingRunner()

    def train(argv: tuple[str, ...]) -> Result:
        folder, out = Path(argv[3]), Path(argv[5])
        assert (folder / "model.safetensors").is_file()  # the random model, before its snapshot
        out.write_text(json.dumps({"initial_ppl": 1280.0, "final_ppl": final_ppl, "target_ppl": 60.4,
                                   "random_ppl": 1208, "steps": 900, "seconds": 300.0}))
        return Result(argv, 0)

    runner.respond(["/py/bin/python3", "-m", "vllmstack.models.train_runner"], train)
    return runner


def settings(project: Project, tmp_path: Path) -> tuple[object, dict[str, str]]:
    resolved = resolve(project, model="tiny", platform="cpu", overrides=[
        f"HF_CACHE_DIR={tmp_path / 'hf'}",
        "NATIVE_ENGINE_COMMAND=/py/bin/python3 -m vllm.entrypoints.cli.main"])
    return resolved, {"HOME": str(tmp_path)}


def test_a_trained_model_is_its_own_repo_and_records_its_training(project: Project, tmp_path: Path) -> None:
    resolved, env = settings(project, tmp_path)
    made = trained.make_trained(project, resolved, fake_training(40.0), env)  # type: ignore[arg-type]
    assert made is not None and made.repo == "vllmstack/tiny-qwen3-trained"
    record = json.loads((made.folder / tiny.MODEL_RECORD).read_text())
    assert record["trained"]["final_ppl"] == 40.0 and record["trained"]["random_ppl"] == 1208
    assert tiny.cached_snapshot(tmp_path / "hf", "vllmstack/tiny-qwen3") is None  # the random one is apart
    assert not list(made.folder.parent.glob("*.training.json"))


def test_an_undertrained_model_is_refused_and_nothing_is_cached(project: Project, tmp_path: Path) -> None:
    resolved, env = settings(project, tmp_path)
    with pytest.raises(trained.TrainingError, match=r"perplexity 900\.0") as err:
        trained.make_trained(project, resolved, fake_training(900.0), env)  # type: ignore[arg-type]
    assert "--max-minutes" in (err.value.fix or "")
    assert tiny.cached_snapshot(tmp_path / "hf", "vllmstack/tiny-qwen3-trained") is None
    repo = tiny.hub_repo_folder(tmp_path / "hf", "vllmstack/tiny-qwen3-trained")
    assert not repo.exists() or not any(repo.glob(".making-*"))


def test_dry_run_prints_the_training_command(project: Project, tmp_path: Path) -> None:
    resolved, env = settings(project, tmp_path)
    runner = RecordingRunner(dry_run=True)
    assert trained.make_trained(project, resolved, runner, env) is None  # type: ignore[arg-type]
    assert runner.calls[0][:3] == ("/py/bin/python3", "-m", "vllmstack.models.train_runner")
    assert not (tmp_path / "hf").exists()
