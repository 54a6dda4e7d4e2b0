"""The dashboard's HTTP API: metrics, runs (lock, race, cancel), history, auth, the page."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from helpers import free_port

from vllmstack.bench.client.row import ROW_VERSION
from vllmstack.bench.report import history
from vllmstack.core.paths import Project
from vllmstack.dashboard.__main__ import main, parse_settings
from vllmstack.dashboard.app import DashboardError, DashboardSettings, create_app
from vllmstack.dashboard.runs import RunError, bench_command

DATA = Path(__file__).parent / "data"
LOCAL = "http://127.0.0.1:8083"

# A fake run: prints, starts a grandchild that would outlive it, records both pids, then sleeps.
RUN_SCRIPT = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    pidfile, seconds, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("starting run", flush=True)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(pidfile, "w") as fh:
        fh.write(f"{os.getpid()} {child.pid}")
    print(f"child {child.pid}", flush=True)
    time.sleep(seconds)
    print("run done", flush=True)
    sys.exit(3 if mode == "fail" else 0)
""")


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return fields[0] != "Z"


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


class Engine:
    """What the fake fetch returns: a /metrics text, or an exception to raise."""

    def __init__(self) -> None:
        self.text: str | None = (DATA / "metrics-load.txt").read_text()
        self.error: Exception | None = None

    async def fetch(self) -> str:
        if self.error is not None:
            raise self.error
        assert self.text is not None
        return self.text


class FakeRuns:
    def __init__(self, tmp: Path) -> None:
        self.pidfile = tmp / "pids"
        self.seconds = 60.0
        self.mode = "ok"
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def build(self, kind: str, options: Mapping[str, Any]) -> list[str]:
        self.calls.append((kind, dict(options)))
        return [sys.executable, "-c", RUN_SCRIPT, str(self.pidfile), str(self.seconds), self.mode]

    def pids(self) -> tuple[int, int]:
        wait_for(lambda: self.pidfile.exists() and len(self.pidfile.read_text().split()) == 2)
        parent, child = self.pidfile.read_text().split()
        return int(parent), int(child)


def settings_for(tmp: Path, **kw: Any) -> DashboardSettings:
    # Port 9 (discard) refuses connections: /v1/models lookups fail fast.
    base: dict[str, Any] = dict(engine_url="http://127.0.0.1:9", history_dir=tmp / "hist",
                                cancel_grace=1.0)
    base.update(kw)
    return DashboardSettings(**base)


@pytest.fixture
def engine() -> Engine:
    return Engine()


@pytest.fixture
def fake_runs(tmp_path: Path) -> FakeRuns:
    return FakeRuns(tmp_path)


@pytest.fixture
def client(tmp_path: Path, engine: Engine, fake_runs: FakeRuns) -> Iterator[TestClient]:
    app = create_app(settings_for(tmp_path), fetch_text=engine.fetch, build_command=fake_runs.build,
                     poll=False)
    with TestClient(app, base_url=LOCAL) as c:
        yield c


def poll(client: TestClient) -> dict[str, Any]:
    result: dict[str, Any] = client.portal.call(client.app.state.poll_once)  # type: ignore[attr-defined]
    return result


# --- metrics -------------------------------------------------------------------------------


def test_metrics_from_engine(client: TestClient) -> None:
    r = client.get("/api/metrics")
    assert r.status_code == 200
    m = r.json()
    assert m["engine_up"] is True
    assert m["kv_cache_usage"] == pytest.approx(0.0005094057339152247)
    assert m["requests_running"] == 16
    assert m["requests_waiting"] == 0
    assert m["model"] == "tiny"
    assert m["kv_cache_tokens"] == 28896432
    assert m["block_size"] == 16
    assert m["prefix_hit_total"] == pytest.approx(48 / 10353)
    assert {"prompt_tps", "generation_tps", "ttft_window", "itl_window",
            "spec_acceptance_window"} <= set(m)
    assert r.headers["cache-control"] == "no-store"


