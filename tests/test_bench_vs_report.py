"""bench-vs without engines: which pairs are identical weights, the spec-draft column, the table
cells (llama.cpp's own timings in parentheses, a failed start), llama-server's tokenizer and
timings as the stack reads them."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from vllmstack.bench.client.client import RequestResult
from vllmstack.bench.client.stream import StreamState
from vllmstack.bench.fleet.resident import ServerTokenizer, load_kind, server_timings
from vllmstack.bench.fleet.vs import VsError, VsOptions, parse_target
from vllmstack.bench.fleet.vs_report import (
    DIFFERENT,
    IDENTICAL,
    assign_pairs,
    canonical_ids,
    checkpoint_of,
    render,
    spec_draft,
    table_row,
)
from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project
from vllmstack.workload.prompts import PromptBuilder, load_tokenizer


def write_gguf(path: Path, file_type: gguf.LlamaFileType, source: str | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), "qwen3")
    if source:
        writer.add_source_url(source)
    writer.add_file_type(file_type)
    writer.add_tensor("w", np.zeros((4, 4), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama(project: Project, gguf_path: Path, *sets: str) -> Any:
    return resolve(project, platform="cpu", model="tiny",
                   overrides=["ENGINE=llamacpp", f"LLAMACPP_MODEL={gguf_path}", *sets])


def vllm(project: Project, model: str, *sets: str) -> Any:
    return resolve(project, platform="cpu", model="tiny", overrides=[f"VLLM_MODEL={model}", *sets])


def rows(*checkpoints: Any) -> list[dict[str, Any]]:
    out = [{"checkpoint": cp.as_record()} for cp in checkpoints]
    assign_pairs(out)
    return out


def test_an_f16_gguf_converted_from_the_vllm_checkpoint_is_identical_weights(
        project: Project, tmp_path: Path) -> None:
    source = tmp_path / "tiny-qwen3"
    source.mkdir()
    f16 = write_gguf(tmp_path / "tiny-f16.gguf", gguf.LlamaFileType.MOSTLY_F16, str(source))
    q8 = write_gguf(tmp_path / "tiny-q8.gguf", gguf.LlamaFileType.MOSTLY_Q8_0, str(source))
    ours = checkpoint_of(vllm(project, str(source)), {})
    same = checkpoint_of(llama(project, f16), {})
    assert same.label == "tiny-f16.gguf (F16)"
    assert [r["pair_kind"] for r in rows(ours, same)] == [IDENTICAL, IDENTICAL]
    # The same source quantized to q8_0 is not the same weights.
    assert [r["pair_kind"] for r in rows(ours, checkpoint_of(llama(project, q8), {}))] == [
        DIFFERENT, DIFFERENT]
    # Nor is a vLLM profile that quantizes the checkpoint itself.
    quantized = checkpoint_of(vllm(project, str(source), "MODEL_QUANT=fp8"), {})
    assert [r["pair_kind"] for r in rows(quantized, same)] == [DIFFERENT, DIFFERENT]
    # One row alone is no pair.
    assert rows(ours)[0]["pair_kind"] == "-"


def test_hub_ids_urls_and_cache_snapshots_name_the_same_checkpoint(
        project: Project, tmp_path: Path) -> None:
    snapshot = "/cache/hub/models--Qwen--Qwen3-0.6B/snapshots/abc123"
    assert canonical_ids("Qwen/Qwen3-0.6B") == {"qwen/qwen3-0.6b"}
    assert "qwen/qwen3-0.6b" in canonical_ids(snapshot)
    assert canonical_ids("https://huggingface.co/Qwen/Qwen3-0.6B") == {"qwen/qwen3-0.6b"}
    # A sidecar written beside the GGUF names a snapshot of the id the vLLM profile serves.
    plain = write_gguf(tmp_path / "q.gguf", gguf.LlamaFileType.MOSTLY_BF16)
    (tmp_path / "q.gguf.json").write_text(json.dumps({"source": snapshot}))
    pair = rows(checkpoint_of(vllm(project, "Qwen/Qwen3-0.6B"), {}),
                checkpoint_of(llama(project, plain), {}))
    assert [r["pair_kind"] for r in pair] == [IDENTICAL, IDENTICAL]
    # Without any source record, nothing says the weights are the same.
    bare = write_gguf(tmp_path / "bare.gguf", gguf.LlamaFileType.MOSTLY_F16)
    pair = rows(checkpoint_of(vllm(project, "Qwen/Qwen3-0.6B"), {}),
                checkpoint_of(llama(project, bare), {}))
    assert [r["pair_kind"] for r in pair] == [DIFFERENT, DIFFERENT]


def test_a_missing_gguf_is_named_in_the_checkpoint(project: Project, tmp_path: Path) -> None:
    missing = checkpoint_of(llama(project, tmp_path / "gone.gguf"), {})
    assert missing.label == "gone.gguf" and not missing.lossless
    assert missing.notes == [f"{tmp_path / 'gone.gguf'} not found"]


def test_spec_draft_column(project: Project, tmp_path: Path) -> None:
    assert spec_draft(vllm(project, "x/y")) == "-"
    mtp = vllm(project, "x/y", 'VLLM_SPEC_DECODE={"method":"mtp","num_speculative_tokens":2}')
    assert spec_draft(mtp) == "mtp ×2"
    path = tmp_path / "m.gguf"
    assert spec_draft(llama(project, path)) == "-"
    assert spec_draft(llama(project, path, "LLAMACPP_DRAFT_MODEL=/m/draft-0.6b.gguf",
                            "LLAMACPP_DRAFT_MAX=4")) == "draft-0.6b.gguf ×4"
    assert spec_draft(llama(project, path, "LLAMACPP_SPEC_TYPE=draft-mtp")) == "draft-mtp ×3"


def measured_row(**extra: Any) -> dict[str, Any]:
    stat = {"mean": 50.0, "std": 1.0}
    return {"engine": "llamacpp", "checkpoint": {"label": "m.gguf (F16)"}, "spec_draft": "-",
            "status": "ok", "single": {"tg_tps": stat, "ttft_ms": {"mean": 12.3},
                                       "pp_note": "below resolution"},
            "ctx": {"tg_tps": {"mean": 40.0}, "pp_tps": {"mean": 25000.0, "std": 1500.0}},
            "ctx_tokens": 7808, "conc": {"total_tg_tps": 150.0},
            "timings": {"single": {"predicted_per_second": 51.5},
                        "ctx": {"prompt_per_second": 24000.0, "predicted_per_second": 41.0}},
            "vram": {"available": True, "engine_bytes": 3 << 30, "peak_bytes": 5 << 30},
            "load_s": 2.5, "load_kind": "warm", "pair_kind": IDENTICAL, **extra}


def test_table_cells_show_llamacpps_own_timings_in_parentheses() -> None:
    assert table_row(measured_row()) == [
        "llama.cpp · m.gguf (F16)", "-", "50.0 (51.5)", "25.0k ± 1.5k (24000.0)", "12.3",
        "40.0 (41.0) @7808", "150.0", "3.0 GiB", "2.5 s (warm)", IDENTICAL]
    vllm_row = measured_row(engine="vllm", timings={"single": None, "ctx": None},
                            vram={"available": False})
    cells = table_row(vllm_row)
    assert cells[2] == "50.0" and cells[5] == "40.0 @7808" and cells[7] == "n/a (no GPU)"


def test_a_failed_target_row_says_why_in_one_cell() -> None:
    row = {"engine": "vllm", "checkpoint": {"label": "Qwen/Qwen3-0.6B"}, "spec_draft": "-",
           "status": "failed", "diagnosis": "the engine exited | with code 1\nout of memory",
           "load_s": None, "pair_kind": DIFFERENT}
    cells = table_row(row)
    assert cells[2] == "FAILED: the engine exited \\| with code 1 out of memory"
    assert cells[3:7] == ["-"] * 4 and cells[8] == "-"
    skipped = table_row({**row, "status": "skipped", "diagnosis": "the previous did not stop"})
    assert skipped[2] == "not run: the previous did not stop"


def test_a_row_with_some_failed_requests_keeps_its_numbers_and_says_so() -> None:
    # On the H200, 1 of ~100 requests to a random-weight model tripped llama-server's chat-output
    # parser; the row must still show what the other requests measured.
    stat = {"mean": 655.6, "std": 20.0, "n": 3}
    row = {"engine": "llamacpp", "checkpoint": {"label": "x.gguf (BF16)"}, "spec_draft": "-",
           "status": "partial", "diagnosis": "1 request(s) failed: peg-native format",
           "single": {"tg_tps": stat, "ttft_ms": {"mean": 77.9}}, "ctx": {}, "conc": {},
           "load_s": 1.0, "load_kind": "warm", "pair_kind": "identical weights", "target": "l:x"}
    cells = table_row(row)
    assert cells[2] == "655.6" and not cells[2].startswith("FAILED")
    text = render({"rows": [row], "options": {}})
    assert "numbers from the requests that answered; 1 request(s) failed: peg-native" in text


def test_targets_and_options_are_checked() -> None:
    assert parse_target("llamacpp:tiny-gguf") == ("llamacpp", "tiny-gguf")
    for bad in ("tiny", ":tiny", "vllm:", "tgi:tiny"):
        with pytest.raises(VsError):
            parse_target(bad)
    with pytest.raises(VsError, match="--concurrency must be at least 1"):
        VsOptions(concurrency=0).check()
    with pytest.raises(VsError, match="--duration"):
        VsOptions(duration_s=float("nan")).check()


def test_cold_means_empty_caches_or_new_compile_files() -> None:
    assert load_kind(0, 0) == "cold"  # nothing cached: a first start
    assert load_kind(10, 14) == "cold"  # it compiled what was not cached
    assert load_kind(10, 10) == "warm"


# --- llama-server's tokenizer and timings ---------------------------------------------------------


@pytest.fixture
def fake_llama_server(tokenizer_file: Path) -> Iterator[str]:
    """/tokenize and /detokenize as llama-server answers them (tools/server, b9993)."""
    tok = load_tokenizer(tokenizer_file)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            if self.path == "/tokenize":
                answer: dict[str, Any] = {
                    "tokens": tok.encode(body["content"], add_special_tokens=False).ids}
            else:
                answer = {"content": tok.decode(body["tokens"])}
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_prompts_are_cut_to_length_with_the_servers_tokenizer(
        fake_llama_server: str, tokenizer_file: Path) -> None:
    remote = PromptBuilder(ServerTokenizer(fake_llama_server), seed=3)
    local = PromptBuilder(load_tokenizer(tokenizer_file), seed=3)
    for size in (16, 300, 1000):
        prompt = remote.build(size, marker="[m]")
        assert prompt.tokens == size
        # The same corpus position on both: the same text where the vocabularies agree.
        assert prompt.text == local.build(size, marker="[m]").text


def test_a_dead_server_tokenizer_is_a_clear_error() -> None:
    from vllmstack.workload.prompts import TokenizerError

    with pytest.raises(TokenizerError, match="/tokenize"):
        ServerTokenizer("http://127.0.0.1:9", timeout_s=1).encode("hi")


# The shape of tools/server/server-task.cpp's chat stream (b9993) with include_usage.
LLAMA_STREAM: list[dict[str, Any]] = [
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant",
                                                                "content": None}}]},
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"reasoning_content": "Hm"}}]},
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": " yes"}}]},
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": " indeed"}}]},
    {"choices": [{"finish_reason": "length", "index": 0, "delta": {}}]},
    {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 20, "total_tokens": 23},
     "timings": {"cache_n": 0, "prompt_n": 20, "prompt_ms": 4.0, "prompt_per_second": 5000.0,
                 "predicted_n": 3, "predicted_ms": 30.0, "predicted_per_second": 100.0}},
]


def feed(events: list[dict[str, Any]]) -> RequestResult:
    result = RequestResult()
    state = StreamState(result)
    for n, event in enumerate(events):
        state.feed(b"data: " + json.dumps(event).encode() + b"\n\n", float(n))
    state.feed(b"data: [DONE]\n\n", 99.0)
    state.close()
    return result


def test_llamacpps_timings_are_kept_and_a_reasoning_delta_is_the_first_token() -> None:
    result = feed(LLAMA_STREAM)
    assert result.server_timings is not None
    assert result.server_timings["predicted_per_second"] == 100.0
    assert result.t_first_token == 1.0  # the reasoning delta, not the role chunk at 0.0
    assert result.tokens == 3 and result.token_source == "usage-final"
    assert server_timings([result, result]) == {"prompt_per_second": 5000.0,
                                                "predicted_per_second": 100.0}
    # Without include_usage the timings ride on the finish chunk.
    bare = feed([*LLAMA_STREAM[:4], {**LLAMA_STREAM[4], "timings": LLAMA_STREAM[5]["timings"]}])
    assert bare.server_timings == LLAMA_STREAM[5]["timings"]
    assert server_timings([feed(LLAMA_STREAM[:5])]) is None  # vLLM sends none
    broken = feed([*LLAMA_STREAM[:5], {**LLAMA_STREAM[5], "timings": [1]}])
    assert broken.error and "timings is a list" in broken.error


def test_without_keep_alive_every_request_gets_its_own_connection() -> None:
    """llama-server closes the connection after each stream without saying so; a client that
    reuses it loses the next request now and then. keep_alive=False: a new connection each time."""
    import asyncio

    from vllmstack.bench.client.client import ChatClient, chat_body

    chunks = [*LLAMA_STREAM[1:4], LLAMA_STREAM[5]]
    body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nKeep-Alive: "
                     b"timeout=5, max=100\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
        await writer.drain()
        # What llama-server does after every streamed response; a little later, so that a client
        # reusing the connection has sent its next request by then (and would lose it).
        await asyncio.sleep(0.05)
        writer.close()

    async def main() -> list[RequestResult]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, ChatClient(f"http://127.0.0.1:{port}", keep_alive=False) as client:
            return [await client.stream_chat(chat_body("m", [{"role": "user", "content": "x"}], 3))
                    for _ in range(20)]

    results = asyncio.run(main())
    assert [r.error for r in results] == [None] * 20 and connections == 20
    assert all(r.tokens == 3 and r.server_timings for r in results)
