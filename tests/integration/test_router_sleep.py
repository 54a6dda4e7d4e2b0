"""The router in sleep mode for real (issue 21): `python -m vllmstack.router` over engine
simulators that sleep and wake like vLLM (`--enable-sleep-mode`, dev-mode endpoints), each a
named engine of the checkout on its own loopback port, on a stand-in card: a folder the stack's
GPU probe reads (GPU_MEMORY_DIR) and every simulator writes what it holds into (the budget
awake, the residue asleep; nothing once it exits). A simulator refuses to boot, as vLLM does,
when less of the card is free than its gpu_memory_utilization asks for.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers import free_port, simulator_project
from test_router import Router, engine_processes

from vllmstack.runtime.gpu import GIB, StandinProbe, total_used

CARD = 16 * GIB
FAST = "SIM_BOOT_SECONDS=0.2 SIM_SLEEP_MS=5 SIM_WAKE_MS=5 SIM_FIRST_SLEEP_MS=1500 SIM_TTFT_MS=5"


def project_with(tmp_path: Path, profiles: dict[str, str], **settings: str) -> tuple[Path, Path]:
    card = tmp_path / "card"
    card.mkdir()
    (card / "total").write_text(f"{CARD}\n")
    env = {name: f"{FAST} SIM_GPU_MEMORY_DIR={card} {extra}".strip()
           for name, extra in profiles.items()}
    root = simulator_project(tmp_path / "stack", env, port=free_port(), settings={
        "GPU_MEMORY_DIR": str(card), "ROUTER_SWAP": "sleep", "ROUTER_SWAP_GRACE": "0",
        "VLLM_GPU_MEM_UTIL": "0.6", **settings})
    own_ports(root, profiles)
    return root, card


def own_ports(root: Path, profiles: dict[str, str]) -> None:
    """A free port per profile (in the profile, not .env, which would win over it): the
    router's next-port-up rule could meet a port another program on this machine holds."""
    dotenv = root / ".env"
    dotenv.write_text("".join(line for line in dotenv.read_text().splitlines(keepends=True)
                              if not line.startswith("VLLM_PORT=")))
    for name in profiles:
        with (root / "env" / "models" / f"{name}.env").open("a") as handle:
            handle.write(f"VLLM_PORT={free_port()}\n")


@pytest.fixture
def routers() -> Iterator[list[Router]]:
    started: list[Router] = []
    yield started
    for router in started:
        router.stop(signal.SIGKILL)
        for pid in engine_processes(router.root):
            os.kill(pid, signal.SIGKILL)


def start(routers: list[Router], root: Path, profiles: dict[str, str], *args: str) -> Router:
    # A second --profiles wins over the one Router passes (argparse keeps the last).
    router = Router(root, 0, "--profiles", ",".join(profiles), *args)
    routers.append(router)
    return router.wait_ready()


def engine_url(router: Router, model: str) -> str:
    return str(router.health()["engines"][model]["url"])


def sim_counts(url: str) -> dict[str, Any]:
    data: dict[str, Any] = requests.get(url + "/is_sleeping", timeout=5).json()["sim"]
    return data


def load(router: Router, model: str) -> None:
    answer = requests.post(router.url + "/v1/load", json={"model": model}, timeout=60)
    assert answer.status_code == 200, answer.text


class CardWatch:
    """Samples the stand-in card and the router's awake engines while a test runs."""

    def __init__(self, card: Path, router: Router) -> None:
        self.probe, self.router = StandinProbe(card), router
        self.used: list[int] = []
        self.awake: list[int] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run)
        self.thread.start()

    def run(self) -> None:
        while not self.done.is_set():
            self.used.append(total_used(self.probe.memory()) or 0)
            with contextlib.suppress(requests.RequestException, ValueError):
                self.awake.append(len(self.router.health()["awake"]))
            time.sleep(0.005)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


