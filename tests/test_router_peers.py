"""Peers under one URL (issue 40, item 1): router A offers the models of router B
(ROUTER_PEERS), forwards their requests with B's token, streams them through, marks B down
within 5 s when it stops answering and back up when it answers again, and never lets a
client reach B's dev endpoints. Two real routers (RouterApp + Front) in the test process, each
in front of its own stand-in engine (tests/router_harness.py)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers import free_port
from router_harness import STREAM, Running, running_router

from vllmstack.config.profiles import Resolved, Setting
from vllmstack.router.limits import Limits
from vllmstack.router.link import HOP_HEADER, PeerLink, PeerState, own_models
from vllmstack.router.options import RouterError
from vllmstack.router.peers import Peer, parse_peers, plain_loopback, start_peers, token_folder
from vllmstack.router.upstream import Upstream

LIMITS = Limits(max_connections=64, keepalive_timeout=10.0)
TOKEN_A = "router-a-token-0123456789abcdefghijklmnop"
TOKEN_B = "router-b-token-0123456789abcdefghijklmnop"
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def token_dir(tmp_path: Path, token: str, name: str = "b") -> Path:
    folder = tmp_path / "peer-tokens"
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return folder


def peer_b(tmp_path: Path, url: str, token: str = TOKEN_B) -> Peer:
    return parse_peers(f"b={url}", where=".env:7", token_dir=token_dir(tmp_path, token))[0]


def get(router: Running, path: str, token: str = TOKEN_A) -> requests.Response:
    return requests.get(router.url + path, headers={"Authorization": f"Bearer {token}"},
                        timeout=10)


def post(router: Running, path: str, body: dict[str, Any], token: str = TOKEN_A,
         **extra: Any) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}", **extra.pop("headers", {})}
    return requests.post(router.url + path, json=body, headers=headers, timeout=10, **extra)


def models(router: Running) -> dict[str, dict[str, Any]]:
    answer = get(router, "/v1/models")
    assert answer.status_code == 200, answer.text
    return {m["id"]: m for m in answer.json()["data"]}


def within(seconds: float, ready: Callable[[], bool]) -> float:
    """How long `ready` took to hold (it must within `seconds`)."""
    began = time.monotonic()
    while not ready():
        assert time.monotonic() - began < seconds, f"not within {seconds} s"
        time.sleep(0.05)
    return time.monotonic() - began


def test_a_request_through_a_for_bs_model_answers_and_streams_with_bs_token(
        tmp_path: Path) -> None:
    with running_router(LIMITS, token=TOKEN_B, model="mb") as b, \
            running_router(LIMITS, token=TOKEN_A, model="ma", peers=[peer_b(tmp_path, b.url)]) as a:
        listed = models(a)
        assert list(listed) == ["ma", "mb"]
        assert "peer" not in listed["ma"]
        assert listed["mb"]["object"] == "model" and listed["mb"]["owned_by"] == "vllm"
        assert (listed["mb"]["peer"], listed["mb"]["peer_up"], listed["mb"]["peers"]) == \
            ("b", True, ["b"])
        answer = post(a, "/v1/chat/completions", {"model": "mb", **CHAT})
        assert answer.status_code == 200 and answer.json() == {"object": "answer"}, answer.text
        method, path, headers, body = b.engine.seen[-1]
        assert (method, path) == ("POST", "/v1/chat/completions") and b'"mb"' in body
        # B took the request, so A sent B's token; neither router's token reaches B's engine.
        assert "authorization" not in headers and TOKEN_A not in str(headers)
        # A stream passes through chunk for chunk, as B's engine wrote it.
        with post(a, "/v1/chat/completions", {"model": "mb", "stream": True, **CHAT},
                  stream=True) as streamed:
            assert streamed.status_code == 200
            assert streamed.headers["content-type"] == "text/event-stream"
            chunks = list(streamed.raw.read_chunked(decode_content=False))
        assert chunks == STREAM
        # A's own model stays A's: B's engine saw nothing more.
        seen = len(b.engine.seen)
        assert post(a, "/v1/chat/completions", {"model": "ma", **CHAT}).status_code == 200
        assert len(b.engine.seen) == seen and len(a.engine.seen) == 1
        health = get(a, "/v1/health").json()["peers"]["b"]
        assert health["up"] is True and health["models"] == ["mb"] and health["url"] == b.url


def test_a_stopped_peer_is_down_within_5_s_with_a_named_503_and_comes_back(
        tmp_path: Path) -> None:
    port = free_port()
    with contextlib.ExitStack() as stack:
        b_running = running_router(LIMITS, token=TOKEN_B, model="mb", port=port)
        b = b_running.__enter__()
        a = stack.enter_context(running_router(LIMITS, token=TOKEN_A, model="ma",
                                               peers=[peer_b(tmp_path, b.url)]))
        assert post(a, "/v1/chat/completions", {"model": "mb", **CHAT}).status_code == 200
        b_running.__exit__(None, None, None)  # B's router is gone
        took = within(5, lambda: models(a)["mb"]["peer_up"] is False)
        assert took < 5
        assert models(a)["mb"]["state"] == "unreachable"
        refused = post(a, "/v1/chat/completions", {"model": "mb", **CHAT})
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["peer"] == ["b"] and error["type"] == "ServiceUnavailableError"
        assert "mb lives on b" in error["message"] and b.url in error["message"]
        assert refused.headers["Retry-After"] == "1"
        # A's own model is unaffected.
        assert post(a, "/v1/chat/completions", {"model": "ma", **CHAT}).status_code == 200
        # B restarts on its port: A takes it back without a restart of its own.
        b_again = stack.enter_context(running_router(LIMITS, token=TOKEN_B, model="mb",
                                                     port=port))
        within(5, lambda: models(a)["mb"]["peer_up"] is True)
        answer = post(a, "/v1/chat/completions", {"model": "mb", **CHAT})
        assert answer.status_code == 200 and b_again.engine.seen, answer.text
        said = "\n".join(a.said)
        assert "peer b (" in said and "is down: " in said and "is up: mb" in said


def test_wrong_or_missing_peer_tokens_are_refused(tmp_path: Path) -> None:
    with running_router(LIMITS, token=TOKEN_B, model="mb") as b:
        # Without B's token, B refuses (its own token rule), reads included.
        assert requests.get(b.url + "/v1/models", timeout=5).status_code == 401
        assert requests.post(b.url + "/v1/chat/completions", json={"model": "mb", **CHAT},
                             timeout=5).status_code == 401
        # A router holding a wrong token for B: B refuses its poll, A says why.
        wrong = peer_b(tmp_path, b.url, token="not-bs-token-0123456789abcdefghijklmno")
        with running_router(LIMITS, token=TOKEN_A, model="ma", peers=[wrong]) as a:
            peer = get(a, "/v1/health").json()["peers"]["b"]
            assert peer["up"] is False and "refused this router's token" in peer["reason"]
            assert str(wrong.token_file) in peer["reason"]
            assert "mb" not in models(a)
            assert post(a, "/v1/chat/completions", {"model": "mb", **CHAT}).status_code == 404
        assert b.engine.seen == []
    # A token file missing for a named peer stops the start, naming key, place, file and fix.
    with pytest.raises(RouterError) as missing:
        parse_peers("c=http://127.0.0.1:9", where=".env:4", token_dir=tmp_path / "none")
    assert "peer 'c'" in missing.value.cause and "c.token" in missing.value.cause
    assert "ROUTER_PEER_TOKEN_DIR" in (missing.value.fix or "")


def test_a_peer_token_changed_under_a_running_link_refuses_its_requests_by_name(
        tmp_path: Path) -> None:
    port = free_port()
    with contextlib.ExitStack() as stack:
        b_running = running_router(LIMITS, token=TOKEN_B, model="mb", port=port)
        b = b_running.__enter__()
        a = stack.enter_context(running_router(LIMITS, token=TOKEN_A, model="ma",
                                               peers=[peer_b(tmp_path, b.url)]))
        b_running.__exit__(None, None, None)
        new_token = "router-b-new-token-0123456789abcdefghijk"
        stack.enter_context(running_router(LIMITS, token=new_token, model="mb", port=port))
        within(5, lambda: "token" in (get(a, "/v1/health").json()["peers"]["b"]["reason"] or ""))
        refused = post(a, "/v1/chat/completions", {"model": "mb", **CHAT})
        assert refused.status_code == 503
        assert "refused this router's token" in refused.json()["error"]["message"]


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/sleep"), ("POST", "/wake_up"), ("POST", "/collective_rpc"),
    ("POST", "/reset_prefix_cache"), ("GET", "/v1/router/plan?model=mb"),
    ("POST", "/v1/router/plan"), ("POST", "/v1/models"), ("GET", "/metrics")])
def test_a_peers_dev_endpoints_are_never_reached_through_the_link(
        tmp_path: Path, method: str, path: str) -> None:
    with running_router(LIMITS, token=TOKEN_B, model="mb") as b, \
            running_router(LIMITS, token=TOKEN_A, model="ma", peers=[peer_b(tmp_path, b.url)]) as a:
        answer = requests.request(method, a.url + path, json={"model": "mb"}, timeout=5,
                                  headers={"Authorization": f"Bearer {TOKEN_A}"})
        assert answer.status_code in (404, 405), answer.text
        assert b.engine.seen == []


def test_load_goes_through_the_peers_api_and_a_relayed_request_is_not_sent_on(
        tmp_path: Path) -> None:
    with running_router(LIMITS, token=TOKEN_B, model="mb") as b, \
            running_router(LIMITS, token=TOKEN_A, model="ma", peers=[peer_b(tmp_path, b.url)]) as a:
        loaded = post(a, "/v1/load", {"model": "mb"})
        assert loaded.status_code == 200 and loaded.json()["model"] == "mb", loaded.text
        within(3, lambda: models(a)["mb"]["state"] == "ready")  # A's next poll of B says so
        # A request that already crossed a link is answered where it arrives.
        hop = post(a, "/v1/chat/completions", {"model": "mb", **CHAT}, headers={HOP_HEADER: "1"})
        assert hop.status_code == 404 and b.engine.seen == []


def test_a_peers_listing_keeps_only_its_own_models() -> None:
    body = (b'{"object": "list", "data": [{"id": "x", "state": "ready"}, '
            b'{"id": "y", "peer": "c"}, {"id": 3}, "junk"]}')
    assert own_models(body) == {"x": {"id": "x", "state": "ready"}}
    assert own_models(b"<html>") is None and own_models(b'{"data": 1}') is None


@pytest.mark.parametrize(("text", "cause"), [
    ("box2", "is not name=URL"),
    ("Box2=http://h:1", "is not name=URL"),
    ("b=ftp://h:1", "is not an http:// or https:// address"),
    ("b=http://h:99999", "has a bad port"),
    ("b=http://user:pw@h:1", "holds a user or password"),
    ("b=http://h:1/v1", "has a path, query or fragment"),
    ("b=http://h:1,b=http://h:2", "names the peer 'b' twice"),
])
def test_bad_peer_entries_name_the_key_the_place_and_the_fix(
        tmp_path: Path, text: str, cause: str) -> None:
    folder = token_dir(tmp_path, TOKEN_B)
    with pytest.raises(RouterError) as bad:
        parse_peers(text, where="env/hosts/lan.env:3", token_dir=folder)
    assert bad.value.cause.startswith("ROUTER_PEERS (set at env/hosts/lan.env:3)")
    assert cause in bad.value.cause and bad.value.fix


def test_peer_token_files_must_hold_a_long_token_only_their_owner_reads(tmp_path: Path) -> None:
    folder = token_dir(tmp_path, TOKEN_B)
    (folder / "b.token").chmod(0o644)
    with pytest.raises(RouterError) as readable:
        parse_peers("b=http://h:1", where=".env:1", token_dir=folder)
    assert "may be read by others" in readable.value.cause
    assert readable.value.fix == f"chmod 600 {folder / 'b.token'}"
    token_dir(tmp_path, "short")
    with pytest.raises(RouterError) as short:
        parse_peers("b=http://h:1", where=".env:1", token_dir=folder)
    assert "can be guessed" in short.value.cause and "b.token" in short.value.cause
    token_dir(tmp_path, TOKEN_B)
    assert parse_peers(" b=http://h:1/ ,", where=".env:1", token_dir=folder) == [
        Peer("b", "http://h:1", TOKEN_B, folder / "b.token")]


def test_peers_come_from_the_option_then_the_environment_then_dotenv(tmp_path: Path) -> None:
    folder = token_dir(tmp_path, TOKEN_B)
    resolved = Resolved("cpu", "p", {
        "ROUTER_PEERS": Setting("ROUTER_PEERS", "b=http://dotenv:1", ".env:9"),
        "ROUTER_PEER_TOKEN_DIR": Setting("ROUTER_PEER_TOKEN_DIR", str(folder), ".env:10")}, [])
    assert start_peers(resolved, {}, root=tmp_path)[0].url == "http://dotenv:1"
    environ = {"ROUTER_PEERS": "b=http://environ:1"}
    assert start_peers(resolved, environ, root=tmp_path)[0].url == "http://environ:1"
    assert start_peers(resolved, environ, root=tmp_path,
                       peers="b=http://option:1")[0].url == "http://option:1"
    with pytest.raises(RouterError) as bad:
        start_peers(Resolved("cpu", "p", {"ROUTER_PEERS": Setting(
            "ROUTER_PEERS", "b", ".env:9")}, []), {}, root=tmp_path)
    assert "(set at .env:9)" in bad.value.cause
    assert start_peers(Resolved("cpu", "p", {}, []), {}, root=tmp_path) == []
    assert token_folder("", root=tmp_path, environ={"HOME": "/home/u"}) == \
        Path("/home/u/.config/vllmstack/peer-tokens")
    assert token_folder("keys", root=tmp_path, environ={}) == tmp_path / "keys"


def test_a_down_peers_models_go_to_another_peer_that_has_them(tmp_path: Path) -> None:
    folder = token_dir(tmp_path, TOKEN_B)
    token_dir(tmp_path, TOKEN_B, name="c")
    with contextlib.ExitStack() as stack:
        b_running = running_router(LIMITS, token=TOKEN_B, model="mb")
        b = b_running.__enter__()
        c = stack.enter_context(running_router(LIMITS, token=TOKEN_B, model="mb"))
        peers = parse_peers(f"b={b.url},c={c.url}", where=".env:2", token_dir=folder)
        a = stack.enter_context(running_router(LIMITS, token=TOKEN_A, model="ma", peers=peers))
        assert models(a)["mb"]["peers"] == ["b", "c"]
        assert post(a, "/v1/chat/completions", {"model": "mb", **CHAT}).status_code == 200
        assert len(b.engine.seen) == 1 and c.engine.seen == []  # the first that has it
        b_running.__exit__(None, None, None)
        within(5, lambda: models(a)["mb"]["peer"] == "c")
        assert post(a, "/v1/chat/completions", {"model": "mb", **CHAT}).status_code == 200
        assert len(c.engine.seen) == 1
        # A model no one lists is a 404 that names the peer that is down, and why.
        unknown = post(a, "/v1/chat/completions", {"model": "nowhere", **CHAT})
        assert unknown.status_code == 404
        assert f"not known from peer b ({b.url}), down: " in unknown.json()["error"]["message"]


def test_a_refused_token_is_asked_again_less_often_and_stays_the_reason(tmp_path: Path) -> None:
    async def run(peer: Peer, silent: Peer) -> tuple[PeerState, float, PeerState]:
        upstream = Upstream(LIMITS)
        link = PeerLink([peer, silent], upstream)
        try:
            state, quiet = link.states["b"], link.states["q"]
            await link.poll(state)
            first = state.polled
            await link.poll(state)  # within PEER_REFUSED_POLL_S: not asked again
            # A peer whose back-off now holds its 401 past the poll's timeout keeps its reason.
            link.mark(quiet, False, "it refused this router's token for it (401)", refused=True)
            quiet.polled = -math.inf
            await link.poll(quiet)
            return state, first, quiet
        finally:
            await upstream.close()

    with running_router(LIMITS, token=TOKEN_B, model="mb") as b, \
            socket.create_server(("127.0.0.1", 0)) as listener:  # accepts, never answers
        wrong = peer_b(tmp_path, b.url, token="not-bs-token-0123456789abcdefghijklmno")
        silent = Peer("q", f"http://127.0.0.1:{listener.getsockname()[1]}", TOKEN_B,
                      wrong.token_file)
        state, first, quiet = asyncio.run(run(wrong, silent))
    assert state.refused and state.polled == first and "refused" in state.reason
    assert quiet.reason == "it refused this router's token for it (401)" and quiet.up is False


def test_a_plain_http_peer_beyond_loopback_is_said_to_be_unencrypted() -> None:
    assert plain_loopback("http://127.0.0.1:8080") and plain_loopback("http://[::1]:1")
    assert plain_loopback("https://192.168.1.20:8443")
    assert not plain_loopback("http://192.168.1.20:8080")
