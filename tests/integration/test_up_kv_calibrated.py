"""`invoke up` with an fp8 KV cache and VLLM_KV_SCALES=calibrated, as a user runs it (issue 25,
"ensure" semantics): the first `up` calibrates a copy and serves it, the next keeps it, a changed
checkpoint is measured again before the engine starts, and a zero scale stops `up`.

The engine is the simulator on the native runtime. NATIVE_ENGINE_COMMAND names a stand-in
interpreter: run as `-m vllmstack.models.kv_calibrate_runner` it answers as the real runner does
(amax per attention layer, into the file it is given) and logs the call; run as the engine it
becomes the simulator. The real measurement is test_real_kv_calibration.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT, copy_project, free_port, write_dotenv

from vllmstack.tune.kv_copy import SIDECAR

SIMULATOR = ROOT / "tests" / "simulator" / "server.py"
STANDIN = """
import json, os, sys
args = sys.argv[1:]
if args[:2] == ["-m", "vllmstack.models.kv_calibrate_runner"]:
    source, out = args[2], args[4]
    layers = json.load(open(os.path.join(source, "config.json")))["num_hidden_layers"]
    with open(os.environ["STANDIN_CALLS"], "a") as log:
        log.write(source + "\\n")
    amax = {"k_amax": 9.0, "v_amax": 3.0}
    json.dump({"layers": {f"model.layers.{i}.self_attn": amax for i in range(layers)}, "tokens": 64},
              open(out, "w"))
    sys.exit(0)
os.execv(sys.executable, [sys.executable, SIMULATOR, *args[2:]])  # "-m vllm...": the engine
"""


class Box:
    def __init__(self, tmp_path: Path) -> None:
        self.root = copy_project(tmp_path / "stack")
        bin_dir = tmp_path / "engine" / "bin"
        bin_dir.mkdir(parents=True)
        python = bin_dir / "python3"
        python.write_text(f"#!{sys.executable}\nSIMULATOR = {str(SIMULATOR)!r}\n" + STANDIN)
        python.chmod(0o755)
        self.model = tmp_path / "checkpoint"
        self.model.mkdir()
        (self.model / "config.json").write_text(json.dumps({
            "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2,
            "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "intermediate_size": 768, "max_position_embeddings": 40960, "vocab_size": 1000,
            "torch_dtype": "bfloat16"}))
        (self.model / "model.safetensors").write_bytes(b"weights")
        self.copy = tmp_path / "models" / "calibrated" / "checkpoint-kv-fp8"
        self.calls = tmp_path / "calls.txt"
        self.port = free_port()
        write_dotenv(self.root, {"VLLM_PORT": str(self.port), "OTHER_ENGINE_PORTS": "",
                                 "RUNTIME": "native", "NATIVE_STOP_GRACE": "3",
                                 "NATIVE_ENGINE_COMMAND": f"'{python} -m vllm.entrypoints.cli.main'",
                                 "MODELS_DIR": str(tmp_path / "models")})
        self.home = tmp_path / "home"
        self.home.mkdir()

    def invoke(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "HOME": str(self.home), "STANDIN_CALLS": str(self.calls)}
        return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=self.root, env=env,
                              text=True, capture_output=True, timeout=120, check=False)

    def up(self) -> subprocess.CompletedProcess[str]:
        return self.invoke("up", "--platform", "cpu", "--model", "qwen3-0.6b", "--no-dashboard",
                           "--set", f"VLLM_MODEL={self.model}", "--set", "VLLM_KV_CACHE_DTYPE=fp8",
                           "--set", "VLLM_KV_SCALES=calibrated",
                           "--set", "ENGINE_ENV=SIM_BOOT_SECONDS=0.5")

    def measured(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.is_file() else []

    def served_argv(self) -> list[str]:
        state = json.loads((self.root / "generated" / "state.json").read_text())
        argv: list[str] = state["argv"]
        return argv


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    made = Box(tmp_path)
    yield made
    made.invoke("down", "--timeout", "5")


@pytest.mark.slow  # five `invoke` runs and three boots of the simulator: about 15 s
def test_up_calibrates_serves_the_copy_rebuilds_when_stale_and_refuses_a_zero_scale(box: Box) -> None:
    first = box.up()
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"fp8 KV scales: calibrating {box.copy} (no calibrated copy yet)" in first.stdout
    assert box.measured() == [str(box.model)]
    assert str(box.copy) in box.served_argv() and str(box.model) not in box.served_argv()
    sidecar = json.loads((box.copy / SIDECAR).read_text())
    assert sidecar["scales"]["model.layers.1.self_attn"] == {"k_scale": 9 / 448, "v_scale": 3 / 448}

    again = box.up()
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout + again.stderr
    assert box.measured() == [str(box.model)]  # fresh: not measured again

    # New weights: the next start measures again before the engine starts.
    assert box.invoke("down").returncode == 0
    (box.model / "model.safetensors").write_bytes(b"new weights of another size")
    checked = box.invoke("check", "--platform", "cpu", "--model", "qwen3-0.6b",
                         "--set", f"VLLM_MODEL={box.copy}", "--set", "VLLM_KV_CACHE_DTYPE=fp8")
    assert "kv-calibration-stale" in checked.stdout and "`up` measures them again" in checked.stdout
    stale = box.up()
    assert stale.returncode == 0, stale.stdout + stale.stderr
    assert "(the source snapshot changed" in stale.stdout
    assert box.measured() == [str(box.model)] * 2

    # A zero scale is refused, not measured over.
    assert box.invoke("down").returncode == 0
    sidecar = json.loads((box.copy / SIDECAR).read_text())
    sidecar["scales"]["model.layers.0.self_attn"]["k_scale"] = 0.0
    (box.copy / SIDECAR).write_text(json.dumps(sidecar))
    refused = box.up()
    assert refused.returncode != 0
    assert "unusable KV scales" in refused.stdout + refused.stderr
    assert "model.layers.0.self_attn.k_scale=0.0" in refused.stdout + refused.stderr
    assert box.measured() == [str(box.model)] * 2
    assert not (box.root / "generated" / "state.json").exists()
