"""The stack against a real vLLM engine: vLLM's CPU build serving the tiny model the stack makes.

Everything else in the suite runs against the engine simulator; these tests run the real thing,
the way a user without a GPU does it (README, "CPU quick start"):

    invoke install-engine --platform cpu      # .cache/engines/vllm-0.32.0+cpu, made once
    invoke make-model                         # vllmstack/tiny-qwen3 into the HF cache
    invoke up --runtime native --platform cpu --model tiny

then status, bench (side by side with `vllm bench serve` from the same install), the thinkoff
and prefix-cache probes, stability smoke, down, and two real boot failures that `up` must
diagnose. The engine environment is provisioned by the test itself, cached in this checkout's
.cache/engines keyed by version (the first run installs it: 2.5 to 8 minutes, 3.4 GB), and the
compile cache in .cache/real-engine-tests, so later runs boot faster.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import need
from helpers import ROOT, copy_project, free_port, write_dotenv

from vllmstack.image.cpu import is_cpu_build
from vllmstack.runtime.native.install import engine_dir, read_manifest

pytestmark = [pytest.mark.slow, pytest.mark.real_engine]
ENGINE_VERSION = "0.32.0+cpu"  # env/platforms/cpu.env
INSTALL_TIMEOUT_S = 1500
BOOT_TIMEOUT_S = 600
# `invoke bench` and `vllm bench serve` measure the same server within this share (issue 16).
AGREE = 0.05


def provision_engine() -> Path:
    """The CPU engine's environment in this checkout's .cache, installed when it is missing."""
    from vllmstack.core.paths import Project

    folder = engine_dir(Project(ROOT), ENGINE_VERSION)
    if read_manifest(folder) is None:
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "invoke", "install-engine", "--platform", "cpu"],
                                cwd=ROOT, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,
                                check=False)
        print(f"install-engine --platform cpu: {time.monotonic() - started:.0f} s")
        need(result.returncode == 0, "vLLM's CPU build (invoke install-engine --platform cpu failed: "
             + (result.stderr.strip().splitlines() or ["?"])[-1] + ")")
    return folder


@dataclass
class Stack:
    root: Path
    home: Path
    port: int
    engine: Path  # the engine environment

    def invoke(self, *args: str, timeout: float = 300,
               cpus: set[int] | None = None) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "HOME": str(self.home)}
        return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=self.root, env=env,
                              text=True, capture_output=True, timeout=timeout, check=False,
                              preexec_fn=pin_to(cpus))

    def must(self, *args: str, timeout: float = 300,
             cpus: set[int] | None = None) -> subprocess.CompletedProcess[str]:
        result = self.invoke(*args, timeout=timeout, cpus=cpus)
        said = f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        assert result.returncode == 0, f"invoke {' '.join(args)}:\n{said}"
        return result

    def answers(self) -> bool:
        with socket.socket() as sock:
            sock.settimeout(1)
            return sock.connect_ex(("127.0.0.1", self.port)) == 0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    engine = provision_engine()
    assert is_cpu_build(ENGINE_VERSION)
    base = tmp_path_factory.mktemp("real-cpu")
    root = copy_project(base / "stack")
    # The environment is big: the copy links to the checkout's (a venv's paths are absolute).
    (root / ".cache" / "engines").mkdir(parents=True)
    (root / ".cache" / "engines" / engine.name).symlink_to(engine)
    home = base / "home"
    home.mkdir()
    port = free_port()
    write_dotenv(root, {
        "PLATFORM": "cpu", "MODEL_PROFILE": "tiny", "RUNTIME": "native", "VLLM_PORT": str(port),
        "OTHER_ENGINE_PORTS": "", "DASHBOARD_PORT": str(free_port()),
        # Compile caches survive the run (keyed by engine version inside), so boots get faster.
        "HOST_CACHE_DIR": str(ROOT / ".cache" / "real-engine-tests"), "UP_TIMEOUT": str(BOOT_TIMEOUT_S),
        # The made model goes where the bench client looks for tokenizers (HF_HOME, else ~/.cache).
        "HF_CACHE_DIR": str(home / ".cache" / "huggingface")})
    made = Stack(root, home, port, engine)
    made.must("make-model")
    yield made
    made.invoke("down", timeout=120)


@pytest.fixture(scope="module")
def served(stack: Stack) -> Iterator[Stack]:
    started = time.monotonic()
    stack.must("up", "--no-dashboard", timeout=BOOT_TIMEOUT_S + 60)
    print(f"up (healthy and warmed up): {time.monotonic() - started:.0f} s")
    yield stack


def test_up_status_serves_the_made_model(served: Stack) -> None:
    status = json.loads(served.must("status", "--json").stdout)
    text = json.dumps(status)
    assert status.get("runtime") == "native" and '"tiny"' in text
    assert "healthy" in text.lower()
    # The boot `up` waited for, phase by phase from the real engine's log (issue 38).
    boot = status["boot"]
    assert boot["engine"] == "vllm" and boot["complete"] and boot["compile"] in ("cold", "warm")
    assert abs(boot["sum_s"] - boot["wall_s"]) <= 0.05 * boot["wall_s"]
    names = {p["name"] for p in boot["phases"]}
    assert {"starting", "parsing arguments", "loading weights", "compiling", "warm-up"} <= names
    startup = json.loads(served.must("startup", "--json").stdout)
    assert startup["source"] == "generated/state.json" and startup["phases"] == boot["phases"]


def made_snapshot(stack: Stack) -> Path:
    """The made tiny model's folder in the stack's HF cache (its tokenizer serves both clients)."""
    return next((stack.home / ".cache" / "huggingface" / "hub" / "models--vllmstack--tiny-qwen3"
                 / "snapshots").iterdir())


def vllm_bench_serve(stack: Stack, out: Path, pp: int, tg: int, prompts: int, *, seed: int,
                     url: str | None = None, cpus: set[int] | None = None) -> dict[str, float]:
    """`vllm bench serve` from the engine's own install, at concurrency 1.

    Every call needs its own --seed: the random dataset is seeded, so a repeat sends the same
    prompts and, with prefix caching on, measures cached prefills (seen here: 256 of 268 prompt
    tokens hit, TTFT 13 ms against 20 ms uncached). Its initial test request repeats prompt 0 as
    well, so one of the measured prompts is always cached: compare medians, not means. And
    greedy, as `invoke bench` asks: the server's default sampling costs this CPU engine about
    13 % of its decode rate."""
    name = f"vllm-{seed}.json"
    argv = [str(stack.engine / "bin" / "vllm"), "bench", "serve", "--backend", "openai-chat",
            "--base-url", url or f"http://127.0.0.1:{stack.port}", "--endpoint", "/v1/chat/completions",
            "--model", "tiny", "--tokenizer", str(made_snapshot(stack)), "--dataset-name", "random",
            "--random-input-len", str(pp), "--random-output-len", str(tg), "--num-prompts", str(prompts),
            "--max-concurrency", "1", "--ignore-eos", "--seed", str(seed), "--temperature", "0",
            "--save-result", "--result-dir", str(out), "--result-filename", name]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False,
                            env={**os.environ, "HOME": str(stack.home), "HF_HUB_OFFLINE": "1"},
                            preexec_fn=pin_to(cpus))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    data = json.loads((out / name).read_text())
    assert data["completed"] == prompts and data["failed"] == 0
    return {"ttft_ms": data["median_ttft_ms"], "tg_tps": 1000.0 / data["median_tpot_ms"],
            "prompt_tokens": data["total_input_tokens"] / prompts,
            "completion_tokens": data["total_output_tokens"] / prompts}


def paired_clients(stack: Stack, out: Path, pp: int, tg: int, pairs: int,
                   cpus: set[int] | None, mode: str = "shared") -> dict[str, Any]:
    """paired_clients.py in the engine's python: both clients on one shared stream per pair
    (`shared`), or one request each in turns (`turns`)."""
    record = out / f"paired-{mode}.json"
    argv = [str(stack.engine / "bin" / "python"), str(Path(__file__).with_name("paired_clients.py")),
            f"http://127.0.0.1:{stack.port}", "tiny", str(made_snapshot(stack) / "tokenizer.json"),
            str(pp), str(tg), str(pairs), str(record), mode]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
                            preexec_fn=pin_to(cpus))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    data: dict[str, Any] = json.loads(record.read_text())
    return data


def invoke_bench(stack: Stack, pp: int, tg: int, runs: int, *extra: str,
                 cpus: set[int] | None = None) -> dict[str, Any]:
    result = stack.must("bench", "--pp", str(pp), "--tg", str(tg), "--runs", str(runs), "--json",
                        *extra, timeout=600, cpus=cpus)
    [row] = json.loads(result.stdout)["results"]
    assert row["errors"] == 0 and row["requests"] == runs
    return {"ttft_ms": row["ttft_ms"]["p50"], "tg_tps": row["tg_tps"]["p50"],
            "prompt_tokens": row["prompt_tokens"]["mean"],
            "completion_tokens": row["completion_tokens"]["mean"]}


def pin_to(cpus: set[int] | None) -> Any:
    return None if not cpus else (lambda: os.sched_setaffinity(0, cpus))


def engine_processes(stack: Stack) -> dict[int, str]:
    """pid -> name of every process of the engine's session (engine.json's pid leads it)."""
    leader = json.loads((stack.root / "generated" / "native" / "engine.json").read_text())["pid"]
    found: dict[int, str] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        if int(rest[3]) == leader:  # field 6, the session id
            found[int(stat.parent.name)] = name
    return found


def place_engine_for_measurement(stack: Stack) -> set[int] | None:
    """Give the API server and the clients their own core; the CPUs left for the clients.

    vLLM's CPU backend binds its worker's OpenMP threads to some cores and leaves the rest to
    its engine-core process, whose readers busy-wait (sched_yield) on the shared-memory queue.
    The API server floats; when the kernel puts it beside that busy-waiting process it runs
    only between steps, and a whole answer can arrive in one burst at the end (seen on this
    2-core machine: TTFT 250-400 ms and "500,000 t/s" for some requests of either client, at
    random). So for the comparison the engine core joins the worker's cores, and the API
    server and both clients share the others: measured stable to about 10 % per round."""
    processes = engine_processes(stack)
    workers = [pid for pid, name in processes.items() if name.startswith("VLLM::Worker")]
    everything = os.sched_getaffinity(0)
    engine_cpus = os.sched_getaffinity(workers[0]) if workers else set()
    rest = everything - engine_cpus
    if not workers or not rest:
        return None
    for pid, name in processes.items():
        if name.startswith("VLLM::Worker"):
            continue
        target = engine_cpus if name.startswith("VLLM::EngineCor") else rest
        with contextlib.suppress(OSError):  # a process or thread that ended meanwhile
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(task.name), target)
    return rest


def test_bench_agrees_with_vllm_bench_serve_on_a_paced_server(stack: Stack, tmp_path: Path) -> None:
    """The two clients' definitions, without a noisy machine in the way: the engine simulator
    paces the stream exactly (first token after 150 ms + prompt at 10,000 t/s, then one token
    every 5 ms), and `vllm bench serve` from the real install measures it beside `invoke bench`.
    Both must agree within 5 % on TTFT and decode, and both must read the pacing.

    The first token waits 150 ms, not 30: what either client adds to TTFT on this 2-core
    machine is a few milliseconds whatever the pacing (a CI run: 59.0 and 62.5 ms against 56.8
    paced at 30 ms, 5.7 % apart), so the pacing has to dwarf it for 5 % to test definitions."""
    from simulator.fixture import run_simulator, sim_env

    snapshot = made_snapshot(stack)
    pp, tg, runs = 256, 128, 8
    env = sim_env(snapshot / "tokenizer.json", ttft_ms=150.0, prefill_tps=10000.0, itl_ms=5.0)
    with run_simulator(env=env, argv=["--served-model-name", "tiny", "--max-model-len", "4096",
                                      "--max-num-seqs", "8"]) as sim:
        mine = invoke_bench(stack, pp, tg, runs, "--url", sim.url, "--model", "tiny",
                            "--tokenizer", str(snapshot))
        theirs = vllm_bench_serve(stack, tmp_path, pp, tg, runs, seed=1, url=sim.url)
    truth = {"ttft_ms": 150.0 + mine["prompt_tokens"] / 10000.0 * 1000, "tg_tps": 200.0}
    report = {k: (round(mine[k], 2), round(theirs[k], 2), round(truth[k], 2)) for k in truth}
    print(f"paced server, invoke bench / vllm bench serve / pacing: {report}")
    assert abs(mine["prompt_tokens"] / theirs["prompt_tokens"] - 1) <= AGREE
    for key in truth:
        assert abs(mine[key] / theirs[key] - 1) <= AGREE, report
        assert abs(mine[key] / truth[key] - 1) <= AGREE, report


def test_bench_side_by_side_with_vllm_bench_serve(served: Stack, tmp_path: Path) -> None:
    """`invoke bench` beside `vllm bench serve` from the same install, on the real engine.

    First the two commands as a user runs them, one after the other (same lengths, fresh
    prompts, greedy): same prompt and output counts, numbers of the same order. Not 5 %: on
    this 2-core machine one client's decode rate moves by 8-15 % from one run of requests to
    the next (320-377 t/s in five runs of `invoke bench` back to back), and request by request
    in turns the client that costs less CPU per stream (ours 85 ms, vLLM's 115 ms at 512
    tokens) leaves the API server, which shares its core, more (a fresh CI machine: +5.6 % over
    60 pairs, this one -2.4 to +3.5 %). Then the
    5 %: both clients on one shared stream (paired_clients.py, `shared`: vLLM's own request
    function and ours send the same request at once to a relay that passes one to the engine
    and hands its answer to both as it arrives), so both clocks time the same tokens and what
    is left between them is their definitions and their reading of the stream. A prompt long
    enough that prefill, not the ~1.3 ms between the clients' own overheads, makes TTFT. The
    paced-server test above holds the same 5 % on the simulator."""
    cpus = place_engine_for_measurement(served)
    theirs = vllm_bench_serve(served, tmp_path, 2048, 128, 8, seed=101, cpus=cpus)
    mine = invoke_bench(served, 2048, 128, 8, cpus=cpus)
    paired = paired_clients(served, tmp_path, 2048, 512, 12, cpus)
    ours_p, theirs_p = paired["invoke_bench"], paired["vllm_bench_serve"]
    keys = ("ttft_ms", "tg_tps")
    report = {
        "commands": {k: (round(mine[k], 2), round(theirs[k], 2), f"{mine[k] / theirs[k] - 1:+.1%}")
                     for k in keys},
        "one stream": {k: (round(ours_p[k], 2), round(theirs_p[k], 2),
                           f"pair by pair {paired['ratios'][k] - 1:+.1%}") for k in keys}}
    print(f"invoke bench vs vllm bench serve (client CPUs {sorted(cpus) if cpus else 'all'}; "
          f"commands: pp 2048, tg 128, 8 requests each; one stream: pp 2048, tg 512, 12 pairs): "
          f"{report}")
    artifacts = ROOT / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    (artifacts / "real-cpu-bench-vs-vllm.json").write_text(json.dumps(
        {"commands": {"invoke_bench": mine, "vllm_bench_serve": theirs}, "one_stream": paired},
        indent=1))
    assert abs(mine["prompt_tokens"] / theirs["prompt_tokens"] - 1) <= AGREE
    assert mine["completion_tokens"] == theirs["completion_tokens"] == 128
    assert ours_p["prompt_tokens"] == theirs_p["prompt_tokens"]
    assert ours_p["completion_tokens"] == theirs_p["completion_tokens"] == 512
    for key in keys:
        assert 0.5 <= mine[key] / theirs[key] <= 2, report
        assert abs(paired["ratios"][key] - 1) <= AGREE, report


@pytest.mark.parametrize("probe", ["thinkoff", "prefix-cache"])
def test_probes_pass(served: Stack, probe: str) -> None:
    result = served.invoke("probe", probe, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "PASS" in result.stdout


def test_stability_smoke_passes(served: Stack) -> None:
    result = served.invoke("stability", "smoke", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def test_probe_depth_decay_computes_its_verdict(served: Stack) -> None:
    """`invoke probe depth-decay` on the real engine: the tiny model's window caps the 8K/32K/64K
    ladder to the same shape scaled down, each depth is measured by bench-depth's run, and the
    verdict follows from the shares it reports. Placed before `down` so that it runs on the
    module's one boot. Pass or fail is the engine's; consistency is the probe's."""
    from vllmstack.bench.probes.probe_decay import plan_depths

    window = int(next(line.split("=", 1)[1] for line in
                      (served.root / "env" / "models" / "tiny.env").read_text().splitlines()
                      if line.startswith("VLLM_MAX_MODEL_LEN=")))
    started = time.monotonic()
    result = served.invoke("probe", "depth-decay", "--param", "pp=64", "--param", "tg=64",
                           "--json", timeout=300)
    print(f"probe depth-decay on the real CPU engine: {time.monotonic() - started:.0f} s")
    said = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode in (0, 1, 2), said
    record = json.loads(result.stdout)
    details, checks = record["details"], {c["name"]: c for c in record["checks"]}
    plan = plan_depths(window, 64, 64)
    assert plan is not None and details["depths"] == list(plan.depths), said
    assert len(plan.depths) == 3 and details["capped_by"].startswith(f"max_model_len {window}")
    for depth in plan.depths:
        assert f"decode at {depth}" in checks, checks
    rates, shares = details["tg_tps"], details["shares"]
    if record["verdict"] == "inconclusive":
        # Only for a stream the starved API server released in one burst (no decode rate).
        assert any("in one burst" in w for w in details["warnings"]), said
        return
    assert all(r > 0 for r in rates), details
    assert shares[0] == 1.0
    assert shares == pytest.approx([r / rates[0] for r in rates])
    deepest = f"decode at {plan.depths[-1]} / {plan.depths[0]}"
    assert checks[deepest]["value"] == f"{shares[-1]:.0%}"
    # A CPU platform has no roofline inputs: its share is taken as 100 %, the strictest reading.
    assert details["roofline_share"] is None and details["of_roofline"] == shares[-1]
    assert details["min_of_roofline"] == 0.25
    passed = details["of_roofline"] >= 0.25
    assert (record["verdict"], result.returncode) == (("pass", 0) if passed else ("fail", 1)), said
    assert details["gpu_vendor"] == "none" and details["kv_cache_dtype"]  # cpu.env; /metrics
    if not passed:
        assert "another attention backend" in details["fix"] and "AITER" not in details["fix"]