def test_rates_appear_after_two_polls(client: TestClient, engine: Engine) -> None:
    engine.text = (DATA / "metrics-load.txt").read_text()
    poll(client)
    time.sleep(0.05)
    engine.text = (DATA / "metrics-after.txt").read_text()
    m = poll(client)
    assert m["generation_tps_raw"] is not None and m["generation_tps_raw"] > 0
    # Only generation moved between the two captures; prefill did not.
    assert m["prompt_tps_raw"] == 0
    assert m["itl_window"] == pytest.approx((17.863654745000133 - 12.57260391900013)
                                            / (6531 - 4533))
    assert client.get("/api/metrics").json()["ts"] == m["ts"]


def test_metrics_while_engine_down_is_200(client: TestClient, engine: Engine) -> None:
    engine.error = httpx.ConnectError("connection refused")
    m = poll(client)
    r = client.get("/api/metrics")
    assert r.status_code == 200
    assert r.json() == m
    assert m["engine_up"] is False
    assert "127.0.0.1:9/metrics" in m["error"] and "refused" in m["error"]
    assert m["kv_cache_usage"] is None and m["requests_running"] is None
    assert m["retry_in"] > 1.0  # backing off
    assert client.get("/api/health").json() == {"ok": True, "engine_up": False,
                                                "engine_url": "http://127.0.0.1:9"}


def test_metrics_history_ring(client: TestClient, engine: Engine) -> None:
    for _ in range(3):
        poll(client)
    engine.error = RuntimeError("boom")
    poll(client)
    points = client.get("/api/metrics/history").json()["points"]
    assert len(points) == 4
    assert points[0]["running"] == 16 and points[0]["up"] is True
    assert points[-1]["up"] is False and points[-1]["kv"] is None
    assert set(points[0]) >= {"ts", "kv", "running", "waiting", "hit", "pp", "tg", "ttft", "itl"}
    assert len(client.get("/api/metrics/history?limit=2").json()["points"]) == 2
    assert client.get("/api/metrics/history?limit=0").json()["points"] == []


def test_background_poller_fills_the_ring(tmp_path: Path, engine: Engine) -> None:
    app = create_app(settings_for(tmp_path, poll_interval=0.05), fetch_text=engine.fetch)
    with TestClient(app, base_url=LOCAL) as c:
        wait_for(lambda: len(c.get("/api/metrics/history").json()["points"]) >= 3, 5)
    assert app.state.live.latest["engine_up"] is True


def test_info(client: TestClient) -> None:
    info = client.get("/api/info").json()
    assert info["engine_url"] == "http://127.0.0.1:9"
    assert info["auth_required"] is False
    assert info["run_kinds"] == ["bench", "depth", "conc"]
    assert info["model"] is None  # the engine did not answer /v1/models
    assert info["active_run"] is None


# --- runs ----------------------------------------------------------------------------------


def test_run_start_state_log_and_finish(client: TestClient, fake_runs: FakeRuns) -> None:
    fake_runs.seconds = 0.3
    r = client.post("/api/runs/bench", json={"pp": 64, "tg": 8, "runs": 1})
    assert r.status_code == 202
    assert r.json()["status"] == "running"
    assert fake_runs.calls == [("bench", {"pp": 64, "tg": 8, "runs": 1})]
    _parent, child = fake_runs.pids()
    wait_for(lambda: client.get("/api/runs/bench").json()["status"] == "finished")
    state = client.get("/api/runs/bench").json()
    assert state["returncode"] == 0 and state["running"] is False
    assert "starting run" in state["log"] and "run done" in state["log"]
    # The run's leftover grandchild does not outlive it.
    wait_for(lambda: not alive(child), 5)
    assert client.get("/api/runs").json()["active"] is None


def test_second_start_is_409_for_any_kind(client: TestClient, fake_runs: FakeRuns) -> None:
    assert client.post("/api/runs/depth").status_code == 202
    for kind in ("bench", "depth", "conc"):
        r = client.post(f"/api/runs/{kind}")
        assert r.status_code == 409
        assert "depth run is in progress" in r.json()["detail"]
    assert len(fake_runs.calls) == 1
    assert client.post("/api/runs/depth/cancel").status_code == 200


def test_cancel_ends_the_whole_process_group(client: TestClient, fake_runs: FakeRuns) -> None:
    assert client.post("/api/runs/conc", json={"duration": 30}).status_code == 202
    parent, child = fake_runs.pids()
    assert alive(parent) and alive(child)
    r = client.post("/api/runs/conc/cancel")
    assert r.status_code == 200
    state = r.json()
    assert state["status"] == "cancelled" and state["running"] is False
    assert not alive(parent)
    wait_for(lambda: not alive(child), 5)
    assert client.post("/api/runs/conc/cancel").status_code == 409
    # The lock is free again.
    assert client.post("/api/runs/bench").status_code == 202
    client.post("/api/runs/bench/cancel")


