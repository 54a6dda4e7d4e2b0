"""The known RDNA4 (gfx1201, 2x R9700) failures are refused before boot (issue 39): each rule on
the condition its source thread reports, and the shipped R9700 profiles pass."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from vllmstack.checks import rdna4
from vllmstack.checks.host.amd import check_rocm
from vllmstack.checks.host.model import PASS, SKIP, WARN, HostView, UserIds
from vllmstack.checks.registry import check_profile, run_checks
from vllmstack.config.profiles import resolve
from vllmstack.core.findings import Finding
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.image.build import PIN_LABEL, ROCM_RELEASE_LABEL, image_labels
from vllmstack.image.patches import VerifyReport
from vllmstack.serve import lifecycle

MTP3 = 'VLLM_SPEC_DECODE={"method": "mtp", "num_speculative_tokens": 3}'


def check(project: Project, *sets: str, model: str = "qwen3.8-27b",
          platform: str = "2xr9700") -> list[Finding]:
    resolved = resolve(project, model=model, platform=platform, overrides=list(sets))
    findings, _ = run_checks(project, resolved, {"HOME": "/nonexistent"})
    return findings


def codes(findings: list[Finding], severity: str = "error") -> list[str]:
    return [f.code for f in findings if f.severity == severity]


def one(findings: list[Finding], code: str) -> Finding:
    hits = [f for f in findings if f.code == code]
    assert len(hits) == 1, [f.code for f in findings]
    return hits[0]


# --- TP=2 deadlock: ROCm/rocm-systems#5480, vllm#40980 ----------------------------------------

def test_tp2_on_gfx1201_without_simple_protocol_is_refused_naming_both_issues(
        project: Project) -> None:
    f = one(check(project, "NCCL_PROTO="), "rccl-ll-deadlock")
    assert f.severity == "error" and "VLLM_TP=2" in f.message
    assert "ROCm/rocm-systems#5480" in f.message and "vllm-project/vllm#40980" in f.message
    assert f.fix is not None and "NCCL_PROTO=Simple" in f.fix


def test_a_protocol_list_that_keeps_ll_is_refused_and_one_that_drops_it_passes(
        project: Project) -> None:
    assert "rccl-ll-deadlock" in codes(check(project, "NCCL_PROTO=LL,Simple"))
    assert "rccl-ll-deadlock" in codes(check(project, "NCCL_PROTO=^LL128"))
    assert "rccl-ll-deadlock" not in codes(check(project, "NCCL_PROTO=^LL"))
    assert "rccl-ll-deadlock" not in codes(check(project, "NCCL_PROTO=LL128,Simple"))


def test_the_shipped_tp2_platform_sets_simple_and_one_gpu_needs_nothing(project: Project) -> None:
    assert "rccl-ll-deadlock" not in codes(check(project))
    assert "rccl-ll-deadlock" not in codes(check(project, "NCCL_PROTO=", model="qwen3-0.6b",
                                                 platform="r9700"))


def test_the_protocol_given_through_engine_env_counts(project: Project) -> None:
    assert "rccl-ll-deadlock" not in codes(check(project, "NCCL_PROTO=",
                                                 "ENGINE_ENV=NCCL_PROTO=Simple"))


def test_no_image_label_exempts_the_deadlock_while_no_rccl_release_has_the_fix(
        project: Project) -> None:
    resolved = resolve(project, model="qwen3.8-27b", platform="2xr9700", overrides=["NCCL_PROTO="])
    findings, _ = run_checks(project, resolved, {"HOME": "/nonexistent"})
    kept = rdna4.with_image_labels(findings, resolved, {ROCM_RELEASE_LABEL: "99.0"})
    assert rdna4.FIRST_FIXED_RCCL is None and "rccl-ll-deadlock" in codes(kept)


def test_a_fixed_rccl_release_in_the_label_would_pass(monkeypatch: pytest.MonkeyPatch,
                                                      project: Project) -> None:
    monkeypatch.setattr(rdna4, "FIRST_FIXED_RCCL", (11, 0))
    resolved = resolve(project, model="qwen3.8-27b", platform="2xr9700", overrides=["NCCL_PROTO="])
    findings, _ = run_checks(project, resolved, {"HOME": "/nonexistent"})
    assert "rccl-ll-deadlock" not in codes(
        rdna4.with_image_labels(findings, resolved, {ROCM_RELEASE_LABEL: "11.0"}))
    assert "rccl-ll-deadlock" in codes(
        rdna4.with_image_labels(findings, resolved, {ROCM_RELEASE_LABEL: "10.1"}))


def test_the_build_records_the_rocm_release_the_check_reads(project: Project) -> None:
    resolved = resolve(project, model="qwen3.8-27b", platform="2xr9700")
    labels = image_labels(project, resolved, VerifyReport([]))
    assert labels[ROCM_RELEASE_LABEL] == "10.1"  # .env.example's ROCM_IMAGE tag 10.1.0-full
    assert labels[PIN_LABEL + "gpu_arch"] == "gfx1201"


# --- MTP with concurrency: vllm#35288 ---------------------------------------------------------

def test_mtp_past_one_draft_at_four_sequences_is_refused_naming_the_issue(project: Project) -> None:
    f = one(check(project, MTP3, "VLLM_MAX_NUM_SEQS=4"), "mtp-depth-vs-seqs")
    assert f.severity == "error" and "vllm-project/vllm#35288" in f.message
    assert f.fix is not None and "VLLM_MAX_NUM_SEQS=3" in f.fix
    assert "mtp-depth-vs-seqs" not in codes(check(project, MTP3, "VLLM_MAX_NUM_SEQS=3"))


def test_the_shipped_mtp1_profile_at_four_sequences_passes(project: Project) -> None:
    # MTP1 at 4 was held without garbling (seed README, benchmarks/2026-10-06_mtp1_c4_hold.md).
    assert "mtp-depth-vs-seqs" not in codes(check(project))


# --- fp8 KV with unified attention: vllm#46192, ROCm/aiter#3294 --------------------------------

def test_fp8_kv_on_unified_attention_with_an_older_aiter_is_refused(project: Project) -> None:
    f = one(check(project, "AITER_REF=v0.1.20"), "fp8-kv-unified-attn")
    assert f.severity == "error" and "vllm-project/vllm#46192" in f.message
    assert f.fix is not None and "bfloat16" in f.fix
    assert "fp8-kv-unified-attn" not in codes(check(project, "AITER_REF=v0.1.20",
                                                    "VLLM_KV_CACHE_DTYPE=bfloat16"))
    assert "fp8-kv-unified-attn" not in codes(check(project, "AITER_REF=v0.1.20",
                                                    "ATTENTION_BACKEND=TRITON_ATTN"))


def test_fp8_kv_with_an_aiter_commit_is_a_warning_and_the_pinned_release_passes(
        project: Project) -> None:
    findings = check(project, "AITER_REF=" + "a" * 40)
    assert "fp8-kv-unified-attn" in codes(findings, "warning")
    assert not [f for f in check(project) if f.code == "fp8-kv-unified-attn"]


# --- an image without the card's arch: ROCm/aiter#5229 -----------------------------------------

def test_an_image_built_for_another_arch_is_an_error_and_no_label_is_unknown(
        project: Project) -> None:
    resolved = resolve(project, model="qwen3.8-27b", platform="2xr9700")
    f = one(rdna4.image_arch_findings(resolved, {PIN_LABEL + "gpu_arch": "gfx1100"}),
            "image-lacks-arch")
    assert f.severity == "error" and "Failed core proc(s): {}" in f.message
    assert "ROCm/aiter#5229" in f.message and f.fix is not None and "invoke build" in f.fix
    assert rdna4.image_arch_findings(resolved, {PIN_LABEL + "gpu_arch": "gfx1100;gfx1201"}) == []
    assert rdna4.image_arch_findings(resolved, {}) == []
    assert rdna4.image_arch_findings(resolved, None) == []


def test_an_hsa_override_on_gfx1201_warns(project: Project) -> None:
    assert "hsa-override-unneeded" in codes(check(project, "HSA_OVERRIDE_GFX_VERSION=11.0.0"),
                                            "warning")


# --- doctor: the host's ROCm against the known-bad list ----------------------------------------

def rocm_host(tmp_path: Path, version: str | None) -> HostView:
    if version is not None:
        info = tmp_path / "opt" / "rocm" / ".info"
        info.mkdir(parents=True)
        (info / "version").write_text(version + "\n")
    return HostView(tmp_path, None, UserIds(1000, "alice", frozenset()), lambda _p: None)


def test_doctor_reads_the_host_rocm_and_names_the_known_bad(tmp_path: Path) -> None:
    fault = check_rocm(rocm_host(tmp_path / "a", "7.14.0-123"), "amd", "gfx1201", 1, "")
    assert fault.status == WARN and "ROCm/legacy-rocm-build#6630" in fault.detail
    assert fault.data["version"] == "7.14.0-123"
    hang = check_rocm(rocm_host(tmp_path / "b", "7.2.4"), "amd", "gfx1201", 2, "")
    assert hang.status == WARN and hang.fix == "set NCCL_PROTO=Simple in the platform layer"
    ok = check_rocm(rocm_host(tmp_path / "c", "7.2.4"), "amd", "gfx1201", 2, "Simple")
    assert ok.status == PASS and "NCCL_PROTO=Simple" in ok.detail
    assert check_rocm(rocm_host(tmp_path / "d", "7.2.4"), "amd", "gfx1151", 1, "").status == PASS
    assert check_rocm(rocm_host(tmp_path / "e", None), "amd", "gfx1201", 2, "").status == SKIP
    assert check_rocm(rocm_host(tmp_path / "f", "7.2.4"), "nvidia", "", 1, "").status == SKIP


# --- `up` runs the image rules too, before any engine command -----------------------------------

class NoDevicesMissing:
    """A GPU probe of a host with the platform's devices (the guards pass; the labels decide)."""

    def missing_devices(self) -> list[str]:
        return []

    def memory(self) -> None:
        return None


