"""The dashboard's router card in headless Chromium (issue 21): per engine awake or asleep, how it
swaps, what it holds on the card and in host RAM, and the last swaps with their split (sleep,
stop, wake or load, first answer), from the router's /v1/health as the router writes it."""

from __future__ import annotations

import importlib.util
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from conftest import need
from helpers import free_port, wait_for
from test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS

from vllmstack.dashboard.app import DashboardSettings, create_app

pytestmark = pytest.mark.browser

SWAP = {"unloaded": "qwen3-8b", "loaded": "qwen3-0.6b", "stop_s": 0.0, "start_s": 0.0,
        "boot_s": 0.0, "warmup_s": 0.0, "sleep_s": 0.07, "wake_s": 0.38, "slept": ["qwen3-8b"],
        "stopped": [], "util": None, "first_s": 0.16, "request_s": 0.62, "total_s": 0.45,
        "ok": True, "reason": "request", "at": 0.0, "error": None}
HEALTH = {
    "status": "ok", "loaded": "qwen3-0.6b", "state": "ready", "queue": 0, "inflight": 0,
    "models": {"qwen3-0.6b": {"state": "ready"}, "qwen3-8b": {"state": "asleep"},
               "tiny-gguf": {"state": "unloaded"}},
    "awake": ["qwen3-0.6b"], "asleep": ["qwen3-8b"],
    "engines": {
        "qwen3-0.6b": {"state": "ready", "swap": "sleep", "gpu_gib": 58.72, "host_gib": 0.0,
                       "tier": "awake", "swap_s": 0.0},
        "qwen3-8b": {"state": "asleep", "swap": "sleep", "gpu_gib": 1.3, "host_gib": 15.26,
                     "tier": "asleep", "swap_s": 0.7},
        "tiny-gguf": {"state": "unloaded", "swap": "restart", "gpu_gib": 0, "host_gib": 0}},
    "plan": {"card_gib": 139.8, "capacity_gib": 138.8, "host_limit_gib": 1000.0,
             "policy": "lru", "exclusive": False},
    "swaps": [SWAP],
}


@pytest.fixture
def page_url(tmp_path: Path) -> Iterator[str]:
    need(CHROMIUM.exists(), "Chromium at /usr/bin/chromium (scripts/test-env.sh installs it)")
    need(importlib.util.find_spec("playwright") is not None, "the playwright package (dev extra)")
    import uvicorn

    class Router(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(HEALTH).encode()
            self.send_response(200 if self.path == "/v1/health" else 404)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None: ...

    router = ThreadingHTTPServer(("127.0.0.1", 0), Router)
    threading.Thread(target=router.serve_forever, daemon=True).start()
    settings = DashboardSettings(engine_url="http://127.0.0.1:9", history_dir=tmp_path / "h",
                                 router_url=f"http://127.0.0.1:{router.server_address[1]}",
                                 poll_interval=0.5)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, what="the dashboard listening")
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.should_exit = True
        thread.join(15)
        router.shutdown()


def test_the_router_card_shows_each_engine_and_the_split_of_each_swap(page_url: str) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page()
        page.goto(page_url)
        page.wait_for_selector("#card-router:not([hidden]) #router-engines tr", timeout=15000)
        engines = page.eval_on_selector_all(
            "#router-engines tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))")
        swaps = page.eval_on_selector_all(
            "#router-swaps tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))")
        plan = page.text_content("#router-plan")
        browser.close()
    # The loaded engines, awake and asleep (an unloaded one is not listed), with their tier, the
    # swap back it expects from there, and their memory.
    assert engines == [["qwen3-0.6b", "awake", "sleep", "awake", "58.72", "0"],
                       ["qwen3-8b", "asleep", "sleep", "asleep (0.70 s)", "1.3", "15.26"]]
    assert swaps == [["qwen3-8b → qwen3-0.6b", "0.07", "0.00", "0.38", "0.00", "0.16", "yes"]]
    assert plan is not None and "139.8 GiB card" in plan and "evict lru" in plan
