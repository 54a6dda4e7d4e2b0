"""What `up` serves when the KV cache is fp8 and the scales are calibrated ("ensure" semantics,
issue 25): the copy is made when missing, kept when fresh, rebuilt when its source changed, and a
zero scale is refused rather than measured over. The measurement is a stand-in here (it answers
as kv_calibrate_runner does); tests/integration/test_real_kv_calibration.py measures for real."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import write_checkpoint

from vllmstack.checks.registry import run_checks
from vllmstack.config.profiles import Resolved, resolve
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.runtime.base import Beside
from vllmstack.runtime.compose_files import container_path
from vllmstack.runtime.engine_env import stack_paths
from vllmstack.runtime.native.beside import native_beside
from vllmstack.tune import kv_copy as kv

PYTHON = "/opt/engine/bin/python3"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "m")


class Measure:
    """Answers `python -m vllmstack.models.kv_calibrate_runner SOURCE TEXT OUT` with amax values."""

    def __init__(self, amax: float = 4.0) -> None:
        self.amax = amax
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: tuple[str, ...]) -> Result:
        self.calls.append(argv)
        layers = {f"model.layers.{i}.self_attn": {"k_amax": self.amax * (i + 1), "v_amax": self.amax}
                  for i in range(2)}
        Path(argv[5]).write_text(json.dumps({"layers": layers, "tokens": 123}))
        return Result(argv, 0)


def profile(project: Project, model: Path, tmp_path: Path, *sets: str) -> Resolved:
    return resolve(project, model="tiny", platform="cpu", overrides=[
        f"VLLM_MODEL={model}", f"MODELS_DIR={tmp_path / 'models'}", "VLLM_KV_CACHE_DTYPE=fp8",
        f"NATIVE_ENGINE_COMMAND={PYTHON} -m vllm.entrypoints.cli.main", *sets])


def in_container(resolved: Resolved, tmp_path: Path, runner: RecordingRunner) -> Beside:
    """The engine container's view of the host (compose_files.container_path, as ComposeEngine's
    beside has it), measuring through `runner`."""
    paths = stack_paths(resolved, {"HOME": str(tmp_path)})
    return Beside({"image": "img"}, runner.dry_run, lambda path: container_path(path, paths),
                  lambda args, _writable, _timeout: runner.run(["python3", *args]))


def serve(project: Project, resolved: Resolved, tmp_path: Path, measure: Measure,
          container: bool = False) -> tuple[Resolved, list[str]]:
    runner = RecordingRunner()
    runner.respond([PYTHON], measure)
    runner.respond(["python3"], measure)
    said: list[str] = []
    env = {"HOME": str(tmp_path)}
    where = (in_container(resolved, tmp_path, runner) if container
             else native_beside(project, resolved, env, runner))
    served = kv.served_model(project, resolved, env, beside=lambda: where, say=said.append)
    return served, said


def findings(project: Project, resolved: Resolved, tmp_path: Path, runtime: str = "native") -> dict[str, str]:
    found, _ = run_checks(project, resolved, {"HOME": str(tmp_path)}, runtime=runtime)
    return {f.code: f.severity for f in found if f.code.startswith("kv-")}


def test_calibrated_is_made_once_served_and_kept_while_fresh(project: Project, model: Path,
                                                              tmp_path: Path) -> None:
    resolved = profile(project, model, tmp_path, "VLLM_KV_SCALES=calibrated")
    measure = Measure()
    served, said = serve(project, resolved, tmp_path, measure)
    copy = tmp_path / "models" / "calibrated" / "m-kv-fp8"
    assert served.get("VLLM_MODEL") == str(copy)
    assert "VLLM_KV_SCALES=calibrated" in (served.source("VLLM_MODEL") or "")
    assert len(measure.calls) == 1 and measure.calls[0][3] == str(model)
    assert "no calibrated copy yet" in said[0]
    sidecar = kv.read_sidecar(copy)
    assert sidecar is not None and sidecar["scales"]["model.layers.1.self_attn"]["k_scale"] == 8 / 448
    assert (copy / "model.safetensors").samefile(model / "model.safetensors")  # linked, not copied
    # The served profile passes the checks `up` runs: no stale, no default-scale warning.
    assert findings(project, served, tmp_path) == {}

    again, said = serve(project, resolved, tmp_path, measure)
    assert again.get("VLLM_MODEL") == str(copy) and len(measure.calls) == 1
    assert said == [f"fp8 KV scales: serving the calibrated copy {copy} (fresh)"]


def test_a_changed_source_is_measured_again_before_serving(project: Project, model: Path,
                                                           tmp_path: Path) -> None:
    resolved = profile(project, model, tmp_path, "VLLM_KV_SCALES=calibrated")
    measure = Measure()
    serve(project, resolved, tmp_path, measure)
    (model / "model.safetensors").write_bytes(b"new weights, another size")
    measure.amax = 2.0
    served, said = serve(project, resolved, tmp_path, measure)
    assert len(measure.calls) == 2
    assert "the source snapshot changed" in said[0]
    sidecar = kv.read_sidecar(Path(served.get_str("VLLM_MODEL")))
    assert sidecar is not None and sidecar["scales"]["model.layers.0.self_attn"]["v_scale"] == 2 / 448


def test_a_copy_named_as_the_model_is_rebuilt_in_place_when_stale(project: Project, model: Path,
                                                                  tmp_path: Path) -> None:
    """The hand-written form calibrate-kv printed before: VLLM_MODEL=<the copy>."""
    measure = Measure()
    made, _ = serve(project, profile(project, model, tmp_path, "VLLM_KV_SCALES=calibrated"),
                    tmp_path, measure)
    copy = Path(made.get_str("VLLM_MODEL"))
    direct = profile(project, copy, tmp_path)
    # `check` alone says what `up` will do; it is not an error on the native runtime.
    (model / "model.safetensors").write_bytes(b"retrained")
    assert findings(project, direct, tmp_path) == {"kv-calibration-stale": "warning"}
    served, said = serve(project, direct, tmp_path, measure)
    assert served is direct and len(measure.calls) == 2 and "source snapshot changed" in said[0]
    assert findings(project, direct, tmp_path) == {}
    _, said = serve(project, direct, tmp_path, measure)
    assert len(measure.calls) == 2 and said == [f"fp8 KV scales: {copy} is fresh"]


def test_a_zero_scale_is_refused_not_measured_over(project: Project, model: Path, tmp_path: Path) -> None:
    measure = Measure()
    made, _ = serve(project, profile(project, model, tmp_path, "VLLM_KV_SCALES=calibrated"),
                    tmp_path, measure)
    copy = Path(made.get_str("VLLM_MODEL"))
    sidecar = json.loads((copy / kv.SIDECAR).read_text())
    sidecar["scales"]["model.layers.1.self_attn"]["v_scale"] = 0.0
    (copy / kv.SIDECAR).write_text(json.dumps(sidecar))
    (model / "model.safetensors").write_bytes(b"retrained")  # stale too: still not re-measured
    for resolved in (profile(project, copy, tmp_path),
                     profile(project, model, tmp_path, "VLLM_KV_SCALES=calibrated")):
        served, _ = serve(project, resolved, tmp_path, measure)
        assert len(measure.calls) == 1
        assert findings(project, served, tmp_path)["kv-scales-unusable"] == "error"


def test_in_a_container_the_copy_goes_under_models_dir_with_hard_links(project: Project, model: Path,
                                                                        tmp_path: Path) -> None:
    resolved = profile(project, model, tmp_path, "VLLM_KV_SCALES=calibrated")
    measure = Measure()
    # The checkpoint (tmp_path/m) is outside every mount: the container cannot read it.
    with pytest.raises(kv.CalibrationError, match="does not see") as err:
        serve(project, resolved, tmp_path, measure, container=True)
    assert "MODELS_DIR" in (err.value.fix or "") and measure.calls == []
    inside = tmp_path / "models" / "checkpoint"
    shutil.copytree(model, inside)
    resolved = profile(project, inside, tmp_path, "VLLM_KV_SCALES=calibrated")
    served, _ = serve(project, resolved, tmp_path, measure, container=True)
    copy = tmp_path / "models" / "calibrated" / "checkpoint-kv-fp8"
    assert served.get("VLLM_MODEL") == str(copy) and measure.calls[0][3] == str(inside)
    assert (copy / "model.safetensors").samefile(inside / "model.safetensors")
    # Without MODELS_DIR the copy would land where no container sees it: `check` stops `up`.
    unmounted = resolve(project, model="tiny", platform="cpu", overrides=[
        f"VLLM_MODEL={model}", "VLLM_KV_CACHE_DTYPE=fp8", "VLLM_KV_SCALES=calibrated"])
    assert findings(project, unmounted, tmp_path, runtime="compose") == {
        "kv-calibration-needs-models-dir": "error", "kv-calibration-served": "info"}


def test_a_copy_whose_links_a_container_cannot_follow_is_refused(
        project: Project, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hard links fail across file systems; the symbolic links then name host paths."""
    inside = tmp_path / "models" / "checkpoint"
    shutil.copytree(model, inside)

    def cross_device(*_args: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    resolved = profile(project, inside, tmp_path, "VLLM_KV_SCALES=calibrated")
    served, _ = serve(project, resolved, tmp_path, Measure())  # natively a symbolic link is fine
    copy = Path(served.get_str("VLLM_MODEL"))
    assert (copy / "model.safetensors").is_symlink()
    # A container sees MODELS_DIR at its own path, so links into it are followed there too...
    serve(project, resolved, tmp_path, Measure(), container=True)
    # ...but not links into the HF cache, which it mounts elsewhere.
    hub = tmp_path / ".cache" / "huggingface" / "hub" / "models--org--m" / "snapshots" / "abc"
    shutil.copytree(model, hub)
    (tmp_path / ".cache" / "huggingface" / "hub" / "models--org--m" / "refs").mkdir()
    (tmp_path / ".cache" / "huggingface" / "hub" / "models--org--m" / "refs" / "main").write_text("abc")
    from_hub = profile(project, Path("org/m"), tmp_path, "VLLM_KV_SCALES=calibrated")
    with pytest.raises(kv.CalibrationError, match="cannot follow the links") as err:
        serve(project, from_hub, tmp_path, Measure(), container=True)
    assert "file system of the HF cache" in (err.value.fix or "")


def test_calibrated_with_another_kv_dtype_or_a_replaced_config_is_refused(project: Project, model: Path,
                                                                         tmp_path: Path) -> None:
    bf16 = profile(project, model, tmp_path, "VLLM_KV_SCALES=calibrated", "VLLM_KV_CACHE_DTYPE=bfloat16")
    assert findings(project, bf16, tmp_path) == {"kv-scales-not-fp8": "error"}
    served, _ = serve(project, bf16, tmp_path, Measure())
    assert served is bf16  # nothing measured; the check stops `up`
    replaced = profile(project, model, tmp_path, "VLLM_KV_SCALES=calibrated",
                       f"VLLM_HF_CONFIG_PATH={tmp_path}")
    assert findings(project, replaced, tmp_path)["kv-scales-config-replaced"] == "error"


def test_without_calibrated_nothing_changes(project: Project, model: Path, tmp_path: Path) -> None:
    resolved = profile(project, model, tmp_path)
    measure = Measure()
    served, said = serve(project, resolved, tmp_path, measure)
    assert served is resolved and measure.calls == [] and said == []
    # The default-scale warning names the setting that fixes it.
    found, _ = run_checks(project, resolved, {"HOME": str(tmp_path)}, runtime="native")
    warning = next(f for f in found if f.code == "kv-scales-default")
    assert "VLLM_KV_SCALES=calibrated" in (warning.fix or "")


def test_dry_run_prints_the_measurement_and_serves_the_copy_path(project: Project, model: Path,
                                                                 tmp_path: Path) -> None:
    resolved = profile(project, model, tmp_path, "VLLM_KV_SCALES=calibrated")
    env = {"HOME": str(tmp_path)}
    runner = RecordingRunner(dry_run=True)  # what a dry runner is given is printed, not run
    said: list[str] = []
    dry = native_beside(project, resolved, env, runner)
    served = kv.served_model(project, resolved, env, beside=lambda: dry, say=said.append)
    assert [c[:3] for c in runner.calls] == [(PYTHON, "-m", "vllmstack.models.kv_calibrate_runner")]
    assert not (tmp_path / "models" / "calibrated").exists()
    # No copy to check or serve yet: `up --dry-run` goes on with the source, and says so.
    assert served is resolved
    copy = tmp_path / "models" / "calibrated" / "m-kv-fp8"
    assert "calibrating" in said[0] and f"once measured, {copy} is served" in said[1]
    # A stale copy that exists: the dry run shows the engine on it (its checks warn it is stale).
    serve(project, resolved, tmp_path, Measure())
    (model / "model.safetensors").write_bytes(b"retrained")
    runner = RecordingRunner(dry_run=True)
    dry = native_beside(project, resolved, env, runner)
    served = kv.served_model(project, resolved, env, beside=lambda: dry, say=said.append)
    assert served.get("VLLM_MODEL") == str(copy) and len(runner.calls) == 1


def test_a_measurement_stopped_midway_leaves_no_work_folder_and_no_copy(
        project: Project, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`down` stops a booting `up` with SIGTERM, which may land while the scales are measured."""
    import tempfile

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))

    def stopped(argv: tuple[str, ...]) -> Result:
        raise KeyboardInterrupt  # what a signal raises where the runner waits

    runner = RecordingRunner()
    runner.respond([PYTHON], stopped)
    resolved = profile(project, model, tmp_path, "VLLM_KV_SCALES=calibrated")
    env = {"HOME": str(tmp_path)}
    where = native_beside(project, resolved, env, runner)
    with pytest.raises(KeyboardInterrupt):
        kv.served_model(project, resolved, env, beside=lambda: where, say=lambda _: None)
    assert list(scratch.iterdir()) == []
    assert not (tmp_path / "models" / "calibrated" / "m-kv-fp8").exists()
