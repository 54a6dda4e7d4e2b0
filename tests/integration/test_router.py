"""`python -m vllmstack.router` (what `invoke router` runs) for real: the engine simulator as the
engine of three profiles on the native runtime, each load a real `up`, each unload a real `down`.

sim-a streams a chunk every 20 ms, sim-b takes 1.5 s to boot, sim-bad crashes at boot with
vLLM's "No available memory for the cache blocks" error.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers import ROOT, free_port, simulator_project

from vllmstack.core.checkout import checkout_id
from vllmstack.observe.health import health_status

PROFILES = {
    "sim-a": "SIM_BOOT_SECONDS=0.3 SIM_ITL_MS=20",
    "sim-b": "SIM_BOOT_SECONDS=1.5",
    "sim-bad": "SIM_FAULT=crash-at-boot SIM_BOOT_SECONDS=0.2",
}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def engine_processes(root: Path) -> list[int]:
    """Live processes carrying this checkout's engine marker (every engine of the stack: the
    default one, `<id>-...`, and the named ones the router runs, `<id>@NAME@...`)."""
    prefixes = tuple(f"VLLMSTACK_ENGINE_ID={checkout_id(root)}{sep}".encode() for sep in "-@")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            marked = any(e.startswith(prefixes)
                         for e in (entry / "environ").read_bytes().split(b"\0"))
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if marked and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def port_of(router: Router, model: str) -> int:
    """The port of a model's own engine (one per profile on the native runtime)."""
    url = router.health()["engines"][model]["url"] or ""
    return int(url.rsplit(":", 1)[1])


def served_models(port: int) -> list[str]:
    data = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=3).json()["data"]
    return [m["id"] for m in data]


class Router:
    def __init__(self, root: Path, engine_port: int, *args: str, env: dict[str, str] | None = None,
                 host: str = "127.0.0.1", token: str | None = None) -> None:
        self.root, self.engine_port, self.port = root, engine_port, free_port()
        # Reads need the token too (issue 35): the helper's own reads send the router's.
        self.token = (env or {}).get("ROUTER_TOKEN", "") if token is None else token
        self.auth = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / f"router-{self.port}.out"
        environ = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllmstack.router", "--project", str(root), "--host", host,
                 "--port", str(self.port), "--profiles", ",".join(PROFILES), *args],
                cwd=root, env=environ, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self) -> Router:
        deadline = time.monotonic() + 60
        while self.answers() != 200:
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.1)
        return self

    def answers(self) -> int | None:
        try:
            return requests.get(self.url + "/health", headers=self.auth, timeout=2).status_code
        except requests.RequestException:
            return None

    def output(self) -> str:
        return self.log.read_text()

    def health(self) -> dict[str, Any]:
        data: dict[str, Any] = requests.get(self.url + "/v1/health", headers=self.auth,
                                            timeout=5).json()
        return data

    def models(self) -> dict[str, dict[str, Any]]:
        data = requests.get(self.url + "/v1/models", headers=self.auth, timeout=5).json()["data"]
        return {m["id"]: m for m in data}

    def chat(self, model: str, **extra: Any) -> requests.Response:
        return requests.post(self.url + "/v1/chat/completions", json={"model": model, **CHAT},
                             timeout=120, **extra)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=120)


