"""`bench-vs` for real on the native runtime, with the engine simulator as every target's engine.

Each simulator profile gets its own port. The engine command is a wrapper that, before becoming
the simulator, records which of the other profiles' ports answer: "never both resident" is then
read from what each engine saw when it started, not from what bench-vs says about itself.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import sys
from pathlib import Path

import pytest
from helpers import ROOT, copy_project, free_port, write_dotenv

from vllmstack.bench.fleet.vs import VsError, run_bench_vs
from vllmstack.bench.report import history
from vllmstack.core.paths import Project
from vllmstack.serve.state import read_state

SIMULATOR = ROOT / "tests" / "simulator" / "server.py"
WRAPPER = """
import json, os, socket, sys
port = sys.argv[sys.argv.index("--port") + 1]
busy = []
for peer in filter(None, os.environ.get("PEER_PORTS", "").split(",")):
    with socket.socket() as s:
        s.settimeout(0.3)
        if s.connect_ex(("127.0.0.1", int(peer))) == 0 and peer != port:
            busy.append(int(peer))
with open(STARTS, "a") as f:
    f.write(json.dumps({"port": int(port), "busy": busy}) + "\\n")
os.execv(sys.executable, [sys.executable, SIMULATOR, *sys.argv[1:]])
"""
# Fast pacing: bench-vs runs an overhead probe, two shapes and a closed loop per target.
SIM = "SIM_BOOT_SECONDS=0.3 SIM_TTFT_MS=5 SIM_ITL_MS=2 SIM_PREFILL_TPS=200000"


def profile(name: str, port: int, peers: str, tokenizer: Path, extra_env: str = "",
            platforms: str = "cpu") -> str:
    return "\n".join([
        f"PROFILE_DESCRIPTION=simulator {name}", f"PROFILE_PLATFORMS={platforms}",
        f"VLLM_MODEL=sim/{name}", f"VLLM_TOKENIZER={tokenizer}", f"VLLM_SERVED_NAME={name}",
        f"VLLM_PORT={port}", "VLLM_MAX_MODEL_LEN=4096", "VLLM_MAX_NUM_SEQS=8",
        "VLLM_MAX_BATCHED_TOKENS=4096", "VLLM_GPU_MEM_UTIL=0.2",
        f"ENGINE_ENV='{SIM} SIM_TOKENIZER={tokenizer} PEER_PORTS={peers} {extra_env}'",
        "MODEL_KIND=dense", "MODEL_NUM_LAYERS=2", "MODEL_FULL_ATTENTION_LAYERS=2",
        "MODEL_NUM_ATTENTION_HEADS=4", "MODEL_NUM_KV_HEADS=2", "MODEL_HEAD_DIM=64",
        "MODEL_HIDDEN_SIZE=256", "MODEL_INTERMEDIATE_SIZE=768",
        "MODEL_MAX_POSITION_EMBEDDINGS=8192", "MODEL_WEIGHT_GIB=0.01", ""])


class Sims:
    """A project copy whose profiles run the simulator natively (test_burn.py uses it too).

    `platforms` maps each profile to its PROFILE_PLATFORMS; a name containing "crash" crashes at
    boot with vLLM's KV-cache error. `only`: the shipped model profiles are removed."""

    def __init__(self, tmp_path: Path, tokenizer: Path,
                 platforms: dict[str, str] | None = None, *, only: bool = False) -> None:
        platforms = platforms or {"sim-a": "cpu", "sim-b": "cpu", "sim-crash": "cpu"}
        self.root = copy_project(tmp_path / "stack")
        if only:
            for shipped in (self.root / "env" / "models").glob("*.env"):
                shipped.unlink()
        self.starts = tmp_path / "starts.jsonl"
        wrapper = self.root / "engine-wrapper.py"
        wrapper.write_text(f"SIMULATOR = {str(SIMULATOR)!r}\nSTARTS = {str(self.starts)!r}\n"
                           + WRAPPER)
        self.ports = {name: free_port() for name in platforms}
        peers = ",".join(map(str, self.ports.values()))
        for name, port in self.ports.items():
            fault = "SIM_FAULT=crash-at-boot" if "crash" in name else ""
            (self.root / "env" / "models" / f"{name}.env").write_text(
                profile(name, port, peers, tokenizer, fault, platforms[name]))
        command = f"{shlex.quote(sys.executable)} {shlex.quote(str(wrapper))}"
        self.command = command
        write_dotenv(self.root, {"RUNTIME": "native", "PLATFORM": "cpu",
                                 "MODEL_PROFILE": next(iter(platforms)), "OTHER_ENGINE_PORTS": "",
                                 "NATIVE_ENGINE_COMMAND": f"'{command}'",
                                 "NATIVE_STOP_GRACE": "3"})
        # Each profile's own port: .env's host value would win over it.
        dotenv = self.root / ".env"
        dotenv.write_text("".join(line for line in dotenv.read_text().splitlines(keepends=True)
                                  if not line.startswith("VLLM_PORT=")))
        self.home = tmp_path / "home"
        self.home.mkdir()
        self.environ = {**os.environ, "HOME": str(self.home)}
        self.project = Project(self.root)

    def started(self) -> list[dict[str, object]]:
        return [json.loads(line) for line in self.starts.read_text().splitlines()]

    def never_both_resident(self, order: list[str]) -> None:
        """Each profile's engine started in this order, and none found another one's port
        answering when it started."""
        starts = self.started()
        assert [s["port"] for s in starts] == [self.ports[name] for name in order]
        assert all(s["busy"] == [] for s in starts), starts


