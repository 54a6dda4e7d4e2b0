"""The router's HTTP side against a fake engine: routing by `model`, OpenAI-style errors, the byte
pipe (streams chunk by chunk, keep-alive, a client leaving), the lifecycle API and the token rule.
Loads go to a fake lifecycle; the integration test (tests/integration/test_router.py) runs real ones."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import requests
from helpers import free_port

from vllmstack.config.profiles import Resolved, Setting
from vllmstack.core.errors import StackError
from vllmstack.router.catalog import Catalog, Entry
from vllmstack.router.engines import EngineManager, Loaded
from vllmstack.router.front import Front
from vllmstack.router.limits import Limits
from vllmstack.router.server import RouterApp
from vllmstack.router.states import Adopted, Slept
from vllmstack.router.upstream import Upstream
from vllmstack.runtime.gpu import GpuMemory


class FakeEngine:
    """Records what reaches it; streams three events 0.15 s apart, or forever with "forever"."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, Any], dict[str, str]]] = []
        self.ports: list[int] = []  # the router's side of each request's engine connection
        self.gone = threading.Event()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # /health
                self.send_response(200 if self.path == "/health" else 404)
                self.send_header("content-length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                engine.seen.append((body, {k.lower(): v for k, v in self.headers.items()}))
                engine.ports.append(self.client_address[1])
                if body.get("garble"):  # not HTTP at all
                    self.wfile.write(b"HTTP/1.1 2OO K\r\nnonsense\r\n\r\n")
                    self.close_connection = True
                    return
                if body.get("fail"):
                    data = b'{"error": {"message": "EngineCore died", "code": 500}}'
                    self.send_response(500)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                if body.get("think"):  # a long prefill: nothing is sent; watch for the close
                    deadline = time.monotonic() + 5
                    while time.monotonic() < deadline:
                        if select.select([self.connection], [], [], 0.05)[0] and not \
                                self.connection.recv(1, socket.MSG_PEEK):
                            engine.gone.set()
                            return
                    return
                if not body.get("stream"):
                    data = json.dumps({"model": body["model"], "object": "text_completion"}).encode()
                    self.send_response(200)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                try:
                    for i in range(10_000 if body.get("forever") else 3):
                        event = f"data: {{\"i\": {i}}}\n\n".encode()
                        self.wfile.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
                        time.sleep(0.05 if body.get("forever") else 0.15)
                    self.wfile.write(b"5\r\ndata:\r\n0\r\n\r\n")
                except OSError:
                    engine.gone.set()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


class FakeLifecycle:
    def __init__(self, url: str, fail: str = "") -> None:
        self.url, self.fail = url, fail

    def load(self, entry: Entry, util: float | None = None, sleep_mode: bool = False,
             frees: str = "all") -> Loaded:
        if entry.id == self.fail:
            raise StackError("the engine exited with code 1: out of memory", "lower the context")
        return Loaded(self.url)

    def unload(self, entry: Entry) -> None:
        pass

    def abort(self, entry: Entry) -> None:
        pass

    def adoptable(self, catalog: Catalog) -> list[Adopted]:
        return []

    def sleep(self, entry: Entry, frees: str = "all") -> Slept:
        raise AssertionError("one engine at a time never sleeps")

    def wake(self, entry: Entry) -> float:
        raise AssertionError("one engine at a time never wakes")

    def memory(self) -> list[GpuMemory] | None:
        return None


def entry(served: str, profile: str) -> Entry:
    resolved = Resolved("cpu", profile, {"VLLM_PORT": Setting("VLLM_PORT", "1", "test")}, [])
    return Entry(served, profile, "vllm", resolved, 0.0)


@contextmanager
def router(engine_url: str, *, token: str = "", fail: str = "", drain_timeout: float = 600.0,
           limits: Limits | None = None) -> Iterator[str]:
    """The router (its aiohttp front, the pooled upstream client) on a free port, in a loop of
    its own thread."""
    catalog = Catalog("cpu", {"served": entry("served", "prof"), "bad": entry("bad", "bad")},
                      {"prof": "served"})
    limits = limits or Limits()
    port, started = free_port(), threading.Event()
    loop = asyncio.new_event_loop()
    stop = loop.create_future()

    async def main() -> None:
        upstream = Upstream(limits)
        manager = EngineManager(catalog, FakeLifecycle(engine_url, fail), drain_timeout=drain_timeout,
                                limits=limits, probe=upstream.probe)
        app = RouterApp(catalog, manager, upstream, token=token, exposed_on="127.0.0.1",
                        load_timeout=10, limits=limits)
        server = await loop.create_server(Front(app.handle, limits), "127.0.0.1", port)
        started.set()
        await stop
        server.close()
        await upstream.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(stop.set_result, None)
        thread.join(10)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def routed(engine: FakeEngine) -> Iterator[str]:
    with router(engine.url) as url:
        yield url


def raw(url: str, text: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(text)
    return sock


def post_bytes(path: str, body: dict[str, Any], extra: str = "") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: {len(data)}\r\n{extra}"
            "\r\n").encode() + data


def read_until(sock: socket.socket, done: Callable[[bytes], bool]) -> tuple[bytes, list[float]]:
    data, times = b"", []
    while not done(data):
        piece = sock.recv(65536)
        if not piece:
            break
        data, times = data + piece, [*times, time.monotonic()]
    return data, times


def test_errors_are_openai_shaped_and_name_the_known_models(routed: str) -> None:
    missing = requests.post(routed + "/v1/completions", json={"model": "nope"}, timeout=5)
    assert missing.status_code == 404
    assert missing.json() == {"error": {
        "message": "The model `nope` does not exist. Known models: served, bad",
        "type": "NotFoundError", "param": "model", "code": 404, "known": ["served", "bad"]}}
    unnamed = requests.post(routed + "/v1/chat/completions", json={"messages": []}, timeout=5)
    assert unnamed.status_code == 400 and unnamed.json()["error"]["param"] == "model"
    assert "one of served, bad" in unnamed.json()["error"]["message"]
    garbled = requests.post(routed + "/v1/embeddings", data=b"{not json", timeout=5)
    assert garbled.status_code == 400 and "not JSON" in garbled.json()["error"]["message"]
    assert requests.get(routed + "/v1/completions", timeout=5).status_code == 405
    assert requests.get(routed + "/nowhere", timeout=5).status_code == 404


def test_a_profile_name_reaches_the_engine_as_its_served_name(routed: str, engine: FakeEngine) -> None:
    answer = requests.post(routed + "/v1/completions", json={"model": "prof", "prompt": "x"},
                           timeout=5)
    assert answer.status_code == 200 and answer.json()["model"] == "served"
    body, headers = engine.seen[-1]
    assert body == {"model": "served", "prompt": "x"}
    assert headers["host"] == engine.url.removeprefix("http://")
    assert "connection" not in headers  # kept alive for the next request (HTTP/1.1's default)


def test_a_stream_passes_through_byte_for_byte_as_it_comes(routed: str) -> None:
    with raw(routed, post_bytes("/v1/chat/completions", {"model": "served", "stream": True})) as sock:
        data, times = read_until(sock, lambda d: d.endswith(b"0\r\n\r\n"))
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding: chunked" in head.lower()
    assert b"connection" not in head.lower()  # the engine's "close" is not the client's
    events = b"".join(f"{len(e):x}\r\n".encode() + e + b"\r\n" for e in
                      (f"data: {{\"i\": {i}}}\n\n".encode() for i in range(3)))
    assert body == events + b"5\r\ndata:\r\n0\r\n\r\n"  # the engine's framing, untouched
    assert times[-1] - times[0] >= 0.35  # three events 0.15 s apart, not one buffered block


def test_one_connection_carries_requests_one_after_another(routed: str) -> None:
    one = post_bytes("/v1/completions", {"model": "served", "prompt": "a"})
    with raw(routed, one + one) as sock:  # pipelined: the second waits for the first
        data, _ = read_until(sock, lambda d: d.count(b'"object": "text_completion"') == 2)
    assert data.count(b"HTTP/1.1 200 OK") == 2
    with raw(routed, post_bytes("/v1/chat/completions", {"model": "served", "stream": True})) as sock:
        read_until(sock, lambda d: d.endswith(b"0\r\n\r\n"))
        sock.sendall(one)  # after a stream, the same connection still serves
        data, _ = read_until(sock, lambda d: b"text_completion" in d)
    assert data.startswith(b"HTTP/1.1 200 OK")


def test_a_client_leaving_mid_stream_closes_the_engine_connection(
        routed: str, engine: FakeEngine) -> None:
    sock = raw(routed, post_bytes("/v1/chat/completions",
                                  {"model": "served", "stream": True, "forever": True}))
    read_until(sock, lambda d: d.count(b"data:") >= 2)
    sock.close()
    assert engine.gone.wait(3), "the engine kept streaming to nobody"


def test_a_client_leaving_before_the_first_token_closes_the_engine_connection(
        routed: str, engine: FakeEngine) -> None:
    sock = raw(routed, post_bytes("/v1/chat/completions",
                                  {"model": "served", "stream": True, "think": True}))
    deadline = time.monotonic() + 3
    while not engine.seen:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sock.close()
    assert engine.gone.wait(1), "the engine connection stayed open after the client left"


def test_an_unload_cuts_a_stream_that_outlasts_the_drain_timeout(engine: FakeEngine) -> None:
    with router(engine.url, drain_timeout=0.3) as url:
        sock = raw(url, post_bytes("/v1/chat/completions",
                                   {"model": "served", "stream": True, "forever": True}))
        read_until(sock, lambda d: d.count(b"data:") >= 2)
        started = time.monotonic()
        gone = requests.post(url + "/v1/unload", json={}, timeout=10).json()
        assert gone == {"status": "success", "unloaded": "served", "engines": ["served"]}
        assert 0.3 <= time.monotonic() - started < 5
        sock.settimeout(3)
        rest, _ = read_until(sock, lambda d: False)  # until the router closed the connection
        assert not rest.endswith(b"0\r\n\r\n"), "the cut stream ended as if complete"
        last = rest.rstrip().split(b"\r\n")[-1]  # the last chunk's data: an SSE error event
        error = json.loads(last.removeprefix(b"data: "))["error"]
        assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
        assert error["message"] == "the router unloads served (unload)"
        assert engine.gone.wait(3), "the engine kept streaming to nobody"
        health = requests.get(url + "/v1/health", timeout=5).json()
        assert (health["loaded"], health["inflight"]) == (None, 0)


def test_a_failed_load_is_503_with_the_diagnosis(engine: FakeEngine) -> None:
    with router(engine.url, fail="bad") as url:
        answer = requests.post(url + "/v1/completions", json={"model": "bad"}, timeout=5)
        assert answer.status_code == 503
        error = answer.json()["error"]
        assert error["message"] == "bad could not be loaded: the engine exited with code 1: out of memory"
        assert error["diagnosis"] == {"cause": "the engine exited with code 1: out of memory",
                                      "fix": "lower the context"}
        models = {m["id"]: m for m in requests.get(url + "/v1/models", timeout=5).json()["data"]}
        assert models["bad"]["state"] == "failed" and models["bad"]["error"] == error["diagnosis"]
        assert models["served"] == {"id": "served", "object": "model", "owned_by": "vllm",
                                    "created": models["served"]["created"], "profile": "prof",
                                    "state": "unloaded"}


def test_an_engine_that_stopped_answering_is_502_and_loaded_again_next_time() -> None:
    with router(f"http://127.0.0.1:{free_port()}") as url:
        answer = requests.post(url + "/v1/completions", json={"model": "served"}, timeout=5)
        assert answer.status_code == 502 and "did not answer" in answer.json()["error"]["message"]
        assert answer.json()["error"]["type"] == "BadGatewayError"  # the engine's, not a ServerError
        state = requests.get(url + "/v1/health", timeout=5).json()["models"]["served"]
        assert state["state"] == "failed" and "stopped answering" in state["error"]["cause"]


def test_load_unload_and_health(routed: str) -> None:
    health = requests.get(routed + "/v1/health", timeout=5).json()
    assert (health["status"], health["loaded"], health["state"]) == ("ok", None, "unloaded")
    loaded = requests.post(routed + "/v1/load", json={"model_name": "prof"}, timeout=5)
    assert loaded.status_code == 200
    assert loaded.json()["model"] == "served" and loaded.json()["state"] == "ready"
    health = requests.get(routed + "/health", timeout=5).json()
    assert (health["loaded"], health["state"]) == ("served", "ready")
    other = requests.post(routed + "/v1/unload", json={"model": "bad"}, timeout=5).json()
    assert other == {"status": "success", "unloaded": None, "engines": [],
                     "message": "bad is not loaded"}
    gone = requests.post(routed + "/v1/unload", json={}, timeout=5).json()
    assert gone == {"status": "success", "unloaded": "served", "engines": ["served"]}
    assert requests.get(routed + "/v1/health", timeout=5).json()["state"] == "unloaded"
    assert requests.post(routed + "/v1/load", json={"model": "x"}, timeout=5).status_code == 404


def test_a_token_is_required_when_set_and_stays_with_the_router(engine: FakeEngine) -> None:
    with router(engine.url, token="t0ken") as url:
        body = {"model": "served", "prompt": "x"}
        assert requests.post(url + "/v1/completions", json=body, timeout=5).status_code == 401
        assert requests.post(url + "/v1/completions", json=body, timeout=5,
                             headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = requests.post(url + "/v1/completions", json=body, timeout=5,
                           headers={"Authorization": "Bearer t0ken"})
        assert ok.status_code == 200 and "authorization" not in engine.seen[-1][1]
        assert requests.get(url + "/v1/models", timeout=5).status_code == 401  # reads too
        assert requests.get(url + "/v1/models", timeout=5,
                            headers={"Authorization": "Bearer t0ken"}).status_code == 200


def test_without_a_token_only_this_machines_pages_may_post(routed: str, engine: FakeEngine) -> None:
    body = {"model": "served", "prompt": "x"}
    assert requests.post(routed + "/v1/completions", json=body, timeout=5,
                         headers={"Origin": "https://evil.example"}).status_code == 403
    assert engine.seen == []
    ok = requests.post(routed + "/v1/completions", json=body, timeout=5,
                       headers={"Authorization": "Bearer engine-key"})
    assert ok.status_code == 200  # no router token: the client's key is the engine's business
    assert engine.seen[-1][1]["authorization"] == "Bearer engine-key"


def test_expect_continue_and_a_chunked_request_body(routed: str, engine: FakeEngine) -> None:
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nexpect: 100-continue\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    with raw(routed, head) as sock:
        data, _ = read_until(sock, lambda d: b"\r\n\r\n" in d)
        assert data == b"HTTP/1.1 100 Continue\r\n\r\n"
        payload = json.dumps({"model": "served", "prompt": "chunked"}).encode()
        sock.sendall(f"{len(payload[:10]):x}\r\n".encode() + payload[:10] + b"\r\n"
                     + f"{len(payload[10:]):x}\r\n".encode() + payload[10:] + b"\r\n0\r\n\r\n")
        data, _ = read_until(sock, lambda d: b"text_completion" in d)
    assert data.startswith(b"HTTP/1.1 200 OK")
    assert engine.seen[-1][0] == {"model": "served", "prompt": "chunked"}


def test_requests_share_kept_alive_engine_connections(routed: str, engine: FakeEngine) -> None:
    # Issue 22: a new engine connection per request cost ~2 ms of TTFT on the H200.
    for _ in range(3):
        assert requests.post(routed + "/v1/completions", json={"model": "served"},
                             timeout=5).status_code == 200
    assert len(engine.ports) == 3 and len(set(engine.ports)) == 1


def test_an_engine_that_sends_nothing_gets_504_after_the_read_timeout(engine: FakeEngine) -> None:
    with router(engine.url, limits=Limits(read_timeout=1.0)) as url:
        began = time.monotonic()
        answer = requests.post(url + "/v1/completions", json={"model": "served", "think": True},
                               timeout=10)
        assert answer.status_code == 504 and time.monotonic() - began < 4
        error = answer.json()["error"]
        assert error["type"] == "GatewayTimeoutError" and "ROUTER_UPSTREAM_READ_TIMEOUT" in error["message"]
        assert engine.gone.wait(3)  # the engine connection was closed: it aborts the request


def test_one_malformed_engine_answer_is_502_and_the_engine_stays(routed: str) -> None:
    answer = requests.post(routed + "/v1/completions", json={"model": "served", "garble": True},
                           timeout=5)
    assert answer.status_code == 502 and answer.json()["error"]["type"] == "BadGatewayError"
    # The engine still answers /health: it stays, no reload (issue 22: one bad answer reloaded).
    health = requests.get(routed + "/v1/health", timeout=5).json()
    assert health["state"] == "ready" and len(health["swaps"]) == 1
    assert requests.post(routed + "/v1/completions", json={"model": "served"},
                         timeout=5).status_code == 200


def test_engine_errors_pass_through_and_a_run_of_them_keeps_a_healthy_engine(
        engine: FakeEngine) -> None:
    with router(engine.url, limits=Limits(error_run=2)) as url:
        first = requests.post(url + "/v1/completions", json={"model": "served", "fail": True},
                              timeout=5)
        assert first.status_code == 500 and first.json()["error"]["message"] == "EngineCore died"
        requests.post(url + "/v1/completions", json={"model": "served", "fail": True}, timeout=5)

        def served() -> dict[str, Any]:
            state: dict[str, Any] = requests.get(url + "/v1/health", timeout=5).json()["models"]["served"]
            return state

        # Its /health answers 200: kept, not reloaded (issue 35; tests/test_router_faults.py).
        assert served()["state"] == "ready"
        assert requests.post(url + "/v1/completions", json={"model": "served"},
                             timeout=5).status_code == 200


def test_a_body_over_the_limit_is_413_typed_as_the_clients(engine: FakeEngine) -> None:
    with router(engine.url, limits=Limits(max_body=2048)) as url:
        answer = requests.post(url + "/v1/completions", timeout=5,
                               json={"model": "served", "prompt": "x" * 4096})
        assert answer.status_code == 413
        assert answer.json()["error"]["type"] == "RequestTooLargeError" and engine.seen == []