def test_down_stops_the_engine(served: Stack) -> None:
    started = time.monotonic()
    served.must("down", timeout=180)
    print(f"down: {time.monotonic() - started:.1f} s")
    assert not served.answers()
    assert not (served.root / "generated" / "native" / "engine.json").exists()


@pytest.mark.parametrize(("setting", "cause", "fix"), [
    # The share of node memory vLLM may take on the CPU, checked against what is free at start.
    ("VLLM_GPU_MEM_UTIL=0.99", "on the CPU, gpu_memory_utilization 0.99 reserves",
     "lower VLLM_GPU_MEM_UTIL"),
    ("VLLM_EXTRA_ARGS=--no-such-flag-here", "vLLM does not know the flag(s) --no-such-flag-here",
     "remove them from VLLM_EXTRA_ARGS"),
])
def test_real_boot_failures_are_diagnosed(stack: Stack, setting: str, cause: str, fix: str) -> None:
    stack.invoke("down", timeout=120)
    result = stack.invoke("up", "--no-dashboard", "--set", setting, timeout=BOOT_TIMEOUT_S + 60)
    text = result.stdout + result.stderr
    assert result.returncode == 1, text[-3000:]
    assert "Traceback (most recent call last)" not in result.stderr.split("log line")[0]
    assert cause in text and fix in text, text[-3000:]
    assert not stack.answers()


