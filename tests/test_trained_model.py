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


def fake_training(final_ppl: float, copy_accuracy: float = 0.95) -> RecordingRunner:
    runner = RecordingRunner()

    def train(argv: tuple[str, ...]) -> Result:
        folder, out = Path(argv[3]), Path(argv[5])
        assert (folder / "model.safetensors").is_file()  # the random model, before its snapshot
        out.write_text(json.dumps({"initial_ppl": 1280.0, "final_ppl": final_ppl, "target_ppl": 60.4,
                                   "random_ppl": 1208, "copy_accuracy": copy_accuracy,
                                   "copy_target": 0.9, "steps": 900, "seconds": 300.0}))
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


def test_the_copy_accuracy_is_recorded_beside_the_perplexity(project: Project, tmp_path: Path) -> None:
    # What the recall probe of calibrate-kv --gate can expect of this model.
    resolved, env = settings(project, tmp_path)
    made = trained.make_trained(project, resolved, fake_training(40.0, copy_accuracy=0.4), env)  # type: ignore[arg-type]
    assert made is not None
    record = json.loads((made.folder / tiny.MODEL_RECORD).read_text())["trained"]
    assert (record["copy_accuracy"], record["copy_target"]) == (0.4, 0.9)


def test_the_installed_engine_trains_when_the_profile_names_another(project: Project, tmp_path: Path) -> None:
    # make-model resolves .env's profile (a GPU pin here) but needs only torch: the installed CPU
    # engine's Python does, where before it stopped with "no engine environment for vLLM 0.31.0".
    resolved = resolve(project, model="tiny", overrides=[f"HF_CACHE_DIR={tmp_path / 'hf'}",
                                                         "NATIVE_ENGINE_VERSION=0.31.0"])
    folder = project.cache / "engines" / "vllm-0.32.0+cpu"
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "python").write_text("")
    (folder / "vllmstack-engine.json").write_text(json.dumps({"version": "0.32.0+cpu"}))
    runner = RecordingRunner(dry_run=True)
    trained.make_trained(project, resolved, runner, {"HOME": str(tmp_path)})  # type: ignore[arg-type]
    assert runner.calls[0][0] == str(folder / "bin" / "python")
    from vllmstack.tune.kv_copy import CalibrationError, engine_python
    with pytest.raises(CalibrationError, match=r"0\.31\.0"):  # calibrate-kv measures with the profile's
        engine_python(project, resolved, None)


def test_the_runner_is_found_from_a_project_without_the_package(project: Project, tmp_path: Path) -> None:
    # `project` is a copy of the shipped files without vllmstack/ (as any checkout other than the
    # installed one): PYTHONPATH=<project root> gave "No module named 'vllmstack'" in the engine.
    import vllmstack

    resolved, env = settings(project, tmp_path)
    runner = RecordingRunner(dry_run=True)
    trained.make_trained(project, resolved, runner, env)  # type: ignore[arg-type]
    assert not (project.root / "vllmstack").exists()
    path = (runner.envs[0] or {})["PYTHONPATH"].split(":")
    assert str(Path(vllmstack.__file__).resolve().parents[1]) in path


def test_the_trainer_leaves_stdout_to_the_tasks_json(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str],
                                                     tmp_path: Path) -> None:
    # make-model --trained --json printed the trainer's summary line before its own JSON.
    from vllmstack.models import train_runner

    summary = {"initial_ppl": 1306.3, "final_ppl": 594.3, "copy_accuracy": 0.47, "steps": 9, "seconds": 1.0}
    monkeypatch.setattr(train_runner, "train", lambda *args, **kwargs: summary)
    assert train_runner.main([str(tmp_path), str(tmp_path / "corpus.txt"), str(tmp_path / "out.json")]) == 0
    said = capsys.readouterr()
    assert said.out == "" and json.loads(said.err)["final_ppl"] == 594.3


def test_a_second_clone_takes_the_trained_weights_from_the_build_store(project: Project,
                                                                       tmp_path: Path) -> None:
    from vllmstack.core.store import STORE_VAR

    store = tmp_path / "store"
    resolved, env = settings(project, tmp_path)
    env = {**env, STORE_VAR: str(store)}
    first = fake_training(40.0)
    made = trained.make_trained(project, resolved, first, env)  # type: ignore[arg-type]
    assert made is not None and len(first.calls) == 1
    entries = list((store / "model").glob("tiny-qwen3-trained-*[!nk]"))
    assert len(entries) == 1 and (entries[0] / "model.safetensors").is_file()
    # Another checkout (its own Hugging Face cache): no training, the same snapshot.
    other = resolve(project, model="tiny", platform="cpu", overrides=[
        f"HF_CACHE_DIR={tmp_path / 'hf2'}",
        "NATIVE_ENGINE_COMMAND=/py/bin/python3 -m vllm.entrypoints.cli.main"])
    second = fake_training(40.0)
    again = trained.make_trained(project, other, second, env)
    assert again is not None and second.calls == []
    assert again.folder.name == made.folder.name  # the content hash: the same bytes
    assert json.loads((again.folder / tiny.MODEL_RECORD).read_text())["trained"]["final_ppl"] == 40.0
    # Other training inputs are another entry: a longer budget trains again.
    third = fake_training(40.0)
    trained.make_trained(project, other, third, env, force=True, max_minutes=30.0)
    assert len(third.calls) == 1