@pytest.fixture
def sims(tmp_path: Path, tokenizer_file: Path) -> Sims:
    return Sims(tmp_path, tokenizer_file)


def run(sims: Sims, *targets: str) -> tuple[object, str]:
    out = io.StringIO()
    result = run_bench_vs(sims.project, sims.environ, list(targets), ctx=1500, concurrency=3,
                          pp=256, tg=16, runs=2, duration_s=1.0, timeout_s=30, out=out)
    return result, out.getvalue()


@pytest.mark.slow  # three targets brought up and down: about 15 s
def test_two_targets_one_at_a_time_with_complete_rows_and_a_failed_start(sims: Sims) -> None:
    result, log = run(sims, "vllm:sim-a", "vllm:sim-crash", "vllm:sim-b")
    rows = result.rows  # type: ignore[attr-defined]
    assert [r["target"] for r in rows] == ["vllm:sim-a", "vllm:sim-crash", "vllm:sim-b"]
    sims.never_both_resident(["sim-a", "sim-crash", "sim-b"])
    a, crash, b = rows
    for row in (a, b):
        assert row["status"] == "ok", row
        assert row["single"]["tg_tps"]["mean"] > 0 and row["single"]["ttft_ms"]["mean"] > 0
        assert row["ctx"]["tg_tps"]["mean"] > 0 and row["ctx_tokens"] == 1500
        # Exact prompt sizes: the simulator counts with the same tokenizer; the chat template's
        # share is what the 16-token overhead prompts have on top of their 16.
        template = row["overhead"]["prompt_tokens"] - 16
        assert row["ctx"]["prompt_tokens"]["mean"] == 1500 + template
        assert row["single"]["prompt_tokens"]["mean"] == 256 + template
        assert row["conc"]["concurrency"] == 3 and row["conc"]["total_tg_tps"] > 0
        assert row["load_s"] > 0 and row["load_kind"] in ("cold", "warm")
        assert row["vram"] == {"available": False}  # the cpu platform has no GPU to read
        assert row["timings"] == {"single": None, "ctx": None}  # vLLM sends no timings
        assert row["pair_kind"] == "different quantization/checkpoint"
    # The crash is a row with the lifecycle's diagnosis, and its fix; the next target still ran.
    assert crash["status"] == "failed" and crash["load_s"] is None
    assert "out of memory for the KV cache" in crash["diagnosis"]
    assert crash["fix"]
    # Nothing is left running, and the stack's state is clear.
    assert read_state(sims.project) is None
    # JSON history and both markdown files.
    folder = sims.project.results
    (stored,) = history.read_records(history.history_path(folder, "bench-vs"))
    assert stored["status"] == "failed" and len(stored["rows"]) == 3
    results_md = (folder / "bench-vs-results.md").read_text()
    history_md = (folder / "bench-vs-history.md").read_text()
    assert results_md.count("| vLLM · sim/") == 3 and "FAILED: " in results_md
    assert "out of memory for the KV cache" in results_md and "n/a (no GPU)" in results_md
    assert history_md.count("## ") == 1
    assert "[bench-vs 2/3] vllm:sim-crash: failed" in log
    # A second run appends to the history and replaces the results.
    run(sims, "vllm:sim-b")
    assert (folder / "bench-vs-history.md").read_text().count("## ") == 2
    assert (folder / "bench-vs-results.md").read_text().count("| vLLM · sim/") == 1
    assert len(history.read_records(history.history_path(folder, "bench-vs"))) == 2


def test_a_target_whose_engine_prefix_is_not_the_profiles_is_refused_before_anything_starts(
        sims: Sims) -> None:
    with pytest.raises(VsError) as caught:
        run(sims, "vllm:sim-a", "llamacpp:sim-b")
    assert "runs ENGINE=vllm" in caught.value.cause and "llamacpp:sim-b" in caught.value.cause
    assert caught.value.fix and "vllm:sim-b" in caught.value.fix
    assert not sims.starts.exists()
    with pytest.raises(VsError, match="not ENGINE:PROFILE"):
        run(sims, "sim-a")
    with pytest.raises(VsError, match="unknown engine 'sglang'"):
        run(sims, "sglang:sim-a")


# --- the real llama-server of the pinned source against the simulator -----------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, converter_python: str) -> Path:
    """The stack's tiny Qwen3, converted to GGUF (f16) with the pinned converter (which records
    its source beside the file: the pair is then identical weights)."""
    from vllmstack.config.profiles import resolve
    from vllmstack.core.runner import SubprocessRunner
    from vllmstack.models.gguf_convert import gguf_convert
    from vllmstack.models.tiny import make_model

    project = Project(ROOT)
    runner = SubprocessRunner()
    folder = tmp_path_factory.mktemp("tiny")
    made = make_model("tiny", out=folder / "tiny-qwen3")
    resolved = resolve(project, platform="cpu", model="tiny", environ=os.environ)
    done = gguf_convert(project, resolved, runner, model=str(made.folder), environ=os.environ,
                        out=folder / "tiny-qwen3-f16.gguf", stream=False, say=lambda _line: None,
                        python=converter_python)
    return done.path