def label_runner(labels: dict[str, str], client: str = "docker") -> RecordingRunner:
    runner = RecordingRunner()
    runner.respond([client, "image", "inspect", "--format", "{{json .Config.Labels}}"],
                   Result((), 0, json.dumps(labels)))
    return runner


def test_up_refuses_an_image_without_the_cards_arch_before_any_engine_command(
        project: Project) -> None:
    resolved = resolve(project, model="qwen3.8-27b", platform="2xr9700",
                       overrides=["OTHER_ENGINE_PORTS=", f"HOST_CACHE_DIR={project.root}/cache"])
    runner = label_runner({PIN_LABEL + "gpu_arch": "gfx1100"})
    stack = lifecycle.open_stack(project, resolved, {}, runner, runtime="compose",
                                 out=io.StringIO(), probe=NoDevicesMissing())
    with pytest.raises(lifecycle.LifecycleError) as refused:
        lifecycle.up(stack, dashboard=False, timeout=1)
    assert "nothing was started" in refused.value.cause
    [detail] = refused.value.details
    assert "image-lacks-arch" in detail and "built for gfx1100, not gfx1201" in detail
    assert "ROCm/aiter#5229" in detail
    # Only the compose probe and the label read ran: no prepare, no `compose run`, no `up`.
    assert runner.calls == [("docker", "compose", "version"),
                            ("docker", "image", "inspect", "--format", "{{json .Config.Labels}}",
                             resolved.get_str("VLLM_IMAGE"))]