@pytest.mark.slow  # two boots, 200 requests with 199 swaps: about 15 s
def test_200_alternating_requests_swap_by_sleep_and_none_reaches_a_sleeping_engine(
        tmp_path: Path, routers: list[Router]) -> None:
    profiles = {"sim-a": "", "sim-b": ""}
    root, card = project_with(tmp_path, profiles)
    router = start(routers, root, profiles)
    # Loaded through the API, with no client waiting: each pays its first (slow) sleep at load.
    load(router, "sim-a")
    load(router, "sim-b")
    engines = router.health()["engines"]
    assert engines["sim-a"]["state"] == "asleep" and engines["sim-b"]["state"] == "ready"
    assert engines["sim-a"]["primed"] and engines["sim-b"]["primed"]
    assert engines["sim-a"]["url"] != engines["sim-b"]["url"]  # an engine per profile
    watch = CardWatch(card, router)
    failures, began = [], time.monotonic()
    try:
        for i in range(200):
            model = "sim-a" if i % 2 == 0 else "sim-b"
            answer = router.chat(model)
            if answer.status_code != 200 or answer.json()["model"] != model:
                failures.append((i, answer.status_code, answer.text[:200]))
    finally:
        watch.stop()
    elapsed = time.monotonic() - began
    assert failures == [], failures
    # No request reached an engine while it slept (the simulator counts and refuses them).
    for model in profiles:
        counts = sim_counts(engine_url(router, model))
        assert counts["requests_while_asleep"] == 0, (model, counts)
        assert set(counts["levels"]) == {1}  # never level 2
        assert counts["sleeps"] >= 100 and counts["wakes"] >= 99
    # Each engine was booted once; every later swap was a sleep and a wake.
    swaps = router.health()["swaps"]
    requested = [s for s in swaps if s["reason"] == "request"]
    assert requested and all(s["ok"] and s["start_s"] == 0 and s["wake_s"] > 0 for s in requested)
    assert all(s["slept"] and not s["stopped"] for s in requested)
    # The first sleep (1.5 s here) was paid at load, never by a swap with a client waiting.
    assert max(s["sleep_s"] for s in requested) < 1.0, requested
    assert all(s["request_s"] is not None for s in requested)
    # Never more awake than the plan allows (0.6 + 0.6 of a card do not fit together), and the
    # card's own reading never above the card.
    assert max(watch.awake) == 1 and max(watch.used) <= CARD, (max(watch.awake), max(watch.used))
    assert max(watch.used) >= int(CARD * 0.6)  # the stand-in did hold an awake budget
    print(f"200 alternating requests with 199 sleep/wake swaps: {elapsed:.1f} s")


@pytest.mark.slow
def test_a_sleep_that_releases_nothing_falls_back_to_restart_and_is_remembered(
        tmp_path: Path, routers: list[Router]) -> None:
    profiles = {"sim-a": "", "sim-b": "SIM_SLEEP_FAULT=keep-memory"}
    root, card = project_with(tmp_path, profiles)
    router = start(routers, root, profiles)
    load(router, "sim-b")  # its first sleep (at load) frees nothing
    engine = router.health()["engines"]["sim-b"]
    assert engine["state"] == "ready" and engine["swap"] == "restart"
    assert "did not release the GPU memory" in engine["why"]
    assert "sim-b: its sleep did not release the GPU memory" in router.output()
    stored = json.loads((root / "generated" / "router" / "memory.json").read_text())
    assert "did not release" in stored["sim-b"]["fallback"]
    # The swap to sim-a stops sim-b (restart) instead of leaving it "asleep" on the card.
    assert router.chat("sim-a").status_code == 200
    health = router.health()
    assert health["engines"]["sim-b"]["state"] == "unloaded"
    assert health["swaps"][-1]["stopped"] == ["sim-b"] and health["swaps"][-1]["slept"] == []
    assert total_used(StandinProbe(card).memory()) == int(CARD * 0.6)  # sim-a alone
    # A router started later reads the store: sim-b restarts from the start.
    router.stop(signal.SIGTERM)
    again = start(routers, root, profiles)
    assert again.health()["engines"]["sim-b"]["swap"] == "restart"
    assert "delete its entry" in again.health()["engines"]["sim-b"]["why"]


@pytest.mark.slow
def test_sigterm_leaves_no_engine_awake_or_asleep(tmp_path: Path, routers: list[Router]) -> None:
    profiles = {"sim-a": "", "sim-b": ""}
    root, card = project_with(tmp_path, profiles)
    router = start(routers, root, profiles)
    load(router, "sim-a")
    assert router.chat("sim-b").status_code == 200
    health = router.health()
    assert (health["awake"], health["asleep"]) == (["sim-b"], ["sim-a"])
    models = router.models()  # what clients read: asleep beside ready
    assert (models["sim-a"]["state"], models["sim-b"]["state"]) == ("asleep", "ready")
    assert len({p for p in engine_processes(root)}) == 2
    assert router.stop(signal.SIGTERM) == 0
    assert engine_processes(root) == []
    assert total_used(StandinProbe(card).memory()) == 0
    assert "stopping: unloading sim-a (asleep)" in router.output()