@pytest.mark.slow  # converts a model and serves it with llama.cpp: about 30 s
def test_vllm_simulator_against_the_real_llama_server_on_identical_weights(
        tmp_path: Path, tiny_gguf: Path, llamacpp_cpu_server: Path) -> None:
    binary = llamacpp_cpu_server
    checkpoint = tiny_gguf.parent / "tiny-qwen3"
    sims = Sims(tmp_path, checkpoint / "tokenizer.json", {"sim-tiny": "cpu"})
    engines = sims.root / ".cache" / "engines"
    engines.mkdir(parents=True)
    (engines / binary.parent.parent.name).symlink_to(binary.parent.parent)
    port = free_port()
    # The shipped twin of `tiny`, pointed at this GGUF; the simulator serves the HF checkpoint.
    twin = (ROOT / "env" / "models" / "tiny-gguf.env").read_text()
    (sims.root / "env" / "models" / "tiny-gguf.env").write_text(
        twin.replace("LLAMACPP_MODEL=tiny-qwen3-f16.gguf", f"LLAMACPP_MODEL={tiny_gguf}")
        + f"VLLM_PORT={port}\n")
    sim = sims.root / "env" / "models" / "sim-tiny.env"
    # The simulator starts second and records whether llama-server still answered then.
    sim.write_text(sim.read_text().replace("VLLM_MODEL=sim/sim-tiny", f"VLLM_MODEL={checkpoint}")
                   .replace(f"PEER_PORTS={sims.ports['sim-tiny']}", f"PEER_PORTS={port}")
                   + f"NATIVE_ENGINE_COMMAND='{sims.command}'\n")
    dotenv = sims.root / ".env"  # the simulator command is sim-tiny's alone
    dotenv.write_text("".join(line for line in dotenv.read_text().splitlines(keepends=True)
                              if not line.startswith("NATIVE_ENGINE_COMMAND=")))
    result, _ = run(sims, "llamacpp:tiny-gguf", "vllm:sim-tiny")
    llama, vllm_row = result.rows  # type: ignore[attr-defined]
    assert vllm_row["status"] == "ok" and llama["status"] == "ok", llama
    assert llama["checkpoint"]["label"] == "tiny-qwen3-f16.gguf (F16)"
    assert vllm_row["pair_kind"] == llama["pair_kind"] == "identical weights"
    # llama-server's window is per slot (/props), and its own timings ride along.
    assert (llama["window"], llama["slots"]) == (8192, 8)  # one unified KV pool of 8192
    for shape in ("single", "ctx"):
        assert llama["timings"][shape]["predicted_per_second"] > 0
        assert llama["timings"][shape]["prompt_per_second"] > 0
        # llama.cpp's chunks come a few at a time at ~3,000 t/s: that is a decode rate, not a
        # held stream (two CI runs on 2026-12-03 lost it to a median-gap burst test).
        assert llama[shape]["tg_tps"] is not None, (llama["timings"], llama[shape])
        assert llama[shape]["tg_tps"]["mean"] > 0 and llama[shape]["errors"] == 0
    assert llama["conc"]["errors"] == 0 and llama["conc"]["total_tg_tps"] > 0
    # The same prompt sizes, counted by each engine's own tokenizer (the same vocabulary here).
    assert llama["ctx"]["prompt_tokens"]["mean"] - llama["overhead"]["prompt_tokens"] == 1500 - 16
    assert sims.started() == [{"port": sims.ports["sim-tiny"], "busy": []}]  # llama-server gone
    assert read_state(sims.project) is None


# --- a newcomer's bench-vs (issue 23) ------------------------------------------------------------


def test_a_run_that_measured_nothing_is_not_added_to_the_history(sims: Sims) -> None:
    result, log = run(sims, "vllm:sim-crash")
    assert result.failed and result.written == []  # type: ignore[attr-defined]
    assert "nothing was added to the history" in log
    assert not history.history_path(sims.project.results, "bench-vs").exists()
    assert not (sims.project.results / "bench-vs-history.md").exists()


def test_without_platform_the_targets_own_platform_is_used(sims: Sims) -> None:
    """.env says 2xr9700 (as .env.example does); every target is made for cpu only."""
    dotenv = sims.root / ".env"
    dotenv.write_text(dotenv.read_text().replace("PLATFORM=cpu", "PLATFORM=2xr9700"))
    result, log = run(sims, "vllm:sim-a")
    assert [r["status"] for r in result.rows] == ["ok"]  # type: ignore[attr-defined]
    assert result.record["platform"] == "cpu"  # type: ignore[attr-defined]
    assert "platform cpu: every target is made for it" in log and "2xr9700" in log
