"""Checks of ENGINE=llamacpp profiles: the GGUF file and header, the architecture, the context
against the trained one, and the memory projection, each finding with its key and file:line.

GGUF files are written with the `gguf` package. `geometry_gguf` writes a file whose header has a
real model's geometry and tensor sizes while its data is a hole (a sparse file): a 28 GB
Qwen3.6-27B Q8_0 costs no disk, and the projection sees the true byte counts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

from vllmstack.checks.context import CheckContext
from vllmstack.checks.gguf import ARCHS_REF, GgufError, known_archs, read_gguf
from vllmstack.checks.registry import RULE_ENGINES, RULES, check_profile, render_report, run_checks
from vllmstack.config.modelinfo import GIB
from vllmstack.config.profiles import list_profiles, resolve
from vllmstack.config.schema import load_schema
from vllmstack.core.findings import Finding
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner

ROOT = Path(__file__).resolve().parents[1]
Q8_BLOCK = 34  # bytes of one Q8_0 block (32 weights)


def geometry_gguf(path: Path, arch: str, *, layers: int, ctx: int, embd: int, heads: int,
                  kv_heads: int | list[int], head_dim: int, layer_bytes: int, embd_bytes: int,
                  tied: bool = True, file_type: LlamaFileType = LlamaFileType.MOSTLY_Q8_0,
                  extra: dict[str, Any] | None = None, expert_bytes: int = 0) -> Path:
    """A GGUF header with these facts; each layer one tensor of `layer_bytes` (plus an expert
    tensor of `expert_bytes`); tensor data left as a hole."""
    writer = GGUFWriter(str(path), arch)
    writer.add_name(path.stem)
    writer.add_block_count(layers)
    writer.add_context_length(ctx)
    writer.add_embedding_length(embd)
    writer.add_head_count(heads)
    if isinstance(kv_heads, list):
        writer.add_array(f"{arch}.attention.head_count_kv", kv_heads)
    else:
        writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_file_type(file_type)
    for key, value in (extra or {}).items():
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    sizes = {"token_embd.weight": embd_bytes, "output_norm.weight": Q8_BLOCK * 4}
    for il in range(layers):
        sizes[f"blk.{il}.ffn_up.weight"] = layer_bytes
        if expert_bytes:
            sizes[f"blk.{il}.ffn_up_exps.weight"] = expert_bytes
    if not tied:
        sizes["output.weight"] = embd_bytes
    total = 0
    for name, size in sizes.items():
        size = size // Q8_BLOCK * Q8_BLOCK
        writer.add_tensor_info(name, (size,), np.dtype(np.uint8), size, raw_dtype=GGMLQuantizationType.Q8_0)
        total += GGUFWriter.ggml_pad(size, writer.data_alignment)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None
    start = GGUFWriter.ggml_pad(writer.fout[0].tell(), writer.data_alignment)
    writer.close()
    os.truncate(path, start + total)
    return path


def small_gguf(path: Path, arch: str = "qwen3", **over: Any) -> Path:
    """2 layers of 1 MiB, 2 KV heads × 64: 1 KiB of f16 KV per token per layer."""
    facts: dict[str, Any] = dict(layers=2, ctx=8192, embd=256, heads=4, kv_heads=2, head_dim=64,
                                 layer_bytes=2**20, embd_bytes=2**16)
    return geometry_gguf(path, arch, **{**facts, **over})


# Geometry of the shipped profiles' files (sizes as published for those quants, rounded).
SHIPPED_FILES: dict[str, dict[str, Any]] = {
    "Qwen3-0.6B-Q8_0.gguf": dict(arch="qwen3", layers=28, ctx=40960, embd=1024, heads=16,
                                 kv_heads=8, head_dim=128, layer_bytes=16_000_000,
                                 embd_bytes=165_000_000),
    "Qwen3.5-9B-UD-Q6_K_XL.gguf": dict(
        arch="qwen35", layers=32, ctx=262144, embd=4096, heads=16, kv_heads=4, head_dim=256,
        layer_bytes=235_000_000, embd_bytes=830_000_000, tied=False,
        file_type=LlamaFileType.MOSTLY_Q6_K,
        extra={"qwen35.ssm.conv_kernel": 4, "qwen35.ssm.inner_size": 4096, "qwen35.ssm.state_size": 128,
               "qwen35.ssm.group_count": 16, "qwen35.full_attention_interval": 4}),
    "Qwen3.6-27B-Q8_0.gguf": dict(
        arch="qwen35", layers=64, ctx=262144, embd=5120, heads=24, kv_heads=4, head_dim=256,
        layer_bytes=405_000_000, embd_bytes=1_350_000_000, tied=False,
        extra={"qwen35.ssm.conv_kernel": 4, "qwen35.ssm.inner_size": 6144, "qwen35.ssm.state_size": 128,
               "qwen35.ssm.group_count": 16, "qwen35.full_attention_interval": 4}),
    "tiny-qwen3-f16.gguf": dict(arch="qwen3", layers=2, ctx=8192, embd=256, heads=4, kv_heads=2,
                                head_dim=64, layer_bytes=2**20, embd_bytes=2**20,
                                file_type=LlamaFileType.MOSTLY_F16),
}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("models")
    for name, facts in SHIPPED_FILES.items():
        facts = dict(facts)
        geometry_gguf(folder / name, facts.pop("arch"), **facts)
    return folder


def check(project: Project, *sets: str, model: str = "tiny-gguf", platform: str = "cpu",
          runner: RecordingRunner | None = None) -> tuple[list[Finding], CheckContext]:
    resolved = resolve(project, model=model, platform=platform, overrides=list(sets),
                       environ={"HOME": "/nonexistent"})
    return run_checks(project, resolved, {"HOME": "/nonexistent"}, runner=runner)


def by_code(findings: list[Finding], code: str) -> Finding:
    hits = [f for f in findings if f.code == code]
    assert hits, f"no {code} in {[f.render() for f in findings]}"
    return hits[0]


def codes(findings: list[Finding], severity: str) -> list[str]:
    return [f.code for f in findings if f.severity == severity]


def gguf_profiles() -> list[tuple[str, str]]:
    shipped = Project(ROOT)
    return [(p.name, platform) for p in list_profiles(shipped) if p.kind == "model"
            and resolve(shipped, model=p.name).get_str("ENGINE") == "llamacpp"
            for platform in p.platforms]


# --- the shipped profiles ----------------------------------------------------------------------


def test_the_seed_pairs_and_the_smoke_profiles_are_shipped() -> None:
    assert {m for m, _ in gguf_profiles()} == {"qwen3-0.6b-gguf", "qwen3.5-9b-gguf",
                                               "qwen3.6-27b-gguf", "tiny-gguf"}
    # Each has an id of its own beside its vLLM twin's: the router offers both under one URL.
    shipped = Project(ROOT)
    for gguf_name, twin in (("qwen3-0.6b-gguf", "qwen3-0.6b"), ("qwen3.6-27b-gguf", "qwen3.6-27b"),
                            ("tiny-gguf", "tiny")):
        assert resolve(shipped, model=gguf_name).get("VLLM_SERVED_NAME") == \
            f"{resolve(shipped, model=twin).get('VLLM_SERVED_NAME')}-gguf"


@pytest.mark.parametrize(("model", "platform"), gguf_profiles())
def test_every_shipped_gguf_profile_passes_on_its_platforms(
        shipped: Project, models_dir: Path, model: str, platform: str) -> None:
    findings, ctx = check(shipped, f"MODELS_DIR={models_dir}", model=model, platform=platform)
    assert codes(findings, "error") == [], [f.render() for f in findings if f.severity == "error"]
    assert codes(findings, "warning") == [], [f.render() for f in findings if f.severity == "warning"]
    assert ctx.command is not None and ctx.command.argv[0] == "llama-server"
    assert by_code(findings, "gguf-header").severity == "info"
    if ctx.get("GPU_VRAM_GIB") or platform == "cpu":
        assert by_code(findings, "llamacpp-memory-projection").severity == "info"


def test_the_27b_q8_projection_adds_up_on_two_r9700s(shipped: Project, models_dir: Path) -> None:
    findings, _ = check(shipped, f"MODELS_DIR={models_dir}", model="qwen3.6-27b-gguf",
                        platform="2xr9700")
    info = read_gguf(models_dir / "Qwen3.6-27B-Q8_0.gguf")
    # 16 of 64 layers have KV (every 4th); 4 KV heads × 256 × (K + V) × f16 = 8 KiB per layer.
    assert len(info.kv_layers()) == 16
    assert info.kv_bytes_per_token(info.kv_layers(), "f16", "f16") == 16 * 4 * 256 * 2 * 2
    message = by_code(findings, "llamacpp-memory-projection").message
    weights = (64 * 405_000_000 // Q8_BLOCK * Q8_BLOCK + 1_350_000_000 // Q8_BLOCK * Q8_BLOCK) / GIB
    assert f"weights {weights:.2f} GiB (65 of 65 layers)" in message
    assert "KV 8.00 GiB (131072 tokens, 2 slots, unified, f16/f16)" in message
    assert "recurrent state" in message and "31.86 GiB × 2 GPU(s) = 63.7 GiB" in message


# --- the file ---------------------------------------------------------------------------------


def test_the_header_facts(tmp_path: Path) -> None:
    path = small_gguf(tmp_path / "m.gguf", tied=False, file_type=LlamaFileType.MOSTLY_Q4_K_M)
    info = read_gguf(path)
    assert (info.arch, info.context_length, info.block_count) == ("qwen3", 8192, 2)
    assert (info.head_count, info.head_count_kv, info.head_dim) == (4, (2, 2), 64)
    assert info.quant == "Q4_K_M" and not info.tied_output
    assert info.tensor_bytes == sum(info.layer_bytes.values()) + info.output_bytes + info.token_embd_bytes
    # All layers + output on the GPU, the input embeddings never; the last N-1 layers for N.
    assert info.gpu_weight_bytes(3) == info.tensor_bytes - info.token_embd_bytes
    assert info.gpu_layers(2) == ([1], True) and info.gpu_layers(0) == ([], False)


def test_a_missing_file_names_its_key_line_and_gguf_convert(project: Project, tmp_path: Path) -> None:
    findings, _ = check(project, f"MODELS_DIR={tmp_path}")
    f = by_code(findings, "gguf-missing")
    assert f.severity == "error" and f.key == "LLAMACPP_MODEL"
    assert f.source is not None and f.source.startswith("env/models/tiny-gguf.env:")
    assert str(tmp_path / "tiny-qwen3-f16.gguf") in f.message
    assert f.fix is not None and "invoke gguf-convert" in f.fix


@pytest.mark.parametrize("content", [b"<html>rate limited</html>", b"GGUF\x03\x00\x00\x00\x01"])
def test_a_file_that_is_not_gguf_or_cut_short_is_an_error(
        project: Project, tmp_path: Path, content: bytes) -> None:
    (tmp_path / "tiny-qwen3-f16.gguf").write_bytes(content)
    with pytest.raises(GgufError) as caught:
        read_gguf(tmp_path / "tiny-qwen3-f16.gguf")
    assert caught.value.kind == "invalid"
    findings, _ = check(project, f"MODELS_DIR={tmp_path}")
    f = by_code(findings, "gguf-invalid")
    assert f.severity == "error" and f.fix is not None and "invoke gguf-convert" in f.fix


def test_a_relative_path_without_models_dir_is_under_the_default_models_folder(
        project: Project) -> None:
    """Where `invoke gguf-convert` writes without MODELS_DIR (issue 23): no .env edit needed."""
    findings, _ = check(project)
    f = by_code(findings, "gguf-missing")
    assert "vllmstack-models/tiny-qwen3-f16.gguf" in f.message and "gguf-convert" in (f.fix or "")
    assert "argv" not in codes(findings, "error")  # one mistake, one message


def test_a_missing_draft_model_is_an_error_too(project: Project, tmp_path: Path) -> None:
    small_gguf(tmp_path / "tiny-qwen3-f16.gguf")
    findings, _ = check(project, f"MODELS_DIR={tmp_path}", "LLAMACPP_DRAFT_MODEL=draft.gguf",
                        "LLAMACPP_SPEC_TYPE=draft-simple")
    f = by_code(findings, "gguf-missing")
    assert f.key == "LLAMACPP_DRAFT_MODEL" and f.source == "--set"


def test_a_path_outside_models_dir_cannot_reach_a_container(project: Project, tmp_path: Path) -> None:
    path = small_gguf(tmp_path / "elsewhere.gguf")
    findings, _ = check(project, f"LLAMACPP_MODEL={path}", f"MODELS_DIR={tmp_path / 'models'}",
                        "RUNTIME=compose")
    assert by_code(findings, "path-not-mounted").severity == "error"
    findings, _ = check(project, f"LLAMACPP_MODEL={path}", "RUNTIME=native")
    assert by_code(findings, "path-not-mounted").severity == "info"


def test_an_architecture_the_pinned_llama_cpp_lacks(project: Project, tmp_path: Path) -> None:
    small_gguf(tmp_path / "tiny-qwen3-f16.gguf", arch="qwen99")
    findings, _ = check(project, f"MODELS_DIR={tmp_path}")
    f = by_code(findings, "gguf-unknown-arch")
    assert f.severity == "error" and "'qwen99'" in f.message and "b9993" in f.message
    assert f.source is not None and f.source.startswith("env/models/tiny-gguf.env:")
    # Another ref may know it: then only a warning.
    findings, _ = check(project, f"MODELS_DIR={tmp_path}", "LLAMACPP_REF=12000")
    assert by_code(findings, "gguf-unknown-arch").severity == "warning"


def test_the_vendored_arch_list_is_the_pinned_refs() -> None:
    assert load_schema().keys["LLAMACPP_REF"].default == ARCHS_REF
    archs = known_archs()
    assert {"qwen3", "qwen35", "qwen35moe", "llama", "gemma3"} <= archs
    assert "clip" not in archs and "(unknown)" not in archs and len(archs) > 100


# --- context and memory -----------------------------------------------------------------------


def test_a_slot_context_above_the_trained_one_warns(project: Project, tmp_path: Path) -> None:
    small_gguf(tmp_path / "tiny-qwen3-f16.gguf", ctx=8192)
    # Split cache: 2 slots of 16384 > 8192.
    findings, _ = check(project, f"MODELS_DIR={tmp_path}", "LLAMACPP_CTX=32768", "LLAMACPP_PARALLEL=2",
                        "LLAMACPP_KV_UNIFIED=false")
    f = by_code(findings, "ctx-over-trained")
    assert f.severity == "warning" and "16384 tokens" in f.message and "LLAMACPP_CTX=16384" in (f.fix or "")
    assert f.source == "--set"
    # 8 slots of 4096 each are within it.
    findings, _ = check(project, f"MODELS_DIR={tmp_path}", "LLAMACPP_CTX=32768", "LLAMACPP_PARALLEL=8",
                        "LLAMACPP_KV_UNIFIED=false")
    assert "ctx-over-trained" not in codes(findings, "warning")
    # A unified cache lets one slot use it all.
    findings, _ = check(project, f"MODELS_DIR={tmp_path}", "LLAMACPP_CTX=16384")
    assert "LLAMACPP_CTX=8192" in (by_code(findings, "ctx-over-trained").fix or "")


def gpu(models: Path, *sets: str) -> list[str]:
    return [f"MODELS_DIR={models}", "GPU_VENDOR=nvidia", "GPU_COUNT=1", *sets]


def test_all_layers_and_a_long_context_that_do_not_fit_are_an_error(project: Project, tmp_path: Path) -> None:
    # 40 layers × 100 MiB (+ output) ≈ 3.9 GiB; 40 × 2 KV heads × 64 × 2 × f16 = 20 KiB per token.
    small_gguf(tmp_path / "tiny-qwen3-f16.gguf", layers=40, layer_bytes=100 * 2**20, ctx=131072)
    sets = gpu(tmp_path, "GPU_VRAM_GIB=6", "LLAMACPP_GPU_LAYERS=all", "LLAMACPP_CTX=131072")
    findings, _ = check(project, *sets, platform="nvidia")
    f = by_code(findings, "llamacpp-does-not-fit")
    assert f.severity == "error" and f.key == "LLAMACPP_GPU_LAYERS" and f.source == "--set"
    # 3.91 GiB + 131072 × 20 KiB = 2.5 GiB + 1 GiB overhead = 7.4 GiB > 6 GiB.
    assert "KV 2.50 GiB (131072 tokens" in f.message and "6 GiB × 1 GPU(s) = 6.0 GiB" in f.message
    fix = f.fix or ""
    # (6 - 1 - 3.91 GiB) / 20 KiB = 57k tokens; or 31 layers of 100 + 64 MiB KV, and the output.
    assert "LLAMACPP_CTX=56320 or less" in fix and "LLAMACPP_CACHE_TYPE_K=q8_0" in fix
    assert "LLAMACPP_GPU_LAYERS=32 " in fix
    # The suggested context fits.
    findings, _ = check(project, *sets, "LLAMACPP_CTX=56320", platform="nvidia")
    assert by_code(findings, "llamacpp-memory-projection").message.startswith("fits:")


def test_auto_layers_and_an_unset_context_are_fitted_by_llama_server(
        project: Project, tmp_path: Path) -> None:
    small_gguf(tmp_path / "tiny-qwen3-f16.gguf", layers=40, layer_bytes=100 * 2**20, ctx=131072)
    findings, _ = check(project, *gpu(tmp_path, "GPU_VRAM_GIB=6", "LLAMACPP_CTX=131072"),
                        "LLAMACPP_GPU_LAYERS=auto", platform="nvidia")
    f = by_code(findings, "llamacpp-partial-offload")
    assert f.severity == "warning" and "of 41 layers on the GPU" in f.message
    # No context set (a profile without LLAMACPP_CTX): --fit shrinks the trained context first,
    # all layers stay on the GPU.
    profile = project.env_dir / "models" / "tiny-gguf.env"
    profile.write_text("".join(line for line in profile.read_text().splitlines(keepends=True)
                               if not line.startswith("LLAMACPP_CTX=")))
    findings, _ = check(project, *gpu(tmp_path, "GPU_VRAM_GIB=6"), "LLAMACPP_GPU_LAYERS=all",
                        platform="nvidia")
    f = by_code(findings, "llamacpp-ctx-will-shrink")
    assert f.severity == "warning" and "≈56320 tokens" in f.message
    assert not codes(findings, "error")
    # An explicit 0 asks for the full trained context: --fit keeps it, so it does not fit.
    findings, _ = check(project, *gpu(tmp_path, "GPU_VRAM_GIB=6"), "LLAMACPP_GPU_LAYERS=all",
                        "LLAMACPP_CTX=0", platform="nvidia")
    assert by_code(findings, "llamacpp-does-not-fit").severity == "error"


def test_q8_kv_halves_the_kv_and_a_quantized_v_needs_flash_attention(
        project: Project, tmp_path: Path) -> None:
    small_gguf(tmp_path / "tiny-qwen3-f16.gguf", ctx=131072)
    base = gpu(tmp_path, "GPU_VRAM_GIB=80", "LLAMACPP_CTX=131072")
    f16 = by_code(check(project, *base, platform="nvidia")[0], "llamacpp-memory-projection").message
    q8 = by_code(check(project, *base, "LLAMACPP_CACHE_TYPE_K=q8_0", "LLAMACPP_CACHE_TYPE_V=q8_0",
                       platform="nvidia")[0], "llamacpp-memory-projection").message
    assert "KV 0.12 GiB" in f16 and "KV 0.07 GiB" in q8  # 2 × 2 × 64 × 2 × (2 vs 34/32) bytes
    findings, _ = check(project, *base, "LLAMACPP_CACHE_TYPE_V=q8_0", "LLAMACPP_FLASH_ATTN=off",
                        platform="nvidia")
    f = by_code(findings, "quantized-v-needs-flash-attn")
    assert f.severity == "error" and f.key == "LLAMACPP_CACHE_TYPE_V"


def test_hybrid_layers_hold_state_not_kv_and_cpu_moe_frees_expert_bytes(tmp_path: Path) -> None:
    path = small_gguf(tmp_path / "h.gguf", arch="qwen35moe", layers=8, expert_bytes=2**22,
                      extra={"qwen35moe.ssm.conv_kernel": 4, "qwen35moe.ssm.inner_size": 512,
                             "qwen35moe.ssm.state_size": 128, "qwen35moe.ssm.group_count": 2})
    info = read_gguf(path)
    # No full_attention_interval in the file: qwen35moe's default is every 4th layer.
    assert info.kv_layers() == [3, 7] and sum(info.recurrent) == 6
    assert info.recurrent_state_bytes == (3 * (512 + 2 * 2 * 128) + 128 * 512) * 4
    expert = 2**22 // Q8_BLOCK * Q8_BLOCK
    assert info.gpu_weight_bytes(9, n_cpu_moe=3) == info.gpu_weight_bytes(9) - 3 * expert


def test_split_files_are_summed(tmp_path: Path) -> None:
    first = small_gguf(tmp_path / "m-00001-of-00002.gguf", extra={"split.count": 2})
    small_gguf(tmp_path / "m-00002-of-00002.gguf", layers=2)
    assert read_gguf(first).tensor_bytes == 2 * read_gguf(tmp_path / "m-00002-of-00002.gguf").tensor_bytes


def test_a_value_llama_server_refuses_is_a_finding_on_its_key(project: Project, tmp_path: Path) -> None:
    small_gguf(tmp_path / "tiny-qwen3-f16.gguf")
    findings, ctx = check(project, f"MODELS_DIR={tmp_path}", "LLAMACPP_GPU_LAYERS=most")
    f = by_code(findings, "argv")
    assert f.key == "LLAMACPP_GPU_LAYERS" and f.source == "--set" and "auto" in (f.fix or "")
    assert ctx.command is None
    # A value the schema already refused is said once, by the resolver.
    findings, _ = check(project, f"MODELS_DIR={tmp_path}", "LLAMACPP_PARALLEL=many")
    assert codes(findings, "error") == ["bad-value"]


def test_a_backend_the_platform_cannot_run(project: Project, tmp_path: Path) -> None:
    small_gguf(tmp_path / "tiny-qwen3-f16.gguf")
    findings, _ = check(project, f"MODELS_DIR={tmp_path}", "LLAMACPP_BACKEND=cuda")
    assert by_code(findings, "llamacpp-backend-vendor").severity == "error"
    findings, _ = check(project, f"MODELS_DIR={tmp_path}", "LLAMACPP_BACKEND=cpu", platform="r9700")
    assert by_code(findings, "llamacpp-cpu-on-gpu-platform").severity == "warning"


# --- which rules run ----------------------------------------------------------------------------


def test_each_engine_gets_its_own_rules(project: Project, tmp_path: Path) -> None:
    small_gguf(tmp_path / "tiny-qwen3-f16.gguf")
    findings, ctx = check(project, f"MODELS_DIR={tmp_path}")
    found = {f.code for f in findings}
    # No VLLM_MODEL is asked for, and no vLLM projection runs on the empty vLLM geometry.
    assert "missing-required" not in found and "memory-unknown" not in found
    assert {"gguf-header", "llamacpp-memory-projection"} <= found
    findings, ctx = check(project, model="tiny", platform="cpu")
    assert ctx.command is not None and ctx.command.argv[:2] == ["vllm", "serve"]
    assert ctx.gguf is None and not {f.code for f in findings if f.code.startswith(("gguf", "llamacpp"))}
    assert set(RULE_ENGINES) <= set(RULES)


def test_check_prints_the_llama_cpp_findings(project: Project, tmp_path: Path) -> None:
    small_gguf(tmp_path / "tiny-qwen3-f16.gguf", arch="qwen99")
    resolved = resolve(project, model="tiny-gguf", platform="cpu",
                       overrides=[f"MODELS_DIR={tmp_path}"], environ={"HOME": "/nonexistent"})
    findings = check_profile(project, resolved, {"HOME": "/nonexistent"}, RecordingRunner(), deep=True)
    text = render_report(resolved, findings)
    assert text.splitlines()[0] == "profile tiny-gguf on cpu (llama.cpp)"
    assert "ERROR   gguf-unknown-arch [LLAMACPP_MODEL @ env/models/tiny-gguf.env:5]" in text
    assert "INFO    gguf-header" in text and "INFO    llamacpp-memory-projection" in text
    assert text.splitlines()[-1] == "FAILED: 1 error(s), 0 warning(s)"
    assert "deep-vllm-only" in {f.code for f in findings}  # --deep has no vLLM argv to parse
