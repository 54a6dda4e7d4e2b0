"""`invoke up` with VLLM_KV_SCALES=calibrated on a container runtime (issue 25): the scales are
measured in a one-off container of the engine service (`compose run --rm --no-deps`), the copy
is written under MODELS_DIR with hard links to the checkpoint's files in the HF cache, and the
engine container serves it.

The engine image is the simulator's, which has no torch: the project copy's
`vllmstack/models/kv_calibrate_runner.py` is replaced by a stand-in that answers as the real one
does (amax per attention layer, read from the config.json at the path it is given, into the file
it is given). Everything else is what a user gets: the mounts, the user, the paths as the
container sees them, the copy, the served command. The real measurement is
test_real_kv_calibration.py's (native) and the source-build image's (benchmarks).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_lifecycle_docker import SIM_IMAGE, Stack, runtime, stack  # noqa: F401 (fixtures)

from vllmstack.tune.kv_copy import SIDECAR

pytestmark = pytest.mark.docker

STANDIN = '''"""Stand-in for the torch measurement (tests/integration/test_kv_calibrated_compose.py)."""
import json, os, sys

source, text, out = sys.argv[1:4]
layers = json.load(open(os.path.join(source, "config.json")))["num_hidden_layers"]
assert open(text).read(), "the calibration text is readable"
amax = {"k_amax": 9.0, "v_amax": 3.0}
json.dump({"layers": {f"model.layers.{i}.self_attn": amax for i in range(layers)}, "tokens": 64,
           "versions": {"where": f"uid {os.getuid()} in {source}"}}, open(out, "w"))
'''


@pytest.fixture
def calibrating(stack: Stack, tmp_path: Path) -> Iterator[tuple[Stack, Path, Path]]:  # noqa: F811
    """The stack with a checkpoint in its HF cache and MODELS_DIR on the same file system."""
    (stack.root / "vllmstack" / "models" / "kv_calibrate_runner.py").write_text(STANDIN)
    hub = stack.root.parent / "cache dir #1" / "huggingface" / "hub" / "models--org--tiny"
    snapshot = hub / "snapshots" / "rev1"
    snapshot.mkdir(parents=True)
    (hub / "refs").mkdir()
    (hub / "refs" / "main").write_text("rev1")
    (snapshot / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 3,
        "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "intermediate_size": 768, "max_position_embeddings": 40960, "vocab_size": 1000,
        "torch_dtype": "bfloat16"}))
    (snapshot / "model.safetensors").write_bytes(b"weights")
    models = tmp_path / "models"
    models.mkdir()
    with (stack.root / ".env").open("a") as env:
        env.write(f"MODELS_DIR={models}\n")
    yield stack, snapshot, models / "calibrated" / "models--org--tiny-kv-fp8"


@pytest.mark.slow  # a measuring container, then the engine's: about 10 s a runtime
def test_up_measures_in_the_engine_container_and_serves_the_copy(
        calibrating: tuple[Stack, Path, Path]) -> None:
    box, snapshot, copy = calibrating
    sets = ("--set", "VLLM_MODEL=org/tiny", "--set", "VLLM_TOKENIZER=org/tiny",
            "--set", "VLLM_KV_CACHE_DTYPE=fp8", "--set", "VLLM_KV_SCALES=calibrated",
            "--set", "ENGINE_ENV=SIM_BOOT_SECONDS=1")
    result = box.up(*sets)
    said = result.stdout + result.stderr
    assert result.returncode == 0, said
    assert f"fp8 KV scales: calibrating {copy} (no calibrated copy yet)" in said
    sidecar = json.loads((copy / SIDECAR).read_text())
    # Measured in the container: the checkpoint at its path under the HF cache mount.
    inside = "/cache/huggingface/hub/models--org--tiny/snapshots/rev1"
    assert sidecar["tool_versions"]["where"].endswith(f"in {inside}")
    assert sidecar["versions"]["image"] == SIM_IMAGE
    assert sidecar["scales"]["model.layers.2.self_attn"] == {"k_scale": 9 / 448, "v_scale": 3 / 448}
    assert (copy / "model.safetensors").samefile(snapshot / "model.safetensors")  # hard-linked
    assert str(copy) in (box.root / "generated" / "vllm-argv.txt").read_text()
    # The engine container reads the copy through MODELS_DIR, its weights included.
    ran = box.invoke("exec", "--", "python3", "-c",
                       f"print(open({str(copy / 'model.safetensors')!r}, 'rb').read())")
    assert ran.returncode == 0 and ran.stdout.strip() == "b'weights'", ran.stdout + ran.stderr
    # Fresh: the next `up` (same command) measures nothing.
    again = box.up(*sets)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout + again.stderr
    assert "calibrating" not in again.stdout