def test_cancel_kills_a_run_that_ignores_sigterm(client: TestClient, fake_runs: FakeRuns) -> None:
    fake_runs.mode = "stubborn"
    assert client.post("/api/runs/bench").status_code == 202
    parent, child = fake_runs.pids()
    started = time.monotonic()
    state = client.post("/api/runs/bench/cancel").json()
    assert state["status"] == "cancelled"
    assert time.monotonic() - started < 5  # grace (1 s) then SIGKILL
    assert not alive(parent)
    wait_for(lambda: not alive(child), 5)


def test_failed_run_reports_exit_code(client: TestClient, fake_runs: FakeRuns) -> None:
    fake_runs.seconds, fake_runs.mode = 0.1, "fail"
    assert client.post("/api/runs/bench").status_code == 202
    wait_for(lambda: client.get("/api/runs/bench").json()["status"] == "failed")
    state = client.get("/api/runs/bench").json()
    assert state["returncode"] == 3
    assert "exited with code 3" in state["message"]


def test_run_timeout_stops_it(tmp_path: Path, engine: Engine, fake_runs: FakeRuns) -> None:
    app = create_app(settings_for(tmp_path, run_timeouts={"bench": 0.5}, cancel_grace=0.5),
                     fetch_text=engine.fetch, build_command=fake_runs.build, poll=False)
    with TestClient(app, base_url=LOCAL) as c:
        assert c.post("/api/runs/bench").status_code == 202
        parent, child = fake_runs.pids()
        wait_for(lambda: c.get("/api/runs/bench").json()["status"] == "timeout")
        assert "timeout after" in c.get("/api/runs/bench").json()["log"]
        assert not alive(parent)
        wait_for(lambda: not alive(child), 5)


def test_start_failure_releases_the_lock(tmp_path: Path, engine: Engine) -> None:
    def unreachable(kind: str, options: Mapping[str, Any]) -> list[str]:
        raise RunError("the engine at http://127.0.0.1:9 did not say which model it serves")

    app = create_app(settings_for(tmp_path), fetch_text=engine.fetch, build_command=unreachable,
                     poll=False)
    with TestClient(app, base_url=LOCAL) as c:
        r = c.post("/api/runs/bench")
        assert r.status_code == 503
        assert "did not say which model" in r.json()["detail"]
        assert c.get("/api/runs/bench").json()["status"] == "failed"
        assert c.post("/api/runs/bench").status_code == 503  # not 409: nothing holds the lock


def test_default_command_without_engine_model_is_503(tmp_path: Path, engine: Engine) -> None:
    app = create_app(settings_for(tmp_path), fetch_text=engine.fetch, poll=False)
    with TestClient(app, base_url=LOCAL) as c:
        r = c.post("/api/runs/bench")
    assert r.status_code == 503
    assert "GET /v1/models" in r.json()["detail"] and "--model" in r.json()["detail"]


def test_missing_program_is_a_clear_503(tmp_path: Path, engine: Engine) -> None:
    app = create_app(settings_for(tmp_path), fetch_text=engine.fetch, poll=False,
                     build_command=lambda kind, opts: ["/nonexistent/bench-tool", kind])
    with TestClient(app, base_url=LOCAL) as c:
        r = c.post("/api/runs/bench")
        assert r.status_code == 503
        assert "/nonexistent/bench-tool" in r.json()["detail"]
        assert c.get("/api/runs").json()["active"] is None


def test_run_kind_and_options_are_validated(client: TestClient, fake_runs: FakeRuns) -> None:
    assert client.post("/api/runs/stability").status_code == 404
    assert client.get("/api/runs/nope").status_code == 404
    assert client.post("/api/runs/bench", json={"pp": 0}).status_code == 422
    assert client.post("/api/runs/bench", json={"runs": "many"}).status_code == 422
    assert fake_runs.calls == []