@pytest.fixture
def project(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    engine_port = free_port()
    root = simulator_project(tmp_path / "stack", PROFILES, port=engine_port)
    # Each engine has its own port (in the profile: .env's would win); sim-a's is engine_port.
    dotenv = root / ".env"
    dotenv.write_text("".join(line for line in dotenv.read_text().splitlines(keepends=True)
                              if not line.startswith("VLLM_PORT=")))
    for name in PROFILES:
        with (root / "env" / "models" / f"{name}.env").open("a") as handle:
            handle.write(f"VLLM_PORT={engine_port if name == 'sim-a' else free_port()}\n")
    yield root, engine_port
    # Whatever a test left running (a failed assertion mid-way) goes with the engine record.
    for pid in engine_processes(root):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture
def start(project: tuple[Path, int]) -> Iterator[Callable[..., Router]]:
    routers: list[Router] = []

    def run(*args: str, **kwargs: Any) -> Router:
        router = Router(project[0], project[1], *args, **kwargs)
        routers.append(router)
        return router

    yield run
    for router in routers:
        router.stop()


@pytest.mark.slow  # a boot, a swap with a 1.5 s boot: about 6 s
def test_on_demand_load_then_a_swap_with_one_engine_at_any_moment(
        project: tuple[Path, int], start: Callable[..., Router]) -> None:
    root, engine_port = project
    router = start().wait_ready()
    models = router.models()
    assert list(models) == ["sim-a", "sim-b", "sim-bad"]
    assert {m["state"] for m in models.values()} == {"unloaded"}
    assert {m["owned_by"] for m in models.values()} == {"vllm"} and engine_processes(root) == []
    answer = router.chat("sim-a")
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "sim-a" and answer.json()["choices"][0]["message"]
    assert router.models()["sim-a"]["state"] == "ready"
    assert router.health()["loaded"] == "sim-a" and served_models(engine_port) == ["sim-a"]
    # The load went through `up`: its output is in the model's log and the router's.
    assert "healthy after" in (root / "generated" / "router" / "sim-a.log").read_text()
    assert "[sim-a] warm-up answered" in router.output()
    # Swap to sim-b while sampling the engine processes: never two at once.
    counts: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            counts.append(len(engine_processes(root)))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        answer = router.chat("sim-b")
    finally:
        done.set()
        sampler.join()
    assert answer.status_code == 200 and answer.json()["model"] == "sim-b", answer.text
    assert max(counts) == 1 and 0 in counts, counts  # the old one was gone before the new started
    assert served_models(port_of(router, "sim-b")) == ["sim-b"]
    assert len(engine_processes(root)) == 1
    assert health_status(f"http://127.0.0.1:{engine_port}") is None  # sim-a's engine is gone
    swap = router.health()["swaps"][-1]
    assert (swap["unloaded"], swap["loaded"], swap["ok"]) == ("sim-a", "sim-b", True)
    assert swap["stop_s"] > 0 and swap["start_s"] >= 1.5 and swap["boot_s"] >= 1.5
    assert swap["total_s"] == pytest.approx(swap["stop_s"] + swap["start_s"], abs=0.2)
    states = {k: m["state"] for k, m in router.models().items()}
    assert states == {"sim-a": "unloaded", "sim-b": "ready", "sim-bad": "unloaded"}


@pytest.mark.slow
def test_requests_arriving_during_a_load_wait_and_are_all_served(
        project: tuple[Path, int], start: Callable[..., Router]) -> None:
    router = start().wait_ready()
    with ThreadPoolExecutor(6) as pool:
        first = pool.submit(router.chat, "sim-b")
        time.sleep(0.5)  # sim-b is booting (1.5 s)
        during = router.health()
        assert (during["loaded"], during["state"]) == ("sim-b", "loading")
        assert router.models()["sim-b"]["state"] == "loading"
        rest = [pool.submit(router.chat, "sim-b") for _ in range(5)]
        answers = [first.result(), *(f.result() for f in rest)]
    assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
    assert all(a.json()["model"] == "sim-b" for a in answers)
    swaps = router.health()["swaps"]
    assert len(swaps) == 1 and swaps[0]["loaded"] == "sim-b"  # one load served all six


def read_chunks(sock: socket.socket, until: Callable[[bytes], bool]) -> tuple[bytes, list[float]]:
    data, times = b"", []
    while not until(data):
        piece = sock.recv(65536)
        if not piece:
            break
        data += piece
        times.append(time.monotonic())
    return data, times


def raw_post(port: int, path: str, body: dict[str, Any]) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    payload = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                 f"content-length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def engine_metric(port: int, name: str, label: str = "") -> float:
    """A sample of the engine's /metrics (0 when absent): `name`, with `label` among its labels."""
    for line in requests.get(f"http://127.0.0.1:{port}/metrics", timeout=3).text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.slow
def test_streams_pass_through_as_they_come_and_a_client_leaving_aborts_upstream(
        project: tuple[Path, int], start: Callable[..., Router]) -> None:
    _, engine_port = project
    router = start().wait_ready()
    body = {"model": "sim-a", "prompt": "hello", "max_tokens": 30, "stream": True}
    with raw_post(router.port, "/v1/completions", body) as sock:
        data, times = read_chunks(sock, lambda d: d.endswith(b"0\r\n\r\n"))
    head, _, rest = data.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0] and b"transfer-encoding: chunked" in head.lower()
    assert rest.count(b"data: ") == 31 and b"data: [DONE]" in rest  # 30 tokens, then DONE
    # Chunk by chunk, as the engine paces them (20 ms apart): the first long before the last.
    assert len(times) >= 20 and times[-1] - times[1] > 0.4, times
    # Now a client that leaves mid-stream: the engine aborts its request.
    aborted = engine_metric(engine_port, "vllm:request_success_total", 'finished_reason="abort"')
    body["max_tokens"] = 5000  # 100 s of streaming unless cancelled
    sock = raw_post(router.port, "/v1/completions", body)
    read_chunks(sock, lambda d: d.count(b"data: ") >= 3)
    assert engine_metric(engine_port, "vllm:num_requests_running") == 1
    sock.close()
    deadline = time.monotonic() + 5
    while engine_metric(engine_port, "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the engine still runs the abandoned request"
        time.sleep(0.05)
    assert engine_metric(engine_port, "vllm:request_success_total",
                         'finished_reason="abort"') == aborted + 1
    assert router.health()["inflight"] == 0


@pytest.mark.slow
def test_unknown_model_is_404_and_a_crash_at_boot_is_503_with_the_diagnosis(
        project: tuple[Path, int], start: Callable[..., Router]) -> None:
    root, _ = project
    router = start().wait_ready()
    missing = router.chat("nope")
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["type"] == "NotFoundError" and error["param"] == "model" and error["code"] == 404
    assert error["message"].startswith("The model `nope` does not exist.")
    assert "sim-a, sim-b, sim-bad" in error["message"]
    failed = router.chat("sim-bad")
    assert failed.status_code == 503
    error = failed.json()["error"]
    assert "exited with code 1" in error["message"]
    assert "out of memory for the KV cache" in error["diagnosis"]["cause"]
    assert "VLLM_GPU_MEM_UTIL" in error["diagnosis"]["fix"]
    model = router.models()["sim-bad"]
    assert model["state"] == "failed" and model["error"] == error["diagnosis"]
    assert engine_processes(root) == []  # the crashed engine left nothing behind
    log = (root / "generated" / "router" / "sim-bad.log").read_text()
    assert "No available memory for the cache blocks" in log and "error: " in log
    # The router still serves the other models.
    assert router.chat("sim-a").status_code == 200


@pytest.mark.slow
def test_idle_ttl_unloads_the_model(project: tuple[Path, int], start: Callable[..., Router]) -> None:
    root, engine_port = project
    router = start("--ttl", "1").wait_ready()
    assert router.chat("sim-a").status_code == 200
    assert len(engine_processes(root)) == 1
    deadline = time.monotonic() + 10
    while router.health()["state"] != "unloaded":
        assert time.monotonic() < deadline, router.output()
        time.sleep(0.1)
    assert engine_processes(root) == [] and health_status(f"http://127.0.0.1:{engine_port}") is None
    assert router.health()["swaps"][-1]["reason"] == "idle"
    assert "idle for 1 s: unloading" in router.output()
    assert router.chat("sim-a").status_code == 200  # and the next request loads it again


@pytest.mark.slow
def test_stop_leaves_no_process_and_a_restarted_router_adopts_a_running_engine(
        project: tuple[Path, int], start: Callable[..., Router]) -> None:
    root, engine_port = project
    first = start().wait_ready()
    assert first.chat("sim-a").status_code == 200
    record = json.loads((root / "generated" / "router.json").read_text())
    assert (record["pid"], record["loaded"], record["state"]) == (first.proc.pid, "sim-a", "ready")
    # Killed without a chance to clean up: the engine outlives it...
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    engine = engine_processes(root)
    assert len(engine) == 1 and health_status(f"http://127.0.0.1:{engine_port}") == 200
    # ...and the next router takes it over instead of starting another.
    second = start().wait_ready()
    health = second.health()
    assert (health["loaded"], health["state"], health["adopted"]) == ("sim-a", "ready", True)
    assert second.chat("sim-a").status_code == 200
    assert second.health()["swaps"] == [] and engine_processes(root) == engine
    assert "adopted the running engine of profile sim-a" in second.output()
    # A clean stop ends the engine it adopted: nothing is left.
    assert second.stop(signal.SIGTERM) == 0
    assert engine_processes(root) == []
    assert health_status(f"http://127.0.0.1:{engine_port}") is None
    assert not (root / "generated" / "router.json").exists()
    assert "stopped; no engine left running" in second.output()


def test_beyond_loopback_a_token_is_required(project: tuple[Path, int],
                                             start: Callable[..., Router]) -> None:
    refused = start(host="0.0.0.0", env={"ROUTER_TOKEN": ""})
    assert refused.proc.wait(timeout=60) == 1
    lines = refused.output().strip().splitlines()
    assert lines[-2] == ("error: the router would listen on 0.0.0.0, reachable from other "
                         "machines, without a token")
    assert "ROUTER_TOKEN" in lines[-1] and lines[-1].startswith("fix:")
    router = start(host="0.0.0.0", env={"ROUTER_TOKEN": "s3cret-token-0123456789abcdef-0123"}).wait_ready()
    post = router.url + "/v1/completions"
    body = {"model": "nope", "prompt": "x"}
    assert requests.post(post, json=body, timeout=5).status_code == 401
    wrong = requests.post(post, json=body, headers={"Authorization": "Bearer nope"}, timeout=5)
    assert wrong.status_code == 401 and "Authorization: Bearer" in wrong.json()["error"]["message"]
    right = requests.post(post, json=body, timeout=5,
                          headers={"Authorization": "Bearer s3cret-token-0123456789abcdef-0123"})
    assert right.status_code == 404  # past the token: an unknown model
    assert requests.post(router.url + "/v1/load", json={"model": "sim-a"}, timeout=5).status_code == 401
    assert requests.get(router.url + "/v1/models", timeout=5).status_code == 401  # reads too
    assert requests.get(router.url + "/v1/models", headers=router.auth, timeout=5).status_code == 200
    assert router.health()["swaps"] == []  # nothing was loaded by the refused requests


def test_on_loopback_without_a_token_requests_from_a_web_page_are_refused(
        project: tuple[Path, int], start: Callable[..., Router]) -> None:
    router = start(env={"ROUTER_TOKEN": ""}).wait_ready()
    body = {"model": "nope", "prompt": "x"}
    page = requests.post(router.url + "/v1/completions", json=body, timeout=5,
                         headers={"Origin": "http://evil.example"})
    assert page.status_code == 403
    rebound = requests.post(router.url + "/v1/completions", json=body, timeout=5,
                            headers={"Host": "evil.example"})
    assert rebound.status_code == 403
    local = requests.post(router.url + "/v1/completions", json=body, timeout=5,
                          headers={"Origin": "http://localhost:3000"})
    assert local.status_code == 404


@pytest.mark.slow
def test_stop_during_a_load_cuts_it_short_and_leaves_no_process(
        project: tuple[Path, int], start: Callable[..., Router]) -> None:
    root, engine_port = project
    router = start().wait_ready()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(router.chat, "sim-b")  # boots for 1.5 s
        deadline = time.monotonic() + 10
        while not engine_processes(root):
            assert time.monotonic() < deadline, router.output()
            time.sleep(0.02)
        began = time.monotonic()
        assert router.stop(signal.SIGTERM) == 0
        assert time.monotonic() - began < 5
        # Its client was answered, neither left hanging nor cut off (issue 35: it read a dropped
        # connection): a 503 saying why.
        answer = waiting.result()
        assert answer.status_code == 503 and "the router is stopping" in answer.text, answer.text
    assert engine_processes(root) == [] and health_status(f"http://127.0.0.1:{engine_port}") is None
    assert "cutting the load of sim-b short" in router.output()


# --- issue 22: one router per checkout, signals, the token, start options, load ----------------


def test_a_second_router_on_the_checkout_is_refused_and_the_first_keeps_its_record(
        project: tuple[Path, int], start: Callable[..., Router]) -> None:
    root, _ = project
    first = start().wait_ready()
    record = json.loads((root / "generated" / "router.json").read_text())
    second = start()
    assert second.proc.wait(timeout=60) == 1
    lines = second.output().strip().splitlines()
    assert lines[-2].startswith("error: another router already serves this checkout "
                                f"(pid {first.proc.pid}, {first.url}")
    assert lines[-1].startswith("fix:")
    assert json.loads((root / "generated" / "router.json").read_text())["pid"] == record["pid"]
    assert first.health()["status"] == "ok"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGINT])
