"""The dashboard page in headless Chromium against the engine simulator.

Live numbers must move while traffic flows; a bench, a depth sweep and a concurrency sweep
started from the page must each add a row. Screenshots of both tabs go to test-artifacts/.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import need
from helpers import free_port, wait_for

from vllmstack.dashboard.app import DashboardSettings, create_app

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]


def traffic(url: str, stop: threading.Event) -> None:
    """Chat requests with a shared prefix, back to back, until stopped."""
    i = 0
    while not stop.is_set():
        body = json.dumps({"model": "tiny", "max_tokens": 48, "messages": [
            {"role": "user", "content": "Tell me about the sea. " * 20 + str(i % 4)}]}).encode()
        request = urllib.request.Request(f"{url}/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                response.read()
        except OSError:
            time.sleep(0.1)
        i += 1


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[str]:
    need(CHROMIUM.exists(), "Chromium at /usr/bin/chromium (scripts/test-env.sh installs it)")
    need(importlib.util.find_spec("playwright") is not None, "the playwright package (dev extra)")
    need(importlib.util.find_spec("tokenizers") is not None, "the tokenizers package (bench extra)")
    import uvicorn
    from simulator.fixture import run_simulator

    from vllmstack.workload.selftest_tokenizer import train_corpus_tokenizer

    tokenizer = train_corpus_tokenizer(tmp_path / "tok" / "tokenizer.json")
    sim_env = {"SIM_TOKENIZER": str(tokenizer), "SIM_ITL_MS": "5", "SIM_BOOT_SECONDS": "0.2"}
    with run_simulator(env=sim_env, argv=["--served-model-name", "tiny", "--max-num-seqs", "8",
                                          "--max-model-len", "4096"]) as sim:
        settings = DashboardSettings(engine_url=sim.url, history_dir=tmp_path / "history",
                                     tokenizer=str(tokenizer), max_num_seqs=8, poll_interval=0.5)
        # The runs are `python -m vllmstack.bench`: make this checkout importable for them.
        environ = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
        app = create_app(settings, environ=environ)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                               log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        stop = threading.Event()
        load = [threading.Thread(target=traffic, args=(sim.url, stop), daemon=True)
                for _ in range(3)]
        try:
            wait_for(lambda: server.started, what="the dashboard listening")
            for t in load:
                t.start()
            yield f"http://127.0.0.1:{port}"
        finally:
            stop.set()
            server.should_exit = True
            thread.join(15)


def test_page_shows_live_numbers_and_runs_benchmarks(stack: str) -> None:
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    requested: list[str] = []
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("request", lambda r: requested.append(r.url))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(stack + "/")

            # Live tab: the engine is up and the cumulative counters move with the traffic.
            expect(page.locator("#engine-badge")).to_have_text("engine: up", timeout=15_000)
            expect(page.locator("#model-badge")).to_have_text("model: tiny")
            first = page.locator("#hit-counts").inner_text()
            page.wait_for_function(
                "first => document.querySelector('#hit-counts').textContent !== first",
                arg=first, timeout=15_000)
            page.wait_for_function(
                "() => parseFloat(document.querySelector('#tps-gen').textContent) > 0",
                timeout=15_000)
            assert page.locator("#req-running").inner_text() != "–"
            assert page.locator("#kv-pct").inner_text().endswith("%")

            # A hidden tab stops polling; showing it again resumes at once.
            def metric_polls() -> int:
                return sum(1 for url in requested if url.endswith("/api/metrics"))

            page.evaluate("""() => {
                Object.defineProperty(document, "hidden", {value: true, configurable: true});
                document.dispatchEvent(new Event("visibilitychange"));
            }""")
            # Playwright delivers request events only inside its own calls: wait with it.
            page.wait_for_timeout(600)  # a poll already in flight may still land
            before = metric_polls()
            page.wait_for_timeout(2500)
            assert metric_polls() == before
            page.evaluate("""() => {
                Object.defineProperty(document, "hidden", {value: false, configurable: true});
                document.dispatchEvent(new Event("visibilitychange"));
            }""")
            deadline = time.monotonic() + 5
            while metric_polls() == before and time.monotonic() < deadline:
                page.wait_for_timeout(100)
            assert metric_polls() > before
            page.wait_for_timeout(3000)  # a few more points on the charts for the screenshot
            page.evaluate("window.scrollTo(0, 0)")
            page.screenshot(path=str(ARTIFACTS / "dashboard-live.png"), full_page=True)

            # Benchmarks tab: start each kind from the page; one at a time, each adds a row.
            page.click("#tab-bench")
            runs = {
                "bench": {"pp": "64", "tg": "8", "runs": "1"},
                "depth": {"pp": "64", "tg": "8", "runs": "1"},
                "conc": {"pp": "64", "tg": "16", "duration": "1", "max_num_seqs": "4"},
            }
            for kind, fields in runs.items():
                card = page.locator(f"#kind-{kind}")
                expect(card.locator(".empty")).to_be_visible()
                for name, value in fields.items():
                    card.locator(f"input[name='{name}']").fill(value)
                card.locator(".run-start").click()
                # While it runs, every Run button is locked.
                expect(page.locator("#kind-bench .run-start")).to_be_disabled(timeout=5_000)
                expect(card.locator("tbody tr[data-record]").first).to_be_visible(timeout=90_000)
                expect(card.locator(".run-status")).to_have_text("finished", timeout=15_000)
                expect(card.locator(".run-start")).to_be_enabled()
                assert "tiny" in card.locator("tbody tr").first.inner_text()
            page.evaluate("window.scrollTo(0, 0)")  # the sticky tab bar belongs at the top
            page.screenshot(path=str(ARTIFACTS / "dashboard-benchmarks.png"), full_page=True)
        finally:
            browser.close()
    assert errors == []
    # Everything the page loaded came from the dashboard itself: no CDN.
    assert requested and all(url.startswith(stack) for url in requested), requested
    assert (ARTIFACTS / "dashboard-live.png").stat().st_size > 10_000
    assert (ARTIFACTS / "dashboard-benchmarks.png").stat().st_size > 10_000
    assert sys.executable  # the runs used this interpreter (bench_command's default)


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[str]:
    """A dashboard that needs a token, with the engine down and a tiny fake run command."""
    need(CHROMIUM.exists(), "Chromium at /usr/bin/chromium (scripts/test-env.sh installs it)")
    need(importlib.util.find_spec("playwright") is not None, "the playwright package (dev extra)")
    import uvicorn

    settings = DashboardSettings(engine_url="http://127.0.0.1:9", history_dir=tmp_path / "h",
                                 host="127.0.0.1", exposure="192.168.1.20", token="s3cret",
                                 poll_interval=0.5)
    app = create_app(settings, build_command=lambda kind, opts: [
        sys.executable, "-c", "print('fake run', flush=True)"])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, what="the dashboard listening")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def test_page_explains_the_token_and_the_engine_outage(guarded: str) -> None:
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(guarded + "/#bench")
            banner = page.locator("#auth-banner")
            expect(banner).to_be_visible(timeout=10_000)
            expect(banner).to_contain_text("reachable at 192.168.1.20")
            expect(banner).to_contain_text("DASHBOARD_TOKEN")
            card = page.locator("#kind-bench")
            card.locator(".run-start").click()
            expect(card.locator(".run-status")).to_contain_text("token missing or wrong")
            page.fill("#token-input", "s3cret")
            page.click("#token-save")
            card.locator(".run-start").click()
            expect(card.locator(".run-status")).to_have_text("finished", timeout=15_000)
            card.locator(".run-log-box summary").click()
            expect(card.locator(".run-log")).to_contain_text("fake run")

            page.click("#tab-live")
            expect(page.locator("#engine-badge")).to_have_text("engine: down", timeout=10_000)
            # While the engine is down the page backs off (2, 4, 8, 10 s) instead of polling
            # every 0.5 s: at most a handful of polls in 6 s, not twelve.
            polls: list[str] = []
            page.on("request", lambda r: polls.append(r.url)
                    if r.url.endswith("/api/metrics") else None)
            page.wait_for_timeout(6000)
            assert len(polls) <= 4, polls
            note = page.locator("#down-note")
            expect(note).to_contain_text("The engine has not answered")
            expect(note).to_contain_text("127.0.0.1:9/metrics")
            page.evaluate("window.scrollTo(0, 0)")
            page.screenshot(path=str(ARTIFACTS / "dashboard-token-engine-down.png"),
                            full_page=True)
        finally:
            browser.close()
