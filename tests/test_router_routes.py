"""Which engine paths the router forwards, by model, and how (issue 35, rows 23-24): every
OpenAI path vLLM or llama.cpp serves (the Responses API, tokenize, audio uploads with `model` in
a form field), none of the dev endpoints, and a stream to an HTTP/1.0 client. The router's real
aiohttp front in front of a stand-in engine (tests/router_harness.py), over raw sockets."""

from __future__ import annotations

import json

import pytest
from router_harness import STREAM, exchange, get, post, running_router, status

from vllmstack.config.engines.llamacpp import ROUTES as LLAMACPP_PATHS
from vllmstack.config.engines.vllm import ROUTES as VLLM_PATHS
from vllmstack.router.limits import Limits

LIMITS = Limits(max_connections=64, keepalive_timeout=10.0)
BOUNDARY = "----vllmstack-form-7d3f"


def form(model: str, audio: bytes = b"RIFF\x00\x01fake-wave model=x\r\n") -> bytes:
    """An OpenAI SDK style audio upload: the file part first, then the text fields."""
    return (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n").encode() + audio + (
        f"\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{model}"
        f"\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"language\"\r\n\r\nen"
        f"\r\n--{BOUNDARY}--\r\n").encode()


FORM_TYPE = f"content-type: multipart/form-data; boundary={BOUNDARY}\r\n".encode()


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/completions", "/v1/chat/completions",
                                  "/v1/embeddings", "/tokenize", "/detokenize", "/v1/messages",
                                  "/pooling", "/v1/rerank", "/v2/rerank", "/score"])
def test_every_openai_path_of_the_engine_is_routed_by_model(path: str) -> None:
    body = json.dumps({"model": "p", "input": "hi"}).encode()  # named by its profile
    with running_router(LIMITS) as router:
        data = exchange(router.port, post(path, body))
        assert status(data) == 200, data[:300]
        method, seen_path, _, sent = router.engine.seen[-1]
        assert (method, seen_path) == ("POST", path)
        assert json.loads(sent) == {"model": "m", "input": "hi"}  # the engine's served name


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/v1/audio/translations"])
def test_an_audio_upload_is_routed_by_its_form_field(path: str) -> None:
    with running_router(LIMITS) as router:
        data = exchange(router.port, post(path, form("p"), FORM_TYPE))
        assert status(data) == 200, data[:300]
        _, seen_path, headers, sent = router.engine.seen[-1]
        assert seen_path == path and headers["content-type"].endswith(BOUNDARY)
        assert sent == form("m")  # the model field renamed, the file part untouched
        unknown = exchange(router.port, post(path, form("nope"), FORM_TYPE))
        assert status(unknown) == 404 and b"nope" in unknown
        missing = form("p").replace(b'name="model"', b'name="modl"')
        assert status(exchange(router.port, post(path, missing, FORM_TYPE))) == 400
        assert len(router.engine.seen) == 1


def test_a_llamacpp_model_gets_only_what_llama_server_serves() -> None:
    assert "/v1/audio/translations" not in LLAMACPP_PATHS and "/pooling" not in LLAMACPP_PATHS
    with running_router(LIMITS, engine_kind="llamacpp") as router:
        for path in ("/v1/audio/translations", "/pooling", "/v2/rerank"):
            body = form("m") if "audio" in path else b'{"model": "m"}'
            data = exchange(router.port, post(path, body, FORM_TYPE if "audio" in path else b""))
            assert status(data) == 404 and b"llamacpp" in data and path.encode() in data, data
        assert status(exchange(router.port, post("/v1/responses", b'{"model": "m"}'))) == 200
        assert router.engine.seen and {p for _, p, _, _ in router.engine.seen} == {"/v1/responses"}


@pytest.mark.parametrize("request_bytes", [
    get("/v1/responses/resp_123"), post("/v1/responses/resp_123/cancel", b'{"model": "m"}'),
    post("/sleep", b'{"model": "m"}'), post("/collective_rpc", b'{"model": "m"}'),
    post("/v1/load_lora_adapter", b'{"model": "m"}'), post("/scale_elastic_ep", b'{"model": "m"}'),
])
def test_dev_paths_and_paths_without_a_model_are_never_forwarded(request_bytes: bytes) -> None:
    assert not {"/sleep", "/wake_up", "/collective_rpc", "/reset_prefix_cache"} & VLLM_PATHS
    with running_router(LIMITS) as router:
        data = exchange(router.port, request_bytes)
        assert status(data) in (404, 405), data[:300]
        assert router.engine.seen == []


def test_a_stream_to_an_http_10_client_ends_at_the_close() -> None:
    # HTTP/1.0 has no chunked encoding: aiohttp raised for it, a 500. The stream is sent as it
    # comes and the body ends where the router closes the connection.
    body = b'{"model": "m", "stream": true, "messages": []}'
    request = (b"POST /v1/chat/completions HTTP/1.0\r\nhost: 127.0.0.1\r\n"
               b"content-length: %d\r\n\r\n" % len(body)) + body
    with running_router(LIMITS) as router:
        data = exchange(router.port, request, wait=10)  # returns once the router closes
        head, _, rest = data.partition(b"\r\n\r\n")
        assert status(data) == 200, data[:300]
        assert b"transfer-encoding" not in head.lower() and b"content-length" not in head.lower()
        assert rest == b"".join(STREAM)
        assert not [line for line in router.said if line.startswith("error:")], router.said
        keep = request.replace(b"\r\n\r\n", b"\r\nconnection: keep-alive\r\n\r\n", 1)
        again = exchange(router.port, keep, wait=10)  # closed even when kept alive was asked
        assert again.partition(b"\r\n\r\n")[2] == b"".join(STREAM)