# --- llama.cpp and the router with the real engine (issues 13, 14 and 16) -----------------------


def decode_rate(row: dict[str, Any], shape: str) -> bool:
    """The shape's requests decoded, and bench-vs measured it or said why it could not: on 2
    cores vLLM's API server, starved by the engine's busy-waiting processes, can release a stream
    in one burst (CI once saw all three single-stream requests so), which has no decode rate;
    bench leaves those out and warns rather than report 100,000s of t/s."""
    measured = (row[shape] or {}).get("tg_tps")
    if measured:
        return bool(measured["mean"] > 0)
    tokens = ((row[shape] or {}).get("completion_tokens") or {}).get("mean")
    return tokens == row["tg"] and any("in one burst" in w for w in row["warnings"])


def test_bench_vs_real_vllm_against_llamacpp_on_identical_weights(
        stack: Stack, llamacpp_cpu_server: Path) -> None:
    """`invoke gguf-convert` of the made model, then `invoke bench-vs` of the real CPU vLLM
    against the CPU llama-server of the pinned source: one table, never both resident."""
    build = llamacpp_cpu_server.parent.parent
    link = stack.root / ".cache" / "engines" / build.name
    if not link.exists():
        link.symlink_to(build)
    models = stack.home / "models"
    with (stack.root / ".env").open("a") as env:
        env.write(f"MODELS_DIR={models}\n")
    convert = stack.must("gguf-convert", "vllmstack/tiny-qwen3", timeout=600)
    assert (models / "tiny-qwen3-f16.gguf").is_file(), convert.stdout[-2000:]
    started = time.monotonic()
    result = stack.invoke("bench-vs", "-t", "vllm:tiny", "-t", "llamacpp:tiny-gguf", "--ctx", "1000",
                          "--concurrency", "2", "--json", timeout=BOOT_TIMEOUT_S + 600)
    print(f"bench-vs, real vLLM and llama.cpp on the CPU: {time.monotonic() - started:.0f} s")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(result.stdout)
    vllm_row, llama_row = record["rows"]
    assert (vllm_row["engine"], llama_row["engine"]) == ("vllm", "llamacpp")
    assert vllm_row["status"] == "ok" and llama_row["status"] in ("ok", "partial"), llama_row
    assert vllm_row["pair_kind"] == llama_row["pair_kind"] == "identical weights"
    for row in (vllm_row, llama_row):
        rates = [decode_rate(row, shape) for shape in ("single", "ctx")]
        why = (row["diagnosis"], row["failures"], row["warnings"])
        # llama-server's chat-output parser may refuse some of what the random-weight model says
        # (a partial row); vLLM's row has every request answered.
        assert (all(rates) if row is vllm_row else any(rates)), why
        assert row["conc"]["total_tg_tps"] > 0, why
    timings = llama_row["timings"]["single"] or llama_row["timings"]["ctx"]
    assert timings["predicted_per_second"] > 0  # llama.cpp's own, beside
    assert not stack.answers()  # both taken down again