def test_sighup_and_sigint_stop_the_router_and_its_engine(
        project: tuple[Path, int], start: Callable[..., Router], sig: signal.Signals) -> None:
    root, engine_port = project
    router = start().wait_ready()
    assert router.chat("sim-a").status_code == 200 and len(engine_processes(root)) == 1
    assert router.stop(sig) == 0  # SIGHUP: its terminal closed; SIGINT: Ctrl-C
    assert engine_processes(root) == [] and health_status(f"http://127.0.0.1:{engine_port}") is None
    assert f"stopping ({sig.name})" in router.output()


@pytest.mark.slow
def test_the_token_reaches_no_engine_and_no_command_line(project: tuple[Path, int],
                                                         start: Callable[..., Router]) -> None:
    root, _ = project
    token_file = root / "router.token"
    token_file.write_text("t0ken-from-file-0123456789abcdef-0\n")
    router = start("--token-file", str(token_file),
                   env={"ROUTER_TOKEN": "t0ken-from-env-0123456789abcdef-01"},
                   token="t0ken-from-file-0123456789abcdef-0").wait_ready()
    assert router.chat("sim-a").status_code == 401
    from_env = {"Authorization": "Bearer t0ken-from-env-0123456789abcdef-01"}
    assert router.chat("sim-a", headers=from_env).status_code == 401
    answer = router.chat("sim-a", headers={"Authorization": "Bearer t0ken-from-file-0123456789abcdef-0"})
    assert answer.status_code == 200, answer.text
    engines = engine_processes(root)
    assert engines
    for pid in engines:  # the engine (and what it starts) never inherits the router's token
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert not any(item.startswith(b"ROUTER_TOKEN=") for item in environ), pid
    for pid in [router.proc.pid, *engines]:  # and `ps` shows it nowhere
        assert b"t0ken" not in Path(f"/proc/{pid}/cmdline").read_bytes()


