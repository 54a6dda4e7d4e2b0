"""`invoke make-model --trained`: the tiny Qwen3, trained on the bundled corpus until its held-out
perplexity is far below random, so activations, perplexity, recall and KV scales mean something.

The random model is written as `make-model` writes it, then `train_runner.py` trains it in place
in the engine's Python (torch and transformers; the CPU engine's environment has both), before
the files are hashed into their snapshot: the trained model is its own repo,
`vllmstack/tiny-qwen3-trained`, and the random one stays. The training's numbers go into the
model's own record (vllmstack-model.json, "trained"); a run that does not get below the target
is refused, so a "trained" model is never a random one.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllmstack.config.profiles import Resolved
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.core.store import Key, open_store
from vllmstack.image.sources import file_sha256
from vllmstack.models import tiny
from vllmstack.runtime.engine_env import stack_paths
from vllmstack.runtime.native.beside import runner_environment
from vllmstack.tune.kv_copy import DEFAULT_CORPUS, engine_python

TRAINED_SUFFIX = "-trained"
# Held-out perplexity below half the vocabulary (random guessing scores all of it). The bundled
# corpus is about 6,000 tokens: a unigram count of its training part scores 44 % on the held-out
# tenth, and a 2 M parameter model memorizes it within a hundred steps, after which held-out
# perplexity rises (benchmarks/2026-12-01-kv-calibration.md). The copy (a random needle recalled
# from COPY_CONTEXT tokens back, the recall probe's task) is trained for and recorded, and stops
# training early at COPY_TARGET; on 2 CPU cores it does not form within minutes, so it is not
# required here.
TARGET_RATIO = 0.5
COPY_TARGET = 0.9


class TrainingError(StackError):
    """The model could not be trained far enough; `fix` says what to do."""


def train_argv(python: str, folder: Path, corpus: Path, out: Path, *, max_minutes: float,
               max_steps: int) -> list[str]:
    return [python, "-m", "vllmstack.models.train_runner", str(folder), str(corpus), str(out),
            "--max-minutes", str(max_minutes), "--max-steps", str(max_steps),
            "--target-ratio", str(TARGET_RATIO), "--copy-target", str(COPY_TARGET)]


def record_training(folder: Path, result: Mapping[str, Any]) -> None:
    """Refuse an undertrained model; note the numbers in the model's record."""
    final, target = float(result.get("final_ppl", "inf")), float(result.get("target_ppl", 0))
    if not final < target:
        raise TrainingError(
            f"training stopped at held-out perplexity {final:.1f} after {result.get('steps')} steps "
            f"({result.get('seconds')} s); the target is below {target:.1f} "
            f"(random: {result.get('random_ppl')})",
            "give it more time (--max-minutes), or train where the engine has a GPU")
    record_path = folder / tiny.MODEL_RECORD
    record = json.loads(record_path.read_text())
    record["trained"] = {k: result[k] for k in ("initial_ppl", "final_ppl", "target_ppl", "random_ppl",
                                                  "copy_accuracy", "copy_target", "copy_context", "steps",
                                                  "kept_step", "seconds", "train_tokens", "heldout_tokens",
                                                  "versions") if k in result}
    record_path.write_text(json.dumps(record, indent=1) + "\n")


def make_trained(project: Project, resolved: Resolved, runner: Runner, environ: Mapping[str, str], *,
                 preset: str = "tiny", out: Path | None = None, force: bool = False,
                 python: str | None = None, max_minutes: float = 20.0,
                 max_steps: int = 3000) -> tiny.MadeModel | None:
    """Make and train; None in --dry-run (the training command was printed)."""
    geometry = tiny.PRESETS.get(preset)
    if geometry is None:
        raise TrainingError(f"unknown model preset {preset!r}", f"use one of: {', '.join(tiny.PRESETS)}")
    interpreter = engine_python(project, resolved, python, any_installed=True)
    env = runner_environment(resolved, environ)
    if runner.dry_run:
        runner.run(train_argv(interpreter, Path("<new model>"), DEFAULT_CORPUS, Path("<result.json>"),
                              max_minutes=max_minutes, max_steps=max_steps), env=env, cwd=project.root)
        return None

    def train(folder: Path) -> None:
        result_path = folder.parent / f"{folder.name}.training.json"
        try:
            done = runner.run(train_argv(interpreter, folder, DEFAULT_CORPUS, result_path,
                                         max_minutes=max_minutes, max_steps=max_steps),
                              env=env, cwd=project.root, timeout=max_minutes * 60 + 600, capture=False)
            if not result_path.is_file():
                raise TrainingError(f"the training wrote no result (exit {done.returncode})",
                                    "its output is above; the engine's Python needs torch and transformers")
            record_training(folder, json.loads(result_path.read_text()))
        finally:
            result_path.unlink(missing_ok=True)

    store = open_store(environ)
    if store is not None:
        key = trained_key(preset, interpreter, max_minutes=max_minutes, max_steps=max_steps)

        def train_or_reuse(folder: Path) -> None:
            def build(target: Path) -> None:
                train(folder)
                shutil.copytree(folder, target)

            made = store.ensure(key, build, files=TRAINED_FILES, force=force)
            if made.reused:  # the training this machine did before, for the same inputs
                print(f"vllmstack: the trained weights from the build store ({made.path})",
                      file=sys.stderr)
                for path in made.path.iterdir():
                    shutil.copy2(path, folder / path.name)
        post = train_or_reuse
    else:
        post = train
    hf_cache = None if out is not None else stack_paths(resolved, environ).hf_cache
    return tiny.make_model(preset, hf_cache=hf_cache, out=out, force=force,
                           repo=geometry.repo + TRAINED_SUFFIX, post=post)


# What a training's result depends on, beside its arguments: the trainer and the model writer (a
# change to either is another entry; the safetensors writer is core's, hence ../core) and the corpus.
TRAINER_SOURCES = ("train_runner.py", "trained.py", "tiny.py", "../core/safetensors_file.py")
TRAINED_FILES = ("model.safetensors", tiny.MODEL_RECORD, "config.json")


def trained_key(preset: str, interpreter: str, *, max_minutes: float, max_steps: int) -> Key:
    here = Path(__file__).parent
    return Key("model", f"{tiny.PRESETS[preset].repo.split('/')[-1]}{TRAINED_SUFFIX}", {
        "preset": preset, "max_minutes": max_minutes, "max_steps": max_steps,
        "target_ratio": TARGET_RATIO, "copy_target": COPY_TARGET,
        "corpus_sha256": file_sha256(DEFAULT_CORPUS),
        "trainer_sha256": [file_sha256(here / name) for name in TRAINER_SOURCES],
        # The engine environment it trains in (its torch): the folder, resolved through a
        # checkout's link into the store.
        "python": str(Path(interpreter).parent.parent.resolve() / "bin" / Path(interpreter).name)})