def test_check_refuses_the_same_image_through_the_same_rules(project: Project) -> None:
    resolved = resolve(project, model="qwen3.8-27b", platform="2xr9700")
    findings = check_profile(project, resolved, {}, label_runner({PIN_LABEL + "gpu_arch": "gfx1100"}))
    assert "image-lacks-arch" in codes(findings)
    built = check_profile(project, resolved, {}, label_runner({PIN_LABEL + "gpu_arch": "gfx1201"}))
    assert "image-lacks-arch" not in codes(built)


def test_up_passes_an_image_built_for_the_card_and_reads_podmans_own_store(
        project: Project) -> None:
    resolved = resolve(project, model="qwen3.8-27b", platform="2xr9700")
    runner = label_runner({PIN_LABEL + "gpu_arch": "gfx1201"}, client="podman")
    command, findings = lifecycle.preflight(project, resolved, {}, "compose", runner,
                                            flavour="podman")
    assert command.argv and "image-lacks-arch" not in codes(findings)
    assert ("podman", "image", "inspect", "--format", "{{json .Config.Labels}}",
            resolved.get_str("VLLM_IMAGE")) in runner.calls
    # Natively no image runs: its labels are not read, so they cannot refuse.
    native = label_runner({PIN_LABEL + "gpu_arch": "gfx1100"})
    try:
        lifecycle.preflight(project, resolved, {}, "native", native)
    except lifecycle.LifecycleError as exc:
        assert not any("image-lacks-arch" in d for d in exc.details)
    assert not [c for c in native.calls if c[1:3] == ("image", "inspect")]


def test_up_applies_the_image_rccl_rule_as_check_does(monkeypatch: pytest.MonkeyPatch,
                                                       project: Project) -> None:
    monkeypatch.setattr(rdna4, "FIRST_FIXED_RCCL", (11, 0))
    resolved = resolve(project, model="qwen3.8-27b", platform="2xr9700", overrides=["NCCL_PROTO="])
    arch = {PIN_LABEL + "gpu_arch": "gfx1201"}
    _, findings = lifecycle.preflight(project, resolved, {}, "compose",
                                      label_runner({**arch, ROCM_RELEASE_LABEL: "11.0"}))
    assert "rccl-ll-deadlock" not in codes(findings)
    with pytest.raises(lifecycle.LifecycleError) as refused:
        lifecycle.preflight(project, resolved, {}, "compose",
                            label_runner({**arch, ROCM_RELEASE_LABEL: "10.1"}))
    assert any("rccl-ll-deadlock" in d for d in refused.value.details)