def test_router_serves_two_real_profiles_one_at_a_time(stack: Stack) -> None:
    """`invoke router` over two real vLLM profiles: a request loads one, a request for the other
    swaps them (one engine at any moment), and SIGTERM leaves nothing running."""
    twin = (stack.root / "env" / "models" / "tiny.env").read_text()
    (stack.root / "env" / "models" / "tiny-b.env").write_text(
        twin.replace("VLLM_SERVED_NAME=tiny", "VLLM_SERVED_NAME=tiny-b"))
    port = free_port()
    env = {**os.environ, "HOME": str(stack.home)}
    router = subprocess.Popen([sys.executable, "-m", "invoke", "router", "--port", str(port),
                               "--profiles", "tiny,tiny-b"], cwd=stack.root, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _get(url + "/v1/health"):
            time.sleep(0.5)
        answers = []
        for model in ("tiny", "tiny-b"):
            started = time.monotonic()
            answer = _post(url + "/v1/chat/completions", {
                "model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
            answers.append((model, answer["model"], round(time.monotonic() - started)))
        health = _get(url + "/v1/health")
        print(f"router, real engines: {answers}; swaps {health['swaps']}")
        assert [a[:2] for a in answers] == [("tiny", "tiny"), ("tiny-b", "tiny-b")]
        assert health["loaded"] == "tiny-b" and health["models"]["tiny"]["state"] == "unloaded"
        swap = health["swaps"][-1]
        assert (swap["unloaded"], swap["loaded"], swap["ok"]) == ("tiny", "tiny-b", True)
        # Issue 21: on the CPU, auto swaps by restart (vLLM sleeps on CUDA and ROCm only): the
        # old engine was stopped, not put to sleep, and each profile had an engine of its own.
        assert (swap["stopped"], swap["slept"], swap["wake_s"]) == (["tiny"], [], 0)
        engines = health["engines"]
        assert engines["tiny"]["swap"] == engines["tiny-b"]["swap"] == "restart"
        assert "no vLLM sleep mode with GPU_VENDOR=none" in engines["tiny"]["why"]
        assert health["asleep"] == [] and engines["tiny"]["url"] is None
    finally:
        router.terminate()
        output, _ = router.communicate(timeout=180)
    assert router.returncode == 0, output[-3000:]
    assert not stack.answers(), output[-3000:]


def _get(url: str) -> dict[str, Any]:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            data: dict[str, Any] = json.load(answer)
            return data
    except OSError:
        return {}


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=BOOT_TIMEOUT_S + 120) as answer:
            data: dict[str, Any] = json.load(answer)
    except urllib.error.HTTPError as exc:  # the router's diagnosis is in the body: show it
        raise AssertionError(f"{url}: {exc.code} {exc.read()[:2000]!r}") from None
    return data