@pytest.mark.parametrize(("args", "cause"), [
    (["--ttl", "-1"], "--ttl -1 is not a usable number of seconds"),
    (["--ttl", "nan"], "--ttl 'nan' is not a number of seconds"),
    (["--drain-timeout", "inf"], "--drain-timeout 'inf' is not a number of seconds"),
    (["--load-timeout", "0"], "--load-timeout 0 is not a usable number of seconds"),
    (["--load-timeout", "abc"], "--load-timeout 'abc' is not a number of seconds"),
    (["--port", "70000"], "--port '70000' is not a port"),
    (["--port", "0"], "--port '0' is not a port"),
    (["--token-file", "/nonexistent/token"], "--token-file /nonexistent/token: No such file"),
])
def test_bad_start_options_are_an_error_and_a_fix(project: tuple[Path, int], args: list[str],
                                                   cause: str) -> None:
    root, _ = project
    done = subprocess.run([sys.executable, "-m", "vllmstack.router", "--project", str(root), *args],
                          cwd=root, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
                          capture_output=True, timeout=60, check=False)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[-2].startswith(f"error: {cause}") and lines[-1].startswith("fix:"), lines


@pytest.mark.slow
def test_sigterm_ends_a_stream_in_flight_with_an_sse_error_event(
        project: tuple[Path, int], start: Callable[..., Router]) -> None:
    root, engine_port = project
    router = start().wait_ready()
    body = {"model": "sim-a", "prompt": "hello", "max_tokens": 5000, "stream": True}
    with raw_post(router.port, "/v1/completions", body) as sock:
        read_chunks(sock, lambda d: d.count(b"data: ") >= 3)
        router.proc.send_signal(signal.SIGTERM)
        sock.settimeout(10)
        rest, _ = read_chunks(sock, lambda d: False)  # until the router closed the connection
    events = [e for e in rest.split(b"\n\n") if b"data: " in e]
    error = json.loads(events[-1].split(b"data: ", 1)[1].split(b"\r\n")[0])["error"]
    assert error["code"] == 503 and "the router is stopping" in error["message"]
    assert not rest.endswith(b"0\r\n\r\n")  # not framed as a complete answer
    assert router.proc.wait(timeout=60) == 0
    assert engine_processes(root) == [] and health_status(f"http://127.0.0.1:{engine_port}") is None