@pytest.mark.parametrize(("body", "field"), [
    ('{"runs": true}', "runs"),  # a boolean is not a count
    ('{"pp": "512"}', "pp"),  # nor is text that looks like one
    ('{"tg": 8.0}', "tg"),
    ('{"duration": true}', "duration"),
    ('{"duration": NaN}', "duration"),
    ('{"duration": Infinity}', "duration"),
    ('{"runs": 2, "run": 3}', "run"),  # an unknown field is named, not ignored
    ('{"pp": 64, "extra_body": {"seed": 1}}', "extra_body"),
])
def test_run_options_are_strict(client: TestClient, fake_runs: FakeRuns, body: str,
                                field: str) -> None:
    r = client.post("/api/runs/bench", content=body,
                    headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert any(field in e["loc"] for e in r.json()["detail"]), r.json()
    assert fake_runs.calls == []


def test_run_options_take_whole_seconds_for_duration(client: TestClient,
                                                     fake_runs: FakeRuns) -> None:
    fake_runs.seconds = 0.1
    assert client.post("/api/runs/conc", json={"duration": 5, "pp": 64}).status_code == 202
    assert fake_runs.calls == [("conc", {"duration": 5.0, "pp": 64})]
    client.post("/api/runs/conc/cancel")


def test_bench_command_argv(tmp_path: Path) -> None:
    build = bench_command(python="/py", engine_url="http://e:1", history_dir=tmp_path,
                          model=lambda: "tiny", tokenizer="/tok/tokenizer.json")
    assert build("depth", {"pp": 512, "tg": 32}) == [
        "/py", "-m", "vllmstack.bench", "depth", "--url", "http://e:1", "--model", "tiny",
        "--tokenizer", "/tok/tokenizer.json", "--history-dir", str(tmp_path),
        "--pp", "512", "--tg", "32", "--json"]
    assert "--tokenizer" not in bench_command(python="/py", engine_url="http://e:1",
                                              history_dir=tmp_path, model=lambda: "m")("conc", {})
    # The profile's max_num_seqs tops the concurrency ladder unless the page asks for another.
    conc = bench_command(python="/py", engine_url="http://e:1", history_dir=tmp_path,
                         model=lambda: "m", max_num_seqs=16)
    assert conc("conc", {"duration": 5.0})[-5:] == ["--duration", "5.0", "--max-num-seqs", "16",
                                                    "--json"]
    assert conc("conc", {"max_num_seqs": 4})[-3:] == ["--max-num-seqs", "4", "--json"]


@pytest.fixture
def live_server(tmp_path: Path, engine: Engine, fake_runs: FakeRuns) -> Iterator[str]:
    """The app under a real uvicorn, so requests really arrive together."""
    import uvicorn

    app = create_app(settings_for(tmp_path), fetch_text=engine.fetch,
                     build_command=fake_runs.build, poll=False)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_concurrent_starts_exactly_one_wins(live_server: str, fake_runs: FakeRuns) -> None:
    async def race() -> list[int]:
        async with httpx.AsyncClient(base_url=live_server, timeout=10) as c:
            kinds = ["bench", "depth", "conc"] * 4
            answers = await asyncio.gather(*(c.post(f"/api/runs/{k}") for k in kinds))
            return [a.status_code for a in answers]

    codes = asyncio.run(race())
    assert sorted(codes) == [202] + [409] * 11
    assert len(fake_runs.calls) == 1
    active = httpx.get(f"{live_server}/api/runs").json()["active"]
    assert httpx.post(f"{live_server}/api/runs/{active}/cancel", timeout=10).status_code == 200


# --- history -------------------------------------------------------------------------------


def add_records(folder: Path, kind: str, n: int) -> list[dict[str, Any]]:
    path = history.history_path(folder, kind)
    return [history.append_record(path, {"model": "tiny", "results": [
        {"pp": 64, "tg": 8, "depth": 0, "concurrency": 1, "pp_tps": {"mean": 1000.0 + i}}],
        "raw": "x" * 5000}) for i in range(n)]


def test_history_list_download_delete_clear(client: TestClient, tmp_path: Path) -> None:
    stored = add_records(tmp_path / "hist", "bench", 3)
    r = client.get("/api/history/bench")
    assert r.status_code == 200
    records = r.json()["records"]
    assert [rec["id"] for rec in records] == [s["id"] for s in stored]
    assert records[0]["raw"].endswith("…") and len(records[0]["raw"]) < 5000
    assert records[0]["_truncated"] == ["raw"]
    # Unchanged file: 304 with the same ETag.
    tag = r.headers["etag"]
    assert client.get("/api/history/bench", headers={"If-None-Match": tag}).status_code == 304

    d = client.get(f"/api/history/bench/{stored[1]['id']}")
    assert d.status_code == 200
    assert d.headers["content-disposition"] == f'attachment; filename="bench-{stored[1]["id"]}.json"'
    assert d.json()["raw"] == "x" * 5000
    assert client.get("/api/history/bench/nope").status_code == 404

    assert client.delete(f"/api/history/bench/{stored[1]['id']}").json() == {
        "deleted": stored[1]["id"]}
    assert client.delete(f"/api/history/bench/{stored[1]['id']}").status_code == 404
    r2 = client.get("/api/history/bench", headers={"If-None-Match": tag})
    assert r2.status_code == 200 and len(r2.json()["records"]) == 2

    assert client.post("/api/history/bench/clear").json() == {"removed": 2}
    assert client.get("/api/history/bench").json()["records"] == []
    assert client.get("/api/history/nope").status_code == 404
    assert client.post("/api/history/nope/clear").status_code == 404


def test_history_kinds_are_separate(client: TestClient, tmp_path: Path) -> None:
    add_records(tmp_path / "hist", "depth", 2)
    assert len(client.get("/api/history/depth").json()["records"]) == 2
    assert client.get("/api/history/conc").json()["records"] == []


def test_history_rows_are_typed_and_a_newer_row_is_marked(client: TestClient, tmp_path: Path) -> None:
    path = history.history_path(tmp_path / "hist", "conc")
    old = history.append_record(path, {"model": "tiny", "results": [
        {"pp": 64, "tg": 8, "depth": 0, "concurrency": 2, "total_tg_tps": 90.0}]})
    newer = history.append_record(path, {"model": "tiny", "results": [
        {"concurrency": 2, "total_tg_tps": "fast", "row_version": ROW_VERSION + 1}]})
    first, second = client.get("/api/history/conc").json()["records"]
    # An old row goes out as BenchRow writes it: every key a row always has, missing ones null.
    (row,) = first["results"]
    assert row["total_tg_tps"] == 90.0 and row["tg_tps"] is None and row["pp_note"] is None
    assert row["row_version"] == ROW_VERSION and "_unread" not in first
    # A row this checkout cannot read goes out as stored, with the reason the page shows.
    assert second["results"] == newer["results"]
    assert second["_unread"].startswith(f"conc_history.jsonl record {newer['id']}, row 1: the row "
                                        f"is of row_version {ROW_VERSION + 1}")
    assert old["id"] == first["id"]


# --- auth ----------------------------------------------------------------------------------


def test_exposed_without_token_refuses_to_start(tmp_path: Path) -> None:
    with pytest.raises(DashboardError, match="DASHBOARD_TOKEN"):
        create_app(settings_for(tmp_path, host="0.0.0.0"), poll=False)
    # In a container it binds 0.0.0.0 but the host publishes the port on loopback only.
    create_app(settings_for(tmp_path, host="0.0.0.0", exposure="127.0.0.1"), poll=False)


def test_token_required_when_exposed(tmp_path: Path, engine: Engine, fake_runs: FakeRuns) -> None:
    app = create_app(settings_for(tmp_path, host="0.0.0.0", token="s3cret"),
                     fetch_text=engine.fetch, build_command=fake_runs.build, poll=False)
    stored = add_records(tmp_path / "hist", "bench", 1)
    with TestClient(app, base_url="http://192.168.1.20:8083") as c:
        info = c.get("/api/info").json()
        assert info["auth_required"] is True and info["authorized"] is False
        assert "engine_url" not in info and "engine_url" not in c.get("/api/health").json()
        # Reading needs the token too (a DNS-rebinding page must not read history or run logs).
        for url in ("/api/metrics", "/api/history/bench", "/api/runs", "/api/runs/bench",
                    "/api/router", f"/api/history/bench/{stored[0]['id']}"):
            assert c.get(url).status_code == 401, url
            assert c.get(url, headers={"X-Dashboard-Token": "s3cret"}).status_code == 200, url
        assert c.get("/api/info", headers={"Authorization": "Bearer s3cret"}).json()["authorized"]
        for method, url in (("POST", "/api/runs/bench"), ("POST", "/api/runs/bench/cancel"),
                            ("POST", "/api/history/bench/clear"),
                            ("DELETE", f"/api/history/bench/{stored[0]['id']}")):
            r = c.request(method, url)
            assert r.status_code == 401, url
            assert "DASHBOARD_TOKEN" in r.json()["detail"]
            assert c.request(method, url, headers={"X-Dashboard-Token": "wrong"}).status_code == 401
        assert fake_runs.calls == []
        assert c.post("/api/runs/bench", headers={"Authorization": "Bearer s3cret"}).status_code == 202
        assert c.post("/api/runs/bench/cancel",
                      headers={"X-Dashboard-Token": "s3cret"}).status_code == 200
        assert c.post("/api/history/bench/clear",
                      headers={"X-Dashboard-Token": "s3cret"}).json() == {"removed": 1}


def test_loopback_rejects_foreign_origin_and_host(client: TestClient, fake_runs: FakeRuns) -> None:
    # A web page elsewhere (cross-site request) or a DNS-rebinding name cannot start runs.
    r = client.post("/api/runs/bench", headers={"Origin": "http://evil.example"})
    assert r.status_code == 403
    assert client.post("/api/runs/bench", headers={"Host": "evil.example:8083"}).status_code == 403
    assert client.post("/api/history/bench/clear",
                       headers={"Origin": "http://evil.example"}).status_code == 403
    assert fake_runs.calls == []
    ok = client.post("/api/runs/bench", headers={"Origin": "http://localhost:8083"})
    assert ok.status_code == 202
    client.post("/api/runs/bench/cancel")


# --- page and entry point ------------------------------------------------------------------


def test_page_and_vendored_chartjs(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert 'src="vendor/chart.umd.min.js"' in page.text
    chart = client.get("/vendor/chart.umd.min.js")
    assert chart.status_code == 200 and chart.text.startswith("/*!\n * Chart.js v4.6.1")
    assert client.get("/app.js").status_code == 200
    assert client.get("/vendor/LICENSE.md").status_code == 200


def test_no_cdn_references_in_the_page() -> None:
    static = Path(__file__).resolve().parents[1] / "vllmstack" / "dashboard" / "static"
    for name in ("index.html", "app.js", "style.css"):
        text = (static / name).read_text()
        assert "http://" not in text and "https://" not in text, name


def test_entry_point_settings(tmp_path: Path) -> None:
    s = parse_settings(["--engine-url", "http://e:8180", "--history-dir", str(tmp_path),
                        "--host", "0.0.0.0", "--port", "9000"],
                       {"DASHBOARD_TOKEN": "t", "DASHBOARD_BIND": "127.0.0.1",
                        "VLLM_TOKENIZER": "/tok"})
    assert (s.host, s.port, s.token, s.exposure, s.tokenizer) == ("0.0.0.0", 9000, "t",
                                                                  "127.0.0.1", "/tok")
    assert s.auth_required is True  # a token set is a token required


def test_entry_point_refuses_exposed_without_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("DASHBOARD_TOKEN", raising=False)
    monkeypatch.delenv("DASHBOARD_BIND", raising=False)
    code = main(["--engine-url", "http://e:1", "--history-dir", str(tmp_path), "--host", "0.0.0.0"])
    assert code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "DASHBOARD_TOKEN" in err and "Traceback" not in err
    assert not os.environ.get("DASHBOARD_TOKEN")


def test_settings_from_profile(tmp_path: Path) -> None:
    from vllmstack.config.profiles import Resolved, Setting
    from vllmstack.dashboard.__main__ import settings_from_profile

    env = {"VLLM_PORT": "8180", "DASHBOARD_PORT": "8090", "DASHBOARD_BIND": "127.0.0.1",
           "DASHBOARD_TOKEN": "", "VLLM_TOKENIZER": "/models/tok"}
    values = Resolved("cpu", "test", {k: Setting(k, v, "test") for k, v in env.items()}, [])
    s = settings_from_profile(values, tmp_path)
    assert (s.engine_url, s.host, s.port, s.tokenizer) == ("http://127.0.0.1:8180", "127.0.0.1",
                                                           8090, "/models/tok")
    assert s.auth_required is False
    # Another engine: the profile's tokenizer may not fit it, so only --tokenizer counts.
    other = settings_from_profile(values, tmp_path, engine_url="http://gpu-box:8000", port=9)
    assert (other.engine_url, other.port, other.tokenizer) == ("http://gpu-box:8000", 9, None)


def test_settings_for_stack_profile_and_fallback(project: Project, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from vllmstack.config.profiles import ProfileError
    from vllmstack.dashboard.__main__ import settings_for_stack

    s = settings_for_stack(project, {}, model="qwen3-0.6b", platform="cpu",
                           sets=["VLLM_PORT=8111", "VLLM_MAX_NUM_SEQS=5"], port="9001")
    assert (s.engine_url, s.port, s.max_num_seqs) == ("http://127.0.0.1:8111", 9001, 5)
    assert s.history_dir == project.results
    # No profile at all: an error, unless --engine-url says where the engine is; then every
    # setting takes its schema default and a note says so.
    empty = Project(tmp_path / "empty")
    with pytest.raises(ProfileError):
        settings_for_stack(empty, {})
    s = settings_for_stack(empty, {}, engine_url="http://gpu-box:8000")
    assert (s.engine_url, s.host, s.port, s.token, s.tokenizer, s.max_num_seqs) == (
        "http://gpu-box:8000", "127.0.0.1", 8083, "", None, None)
    assert "note: no profile" in capsys.readouterr().err
    with pytest.raises(DashboardError, match="--port must be a number, got 'x'"):
        settings_for_stack(empty, {}, engine_url="http://gpu-box:8000", port="x")


def test_profile_value_that_is_not_a_number_is_named(tmp_path: Path) -> None:
    from vllmstack.bench.target import TargetError
    from vllmstack.config.profiles import Resolved, Setting
    from vllmstack.dashboard.__main__ import settings_from_profile

    bad = Resolved("cpu", "test", {"VLLM_MAX_NUM_SEQS": Setting("VLLM_MAX_NUM_SEQS", "four",
                                                                "env/models/x.env:3")}, [])
    with pytest.raises(TargetError, match="VLLM_MAX_NUM_SEQS='four' is not a whole number"):
        settings_from_profile(bad, tmp_path)
    # The container's environment default stays lenient: the flag can still set it.
    s = parse_settings(["--engine-url", "http://e:1", "--history-dir", str(tmp_path)],
                       {"VLLM_MAX_NUM_SEQS": "four"})
    assert s.max_num_seqs is None


# --- the router's state (issue 14) -------------------------------------------------------------


def test_the_page_shows_the_routers_resident_model_queue_and_swaps(tmp_path: Path) -> None:
    import json as jsonlib
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    health = {"status": "ok", "loaded": "qwen3-0.6b-b", "state": "ready", "queue": 2, "inflight": 1,
              "models": {"qwen3-0.6b": {"state": "unloaded"}, "qwen3-0.6b-b": {"state": "ready"}},
              "swaps": [{"unloaded": "qwen3-0.6b", "loaded": "qwen3-0.6b-b", "stop_s": 0.78,
                         "start_s": 60.7, "ok": True}]}
    seen: list[str | None] = []

    class Router(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            body = jsonlib.dumps(health).encode()
            self.send_response(200 if self.path == "/v1/health" else 404)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None: ...

    server = ThreadingHTTPServer(("127.0.0.1", 0), Router)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        app = create_app(settings_for(tmp_path, router_url=url, router_token="tok"), poll=False)
        with TestClient(app, base_url=LOCAL) as c:
            state = c.get("/api/router").json()
        assert state["running"] is True and state["loaded"] == "qwen3-0.6b-b"
        assert state["queue"] == 2 and state["swaps"][0]["start_s"] == 60.7
        assert seen == ["Bearer tok"]  # the router's token rule applies to the dashboard too
    finally:
        server.shutdown()
    gone = create_app(settings_for(tmp_path, router_url="http://127.0.0.1:9"), poll=False)
    with TestClient(gone, base_url=LOCAL) as c:
        assert c.get("/api/router").json() == {"running": False, "url": "http://127.0.0.1:9"}