@pytest.mark.slow
def test_the_router_engines_listen_on_loopback_only(tmp_path: Path,
                                                    routers: list[Router]) -> None:
    profiles = {"sim-a": "", "sim-b": ""}
    root, _ = project_with(tmp_path, profiles, VLLM_BIND="0.0.0.0")
    router = start(routers, root, profiles)
    assert "its engine listens on 127.0.0.1, not VLLM_BIND=0.0.0.0" in router.output()
    load(router, "sim-a")
    port = int(engine_url(router, "sim-a").rsplit(":", 1)[1])
    listening = listeners(port)
    assert listening == ["127.0.0.1"], listening
    # The dev-mode endpoints answer on the engine (loopback), never through the router.
    for path in ("/sleep", "/wake_up", "/collective_rpc", "/reset_prefix_cache"):
        assert requests.post(router.url + path, timeout=5).status_code == 404
    assert requests.get(router.url + "/is_sleeping", timeout=5).status_code == 404


def listeners(port: int) -> list[str]:
    """The local addresses listening on `port` (/proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hexport = local.partition(":")
            if state == "0A" and int(hexport, 16) == port:
                if len(address) == 8:
                    found.append(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))
                else:
                    found.append(address)
    return found



@pytest.mark.slow  # four boots and 30 swaps over the stand-in card: about 20 s
def test_tiers_over_simulators_do_what_the_plan_endpoint_said(
        tmp_path: Path, routers: list[Router]) -> None:
    """Four profiles (0.3 of a 16 GiB card each, 2 GiB of weights) where not all fit beside one
    awake as kv-released: the simulators sleep as the plugin does (kv keeps the weights on the
    stand-in card) or as vLLM's level 1 (the router's per-sleep file says `all`). Before every
    request GET /v1/router/plan; after it, each engine's tier as /v1/health shows it."""
    sim = "SIM_SLEEP_MS=5 SIM_WAKE_MS=5 SIM_FIRST_SLEEP_MS=20 SIM_WEIGHTS_MIB=2048"
    profiles = {f"sim-{c}": sim for c in "abcd"}
    root, card = project_with(tmp_path, profiles, VLLM_GPU_MEM_UTIL="0.3", GPU_VENDOR="nvidia", GPU_COUNT="1",
                              ROUTER_SLEEP_FREES="auto", MODEL_WEIGHT_GIB="2")
    router = start(routers, root, profiles)
    tiers = {m: e["sleep_tiers"] for m, e in router.health()["engines"].items()}
    assert tiers == {m: ["kv-released", "asleep"] for m in profiles}, tiers
    watch = CardWatch(card, router)
    seen: set[tuple[str, str]] = set()
    try:
        for model in [*profiles, *random.Random(37).choices(list(profiles), k=30)]:
            said = requests.get(f"{router.url}/v1/router/plan", params={"model": model},
                                timeout=10).json()
            before = {m: e["tier"] for m, e in router.health()["engines"].items()}
            answer = router.chat(model)
            assert answer.status_code == 200, (answer.text, said, before, router.health()["engines"])
            after = {m: e["tier"] for m, e in router.health()["engines"].items()}
            moved = {(m, before[m], after[m]) for m in profiles if m != model
                     and before[m] != after[m]}
            assert moved == {(m["member"], m["from"], m["to"]) for m in said["moves"]}, (
                model, said, before, after)
            assert said["tier"] == before[model] and after[model] == "awake"
            seen |= {(frm, to) for _, frm, to in moved} | {(before[model], "awake")}
    finally:
        watch.stop()
    assert {("awake", "kv-released"), ("kv-released", "asleep"), ("kv-released", "awake"),
            ("asleep", "awake"), ("stopped", "awake")} <= seen, seen
    assert max(watch.used) <= CARD
    frees = {f for m in profiles for f in sim_counts(engine_url(router, m))["frees"]
             if engine_url(router, m) != "None"}
    assert frees == {"kv", "all"}