@pytest.mark.slow
def test_a_thousand_idle_connections_leave_health_fast(project: tuple[Path, int],
                                                      start: Callable[..., Router]) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 1200:  # this test's own 1,000 sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    router = start().wait_ready()
    held = []
    try:
        # From four loopback addresses (Linux answers all of 127/8): one address may hold only
        # ROUTER_MAX_CLIENT_CONNECTIONS (512), so no client takes the cap from the others.
        for n in range(1000):
            held.append(socket.create_connection(("127.0.0.1", router.port), timeout=10,
                                                 source_address=(f"127.0.0.{2 + n % 4}", 0)))
        time.sleep(0.5)
        times = []
        for _ in range(30):
            began = time.perf_counter()
            with socket.create_connection(("127.0.0.1", router.port), timeout=5) as sock:
                sock.sendall(b"GET /v1/health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
                data, _ = read_chunks(sock, lambda d: False)
            times.append(time.perf_counter() - began)
            assert data.startswith(b"HTTP/1.1 200"), data[:200]
        times.sort()
        print(f"/v1/health beside 1,000 idle connections: median {times[15] * 1e3:.2f} ms, "
              f"max {times[-1] * 1e3:.2f} ms")
        assert times[15] < 0.050 and times[-3] < 0.050, times
    finally:
        for sock in held:
            sock.close()
