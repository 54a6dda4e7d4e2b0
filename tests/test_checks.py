"""One test per check rule: each fault class is caught before boot, with a fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllmstack.checks.registry import run_checks
from vllmstack.config.engines.table import engine_of
from vllmstack.config.profiles import list_profiles, resolve
from vllmstack.core.findings import Finding
from vllmstack.core.paths import Project


def check(project: Project, *sets: str, model: str = "qwen3.8-27b", platform: str = "2xr9700",
          environ: dict[str, str] | None = None) -> list[Finding]:
    resolved = resolve(project, model=model, platform=platform, overrides=list(sets))
    findings, _ = run_checks(project, resolved, environ or {"HOME": "/nonexistent"})
    return findings


def by_code(findings: list[Finding], code: str) -> Finding:
    hits = [f for f in findings if f.code == code]
    assert hits, f"no {code} in {[f.code for f in findings]}"
    return hits[0]


def errors(findings: list[Finding]) -> list[str]:
    return [f.code for f in findings if f.severity == "error"]


SHIPPED = Project(Path(__file__).resolve().parents[1])


@pytest.mark.parametrize(
    ("model", "platform"),
    # ENGINE=llamacpp profiles need their GGUF files: tests/test_llamacpp_checks.py makes them.
    [(p.name, plat) for p in list_profiles(SHIPPED)
     if p.kind == "model" and engine_of(resolve(SHIPPED, model=p.name)) == "vllm"
     for plat in p.platforms],
)
def test_every_shipped_profile_passes_on_its_intended_platforms(
    shipped: Project, model: str, platform: str
) -> None:
    resolved = resolve(shipped, model=model, platform=platform)
    findings, ctx = run_checks(shipped, resolved, {"HOME": "/nonexistent"})
    assert errors(findings) == [], [f.render() for f in findings if f.severity == "error"]
    assert [f.code for f in findings if f.severity == "warning"] == []
    assert ctx.command is not None and ctx.command.argv[:2] == ["vllm", "serve"]


def test_missing_required_value(project: Project) -> None:
    f = by_code(check(project, "VLLM_SERVED_NAME="), "missing-required")
    assert f.key == "VLLM_SERVED_NAME" and f.severity == "error" and f.source == "--set"


def test_mtp_depth_too_deep_for_concurrency(project: Project) -> None:
    findings = check(project, 'VLLM_SPEC_DECODE={"method": "mtp", "num_speculative_tokens": 3}')
    f = by_code(findings, "mtp-depth-vs-seqs")
    assert f.severity == "error" and "3 draft tokens" in f.message and "max_num_seqs=4" in f.message
    assert f.fix is not None and '"num_speculative_tokens": 1' in f.fix
    # Below the corruption threshold the same depth is fine.
    ok = check(project, 'VLLM_SPEC_DECODE={"method": "mtp", "num_speculative_tokens": 3}',
               "VLLM_MAX_NUM_SEQS=3")
    assert "mtp-depth-vs-seqs" not in errors(ok)


def test_mtp_gets_no_async_scheduling_and_says_so(project: Project) -> None:
    findings = check(project)
    note = by_code(findings, "spec-implies-no-async")
    assert note.severity == "info" and note.key == "VLLM_SPEC_DECODE"
    resolved = resolve(project, overrides=["VLLM_EXTRA_ARGS=--async-scheduling"])
    findings, ctx = run_checks(project, resolved, {})
    assert ctx.command is not None and "--async-scheduling" not in ctx.command.argv
    assert "--no-async-scheduling" in ctx.command.argv
    assert by_code(findings, "async-with-spec-removed").severity == "warning"


def test_spec_config_without_token_count(project: Project) -> None:
    f = by_code(check(project, 'VLLM_SPEC_DECODE={"method": "mtp"}'), "spec-missing-tokens")
    assert f.severity == "error"


def test_known_mamba_block_count_caps_max_num_seqs(project: Project) -> None:
    f = by_code(check(project, "MAMBA_CACHE_BLOCKS=249", "VLLM_MAX_NUM_SEQS=256",
                      'VLLM_SPEC_DECODE='), "mamba-blocks")
    assert f.severity == "error" and "(249" in f.message and "VLLM_MAX_NUM_SEQS=249" in (f.fix or "")


def test_estimated_mamba_blocks_warn(project: Project) -> None:
    f = by_code(check(project, "VLLM_MAX_NUM_SEQS=4096", "VLLM_MAX_BATCHED_TOKENS=8192",
                      "VLLM_SPEC_DECODE="), "mamba-blocks-estimate")
    assert f.severity == "warning" and "MAMBA_CACHE_BLOCKS" in (f.fix or "")


def test_hybrid_moe_needs_the_gdn_block_in_one_step(project: Project) -> None:
    f = by_code(check(project, "VLLM_MAX_BATCHED_TOKENS=2048", model="qwen3.6-35b-a3b"),
                "moe-gdn-block")
    assert f.severity == "error" and "2112" in f.message
    assert "moe-gdn-block" not in errors(check(project, "VLLM_MAX_BATCHED_TOKENS=2048"))


def test_batched_tokens_below_max_num_seqs(project: Project) -> None:
    f = by_code(check(project, "VLLM_MAX_BATCHED_TOKENS=2", model="qwen3-0.6b"),
                "batched-below-seqs")
    assert "must be greater than or equal to max_num_seqs (8)" in f.message


def test_max_model_len_over_model_positions(project: Project) -> None:
    f = by_code(check(project, "VLLM_MAX_MODEL_LEN=65536", model="qwen3-0.6b"),
                "max-len-over-model")
    assert f.severity == "error" and "40960" in f.message
    allowed = check(project, "VLLM_MAX_MODEL_LEN=65536", "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1",
                    model="qwen3-0.6b")
    assert by_code(allowed, "max-len-over-model").severity == "warning"


def test_more_tensor_parallel_than_gpus(project: Project) -> None:
    f = by_code(check(project, "VLLM_TP=4"), "tp-over-gpus")
    assert f.severity == "error" and "has 2" in f.message
    assert f.fix == "set VLLM_TP=2, or use a platform with 4 GPUs"
    g = by_code(check(project, "HIP_VISIBLE_DEVICES=0"), "tp-over-visible")
    assert "exposes 1 GPU" in g.message


def test_tensor_parallel_must_divide_heads(project: Project) -> None:
    f = by_code(check(project, "GPU_COUNT=8", "VLLM_TP=5", "HIP_VISIBLE_DEVICES=0,1,2,3,4"),
                "tp-heads")
    assert "(24)" in f.message


def test_model_that_cannot_fit_gets_numbers(project: Project) -> None:
    f = by_code(check(project, platform="r9700", model="qwen3.6-27b"), "weights-do-not-fit")
    assert "29.5 GiB" in f.message and "short" in f.message
    g = by_code(check(project, "VLLM_MAX_MODEL_LEN=262144", "VLLM_GPU_MEM_UTIL=0.7",
                      "VLLM_KV_CACHE_DTYPE=bfloat16", model="qwen3.6-27b"), "kv-does-not-fit")
    assert "needs" in g.message and "VLLM_MAX_MODEL_LEN=" in (g.fix or "")
    # The suggested length really fits.
    suggested = (g.fix or "").split("VLLM_MAX_MODEL_LEN=")[1].split()[0]
    fine = check(project, f"VLLM_MAX_MODEL_LEN={suggested}", "VLLM_GPU_MEM_UTIL=0.7",
                 "VLLM_KV_CACHE_DTYPE=bfloat16", model="qwen3.6-27b")
    assert "kv-does-not-fit" not in errors(fine)


def test_empty_hsa_override_hides_gpus(project: Project) -> None:
    f = by_code(check(project, "HSA_OVERRIDE_GFX_VERSION="), "hsa-override-empty")
    assert f.severity == "error" and f.source == "--set"


def test_hsa_override_where_it_must_not_be(project: Project) -> None:
    f = by_code(check(project, "HSA_OVERRIDE_GFX_VERSION=12.0.1"), "hsa-override-unneeded")
    assert f.severity == "warning"


def test_arch_without_kernels_needs_an_override(project: Project) -> None:
    f = by_code(check(project, "GPU_ARCH=gfx1102", platform="rdna3", model="qwen3-0.6b"),
                "hsa-override-missing")
    assert "11.0.0" in (f.fix or "")
    ok = check(project, "GPU_ARCH=gfx1102", "HSA_OVERRIDE_GFX_VERSION=11.0.0", platform="rdna3",
               model="qwen3-0.6b")
    assert not [x for x in ok if x.code.startswith("hsa-")]


def test_aiter_on_an_arch_without_it(project: Project) -> None:
    f = by_code(check(project, "ATTENTION_BACKEND=ROCM_AITER_UNIFIED_ATTN", platform="strix-halo",
                      model="qwen3-0.6b"), "aiter-backend-unsupported")
    assert f.severity == "error" and "gfx1151" in f.message
    g = by_code(check(project, "VLLM_ROCM_USE_AITER=1", platform="rdna3", model="qwen3-0.6b"),
                "aiter-no-effect")
    assert g.severity == "warning"


def test_pins_ref_and_version_disagree(project: Project) -> None:
    f = by_code(check(project, "VLLM_REF=v0.32.0"), "pin-vllm-mismatch")
    assert f.fix == "set VLLM_VERSION=0.32.0 (bump both together)"
    # A branch or commit ref cannot be compared and is fine.
    assert "pin-vllm-mismatch" not in errors(check(project, "VLLM_REF=main"))


def test_pins_torch_and_rocm_suffixes_disagree(project: Project) -> None:
    f = by_code(check(project, "TORCH_VERSION=2.13.0+rocm10.0.0"), "pin-rocm-mismatch")
    assert "ROCm 10.0.0" in f.message and f.key == "TORCH_VERSION"
    g = by_code(check(project, "TORCHAUDIO_VERSION=2.11.0+rocm7.2"), "pin-rocm-mismatch")
    assert g.key == "TORCHAUDIO_VERSION"


def test_empty_required_pin(project: Project) -> None:
    f = by_code(check(project, "FLYDSL_VERSION="), "empty-pin")
    assert f.key == "FLYDSL_VERSION" and f.severity == "error"
    # A prebuilt image needs no build pins.
    assert "empty-pin" not in errors(check(project, "FLYDSL_VERSION=", platform="nvidia",
                                           model="qwen3-0.6b"))


def test_missing_files_referenced(project: Project, tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    findings = check(project, f"MODELS_DIR={models}", f"VLLM_MODEL={models}/nope",
                     "VLLM_CHAT_TEMPLATE=qwen-missing.jinja", f"VLLM_HF_CONFIG_PATH={models}/cfg")
    assert by_code(findings, "missing-model-dir").key == "VLLM_MODEL"
    assert by_code(findings, "missing-chat-template").key == "VLLM_CHAT_TEMPLATE"
    assert by_code(findings, "missing-hf-config").key == "VLLM_HF_CONFIG_PATH"


def test_local_model_outside_models_dir_is_not_visible_in_the_container(
    project: Project, tmp_path: Path
) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    f = by_code(check(project, f"VLLM_MODEL={model}"), "path-not-mounted")
    assert "MODELS_DIR" in (f.fix or "")
    ok = check(project, f"VLLM_MODEL={model}", f"MODELS_DIR={tmp_path}")
    assert "path-not-mounted" not in errors(ok)


def test_config_json_in_hf_cache_overrides_profile_geometry(project: Project, tmp_path: Path) -> None:
    snap = tmp_path / "hub/models--Qwen--Qwen3-0.6B/snapshots/abc"
    snap.mkdir(parents=True)
    (tmp_path / "hub/models--Qwen--Qwen3-0.6B/refs").mkdir()
    (tmp_path / "hub/models--Qwen--Qwen3-0.6B/refs/main").write_text("abc")
    (snap / "config.json").write_text(json.dumps({
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "hidden_size": 1024, "max_position_embeddings": 8192}))
    findings = check(project, "VLLM_MAX_MODEL_LEN=16384", model="qwen3-0.6b",
                     environ={"HF_HOME": str(tmp_path)})
    f = by_code(findings, "max-len-over-model")
    assert "8192" in f.message and "config.json" in f.message


def test_tuned_moe_file_for_another_tp(project: Project) -> None:
    name = "E=256,N=512,device_name=AMD_Radeon_R9700,dtype=fp8_w8a8,block_shape=[128,128].json"
    (project.root / "fused_moe_configs").mkdir(exist_ok=True)
    (project.root / "fused_moe_configs" / name).write_text('{"1": {}}')
    f = by_code(check(project, model="qwen3.6-35b-a3b"), "tuned-wrong-tp")
    assert "N=256" in f.message and "TP=1" in f.message
    good = name.replace("N=512", "N=256")
    (project.root / "fused_moe_configs" / name).rename(project.root / "fused_moe_configs" / good)
    assert "tuned-wrong-tp" not in [x.code for x in check(project, model="qwen3.6-35b-a3b")]


def test_tuned_dense_file_problems(project: Project) -> None:
    folder = project.root / "fp8_configs"
    folder.mkdir(exist_ok=True)
    tail = ",device_name=AMD_Radeon_R9700,dtype=fp8_w8a8,block_shape=[128,128].json"
    (folder / f"N=34816,K=5120{tail}").write_text('{"1": {}}')  # gate_up at TP1
    (folder / f"N=5120,K=8704{tail}").write_text('{"triton_version": "3.6", "1": {}}')
    (folder / "N=5120,K=8704,device_name=AMD_Radeon_RX7900XTX,dtype=fp8_w8a8,"
              "block_shape=[128,128].json").write_text("{}")
    (folder / "tuned.json").write_text("{}")
    findings = check(project)
    assert "TP=1" in by_code(findings, "tuned-wrong-tp").message
    assert by_code(findings, "tuned-triton-version").severity == "error"
    assert by_code(findings, "tuned-other-device").severity == "warning"
    assert by_code(findings, "tuned-bad-name").source == "fp8_configs/tuned.json"


def test_profile_on_a_platform_it_is_not_made_for(project: Project) -> None:
    f = by_code(check(project, platform="rdna3", model="qwen3.6-35b-a3b"), "untested-platform")
    assert f.severity == "warning"


def test_dotenv_override_of_a_profile_value_is_explained(project: Project) -> None:
    project.dotenv.write_text((project.root / ".env.example").read_text() + "VLLM_MAX_NUM_SEQS=3\n")
    f = by_code(check(project), "dotenv-override")
    assert "'3'" in f.message and "env/models/qwen3.8-27b.env" in f.message


@pytest.mark.parametrize("setting", ["VLLM_TP=two", 'VLLM_SPEC_DECODE={"method": "mtp",',
                                     "VLLM_GPU_MEM_UTIL=lots", "VLLM_MAX_NUM_SEQS=-1"])
def test_one_mistake_gives_one_error_not_a_cascade(project: Project, setting: str) -> None:
    assert len(errors(check(project, setting))) == 1


def test_local_paths_need_no_mount_for_the_native_runtime(project: Project, tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    resolved = resolve(project, overrides=[f"VLLM_MODEL={model}"])
    findings, _ = run_checks(project, resolved, {}, runtime="native")
    assert "path-not-mounted" not in errors(findings)
    assert "path-not-mounted" in errors(run_checks(project, resolved, {}, runtime="compose")[0])


def test_deep_check_says_when_vllms_parser_accepts_the_argv(
    project: Project, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllmstack.checks import registry as checks
    from vllmstack.core.runner import RecordingRunner

    seen: list[list[str]] = []
    verdicts: list[list[Finding]] = [[], [Finding("error", "vllm-unknown-flag", "no flag --x")]]

    def fake(project: Project, runner: object, argv: list[str], resolved: object) -> list[Finding]:
        seen.append(argv)
        return verdicts.pop(0)

    monkeypatch.setattr(checks.vllm_parser, "check_with_vllm_parser", fake)
    resolved = resolve(project)
    ok = checks.check_profile(project, resolved, {}, RecordingRunner(), deep=True)
    assert "vllm-parser-ok" in [f.code for f in ok] and seen[0][:2] == ["vllm", "serve"]
    bad = checks.check_profile(project, resolved, {}, RecordingRunner(), deep=True)
    assert "vllm-parser-ok" not in [f.code for f in bad] and "vllm-unknown-flag" in errors(bad)


# --- runtime-aware checks: container concerns are notes for the native runtime ---------------


def test_container_concerns_are_info_for_the_native_runtime(project: Project, tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    # A native run of another vLLM than the overlays were derived for.
    resolved = resolve(project, overrides=[f"VLLM_MODEL={model}", "VLLM_REF=v0.27.1",
                                           "VLLM_VERSION=0.27.1"])
    native, _ = run_checks(project, resolved, {}, runtime="native")
    assert errors(native) == []
    for code in ("path-not-mounted", "overlay-ref-mismatch"):
        note = by_code(native, code)
        assert note.severity == "info" and "native runtime" in note.message
    compose, _ = run_checks(project, resolved, {}, runtime="compose")
    assert {"path-not-mounted", "overlay-ref-mismatch"} <= set(errors(compose))


# --- NVIDIA (and AMD) platforms read the card ------------------------------------------------

# Real output of `nvidia-smi --query-gpu=index,name,memory.total,memory.reserved
# --format=csv,noheader,nounits` on the 2x H200 machine (2026-11-30); torch reported
# 150109880320 bytes total per card there = (143771 - 616) MiB.
NVIDIA_SMI_2XH200 = (Path(__file__).parent / "data" / "nvidia-smi-2xh200.csv").read_text()
DETECT = ("nvidia-smi", "--query-gpu=index,name,memory.total,memory.reserved")


def nvidia_runner(stdout: str = NVIDIA_SMI_2XH200, *, old_driver: bool = False) -> object:
    from vllmstack.core.runner import RecordingRunner, Result

    runner = RecordingRunner()
    if old_driver:  # no memory.reserved field: nvidia-smi says so and exits 2
        runner.respond(DETECT, Result((), 2, 'Field "memory.reserved" is not a valid field to '
                                      "query.\n", ""))
        runner.respond(("nvidia-smi", "--query-gpu=index,name,memory.total"),
                       Result((), 0, "\n".join(",".join(line.split(",")[:3])
                                                for line in stdout.splitlines()) + "\n", ""))
    else:
        runner.respond(DETECT, Result((), 0, stdout, ""))
    return runner


def detect(project: Project, *sets: str, platform: str = "2xnvidia", model: str = "qwen3.6-27b",
           runner: object | None = None) -> tuple[list[Finding], object]:
    resolved = resolve(project, model=model, platform=platform, overrides=list(sets))
    findings, ctx = run_checks(project, resolved, {"HOME": "/nonexistent"},
                               runner=runner or nvidia_runner())  # type: ignore[arg-type]
    return findings, ctx


def test_nvidia_platform_takes_memory_and_name_from_the_card(project: Project) -> None:
    findings, ctx = detect(project)
    note = by_code(findings, "gpu-detected")
    assert note.severity == "info" and "2 × NVIDIA_H200 with 139.8 GiB" in note.message
    assert "143771 MiB total - 616 MiB reserved" in note.message
    assert "GPU_VRAM_GIB=139.80" in note.message and "GPU_DEVICE_NAME=NVIDIA_H200" in note.message
    resolved = ctx.resolved  # type: ignore[attr-defined]
    assert resolved.get("GPU_DEVICE_NAME") == "NVIDIA_H200"
    assert resolved.source("GPU_VRAM_GIB") == "detected: nvidia-smi"
    # The projection runs on the card's memory (the platform pins none): 139.8 × 0.95.
    assert "139.8 GiB × 0.95 = 132.8 GiB usable per GPU" in by_code(findings, "memory-projection").message
    assert errors(findings) == []
    from vllmstack.checks.registry import render_report

    assert "gpu-detected" in render_report(resolved, findings)  # shown without --verbose


def test_an_older_driver_without_the_reserved_field_still_detects(project: Project) -> None:
    findings, _ = detect(project, runner=nvidia_runner(old_driver=True))
    assert "2 × NVIDIA_H200 with 140.4 GiB" in by_code(findings, "gpu-detected").message


def test_two_gpu_platform_on_a_one_gpu_host_is_refused(project: Project) -> None:
    one = NVIDIA_SMI_2XH200.splitlines()[0] + "\n"
    findings, _ = detect(project, runner=nvidia_runner(one))
    f = by_code(findings, "tp-over-detected-gpus")
    assert f.severity == "error" and "sees 1 on this host" in f.message and f.key == "VLLM_TP"


def test_pinned_values_that_contradict_the_card_are_named(project: Project) -> None:
    findings, ctx = detect(project, "GPU_VRAM_GIB=31.36", "GPU_DEVICE_NAME=NVIDIA_GeForce_RTX_5090")
    vram = by_code(findings, "gpu-vram-differs")
    assert vram.severity == "warning" and "139.8 GiB" in vram.message and vram.source == "--set"
    name = by_code(findings, "gpu-name-differs")
    assert "NVIDIA_H200" in name.message and "NVIDIA_H200" in (name.fix or "")
    assert ctx.resolved.get("GPU_VRAM_GIB") == "31.36"  # type: ignore[attr-defined]  # a pin wins


def test_no_nvidia_smi_skips_the_projection_and_says_so(project: Project) -> None:
    from vllmstack.core.runner import RecordingRunner, Result

    runner = RecordingRunner()
    runner.respond(("nvidia-smi",), Result((), 127, "", "nvidia-smi: command not found"))
    findings, _ = detect(project, runner=runner)
    assert by_code(findings, "gpu-not-detected").severity == "info"
    assert "memory-projection" not in [f.code for f in findings]
    # Without a runner (tests, the dashboard) nothing is run and nothing is said.
    resolved = resolve(project, model="qwen3.6-27b", platform="2xnvidia")
    quiet, _ = run_checks(project, resolved, {})
    assert not {"gpu-detected", "gpu-not-detected"} & {f.code for f in quiet}


def test_2xnvidia_is_the_nvidia_platform_with_two_gpus(project: Project) -> None:
    resolved = resolve(project, model="qwen3.6-27b", platform="2xnvidia")
    assert (resolved.get("GPU_VENDOR"), resolved.get("GPU_COUNT"), resolved.get("VLLM_TP"),
            resolved.get("CUDA_VISIBLE_DEVICES")) == ("nvidia", "2", "2", "0,1")
    assert resolved.get("GPU_VRAM_GIB") is None and resolved.get("GPU_DEVICE_NAME") is None


def test_amd_cards_are_read_from_the_drivers_sysfs(tmp_path: Path) -> None:
    from vllmstack.core.runner import RecordingRunner
    from vllmstack.runtime.gpu import detect_cards

    def card(n: int, vendor: str, device: str, vram: int) -> None:
        folder = tmp_path / f"sys/class/drm/card{n}/device"
        folder.mkdir(parents=True)
        (folder / "vendor").write_text(vendor + "\n")
        (folder / "device").write_text(device + "\n")
        (folder / "mem_info_vram_total").write_text(str(vram))

    card(0, "0x8086", "0xa780", 0)  # the board's Intel iGPU: not an AMD card
    card(1, "0x1002", "0x7551", 34208743424)  # R9700: 31.86 GiB, as the platform pins it
    card(2, "0x1002", "0x7551", 34208743424)
    (tmp_path / "sys/class/drm/card1-DP-1").mkdir()  # a connector, not a card
    found = detect_cards("amd", RecordingRunner(), root=tmp_path)
    assert found is not None and found.source == "sysfs"
    assert [(c.index, c.name, round(c.total_bytes / 1024**3, 2)) for c in found.cards] == [
        (0, "AMD_Radeon_R9700", 31.86), (1, "AMD_Radeon_R9700", 31.86)]
