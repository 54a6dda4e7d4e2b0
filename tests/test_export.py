"""`invoke export`: every shipped profile to production-stack values, Kubernetes manifests and a
Quadlet unit, each validated offline and carrying the profile's own argv flag for flag.

The argv a target will run is rebuilt from what was written (the values through the chart's
template logic, the Deployment's command + args, the unit's Exec=) and compared with the argv
`invoke config --vllm-args --json` prints for the same profile.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, copy_project

from vllmstack.config import view
from vllmstack.config.engines.table import engine_kind
from vllmstack.config.profiles import list_profiles, resolve
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner
from vllmstack.export import chart, service, validate
from vllmstack.export.spec import ExportError

# GGUF profiles name a file under MODELS_DIR; a cluster export mounts a volume there.
MODELS = "MODELS_DIR=/srv/models"
ENV = {"HOME": "/home/op", "PATH": os.environ.get("PATH", "")}


def shipped_pairs() -> list[tuple[str, str]]:
    """(platform, model profile) for every platform each model profile is made for."""
    return [(platform, info.name) for info in list_profiles(Project(ROOT))
            if info.kind == "model" for platform in info.platforms]


PAIRS = shipped_pairs()


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Project:
    return Project(copy_project(tmp_path_factory.mktemp("export")))


def plan(project: Project, target: str, models: list[str], platform: str, *sets: str) -> service.Plan:
    return service.plan_export(project, target, models, platform, [MODELS, *sets], ENV,
                               RecordingRunner())


def config_argv(project: Project, platform: str, model: str, *sets: str) -> list[str]:
    """What `invoke config --vllm-args --json` prints (secrets masked)."""
    resolved = resolve(project, platform=platform, model=model, overrides=[MODELS, *sets],
                       environ=ENV)
    argv: list[str] = json.loads(view.render_config(resolved, vllm_args=True, as_json=True))
    return argv


def expected_gpus(project: Project, platform: str, model: str) -> int:
    resolved = resolve(project, platform=platform, model=model, overrides=[MODELS], environ=ENV)
    if resolved.get_str("GPU_VENDOR") == "none":
        return 0
    if engine_kind(resolved).model_file:
        return resolved.get_int("GPU_COUNT")
    return resolved.get_int("VLLM_TP")  # no shipped profile sets a pipeline-parallel size


def errors(p: service.Plan) -> list[str]:
    return [f.render() for f in p.findings if f.severity == "error"]


def k8s_word(word: str) -> str:
    """A command word as the kubelet expands it, with each $(VAR) of a secret shown as ***."""
    return re.sub(r"\$\(([A-Z0-9_]+)\)", "***", word).replace("$$", "$")


def unit_exec(text: str) -> list[str]:
    """The words of a unit's Exec= as Quadlet splits them and systemd then expands them (a
    secret's ${VAR} shown as ***)."""
    line = next(v for k, v in validate.parse_unit(text)["Container"] if k == "Exec")
    words = shlex.split(line)
    return [re.sub(r"\$\{[A-Z0-9_]+\}", "***", w).replace("$$", "$").replace("%%", "%")
            for w in words]


# --- every shipped profile, one test per target ------------------------------------------

@pytest.mark.parametrize(("platform", "model"), PAIRS)
def test_every_profile_exports_to_production_stack(project: Project, platform: str, model: str) -> None:
    p = plan(project, service.PRODUCTION_STACK, [model], platform)
    if engine_kind(p.specs[0].resolved).model_file:
        # The chart runs `vllm serve` only: refused, with the way out.
        assert [f.code for f in p.findings if f.severity == "error"] == ["export-chart-vllm-only"]
        return
    assert errors(p) == []
    assert any(validate.OWN_SCHEMA in how for how in p.validated)
    values = yaml.safe_load(p.files["values.yaml"])
    assert validate.validate_values(values) == []
    (entry,) = values["servingEngineSpec"]["modelSpec"]
    argv = chart.chart_argv(values, entry)
    assert chart.options([k8s_word(w) for w in argv]) == chart.options(config_argv(project, platform, model))
    gpus = expected_gpus(project, platform, model)
    assert entry.get("requestGPU", 0) == gpus
    if gpus:
        vendor = p.specs[0].vendor
        assert entry["requestGPUType"] == {"amd": "amd.com/gpu", "nvidia": "nvidia.com/gpu"}[vendor]


@pytest.mark.parametrize(("platform", "model"), PAIRS)
def test_every_profile_exports_to_kubernetes(project: Project, platform: str, model: str) -> None:
    p = plan(project, service.KUBE, [model], platform)
    assert errors(p) == []
    assert any("kubernetes-validate --strict" in how for how in p.validated)
    documents = list(yaml.safe_load_all(p.files[f"{model}.yaml"]))
    assert validate.validate_manifests(documents) == []
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    argv = [k8s_word(w) for w in container["command"] + container["args"]]
    assert argv == config_argv(project, platform, model)
    gpus = expected_gpus(project, platform, model)
    limits = container["resources"].get("limits", {})
    assert sum(limits.values()) == gpus
    if gpus:
        assert list(limits) == [{"amd": "amd.com/gpu", "nvidia": "nvidia.com/gpu"}[p.specs[0].vendor]]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/cache/huggingface", "/dev/shm"} <= mounts
    assert container["startupProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize(("platform", "model"), PAIRS)
def test_every_profile_exports_to_quadlet(project: Project, platform: str, model: str) -> None:
    p = plan(project, service.QUADLET, [model], platform)
    assert errors(p) == []
    (name,) = p.files
    text = p.files[name]
    assert validate.validate_unit(text) == []
    spec = p.specs[0]
    assert unit_exec(text) == config_argv(project, platform, model)[len(spec.entrypoint):]
    container = dict(validate.parse_unit(text)["Container"])
    assert container["Image"] == spec.image
    devices = [v for k, v in validate.parse_unit(text)["Container"] if k == "AddDevice"]
    assert devices == {"amd": ["/dev/kfd", "/dev/dri"], "nvidia": ["nvidia.com/gpu=all"],
                       "none": []}[spec.vendor]


# --- the seed's main profile: what "done" means ---------------------------------------------

SEED = ("2xr9700", "qwen3.8-27b")


def test_seed_profile_values_validate_request_two_amd_gpus_and_carry_every_flag(
        project: Project, tmp_path: Path) -> None:
    done = service.export(project, plan(project, service.PRODUCTION_STACK, [SEED[1]], SEED[0]),
                          tmp_path)
    values = yaml.safe_load((tmp_path / "values.yaml").read_text())
    assert validate.validate_values(values) == []
    (entry,) = values["servingEngineSpec"]["modelSpec"]
    assert (entry["requestGPU"], entry["requestGPUType"]) == (2, "amd.com/gpu")
    assert entry["vllmConfig"]["tensorParallelSize"] == 2
    rendered = chart.chart_argv(values, entry)
    profile = config_argv(project, *SEED)
    flags = {w for w in profile if w.startswith("--")}
    # The chart writes --gpu_memory_utilization, which vLLM's parser reads as the dashed flag.
    assert flags <= {w.replace("_", "-") if w.startswith("--") else w for w in rendered}
    assert chart.options(rendered) == chart.options(profile)
    assert done.written == [tmp_path / "values.yaml"]


def test_seed_profile_manifests_pass_kubernetes_validate_strict(project: Project, tmp_path: Path) -> None:
    import subprocess
    import sys

    service.export(project, plan(project, service.KUBE, [SEED[1]], SEED[0]), tmp_path)
    path = tmp_path / f"{SEED[1]}.yaml"
    # The command-line tool itself, on the written file (the bundled schemas: no network).
    tool = Path(sys.executable).with_name("kubernetes-validate")
    result = subprocess.run([str(tool), "--strict", "-k", validate.KUBERNETES_VERSION, str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    documents = list(yaml.safe_load_all(path.read_text()))
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"] == {"amd.com/gpu": 2}
    assert container["command"] + container["args"] == config_argv(project, *SEED)


def test_seed_profile_unit_has_image_argv_and_amd_devices(project: Project, tmp_path: Path) -> None:
    service.export(project, plan(project, service.QUADLET, [SEED[1]], SEED[0]), tmp_path)
    text = (tmp_path / "vllmstack-qwen3.8-27b.container").read_text()
    container = validate.parse_unit(text)["Container"]
    assert ("Image", "localhost/vllm-fullbuild:latest") in container
    assert unit_exec(text) == config_argv(project, *SEED)[2:]
    assert [v for k, v in container if k == "AddDevice"] == ["/dev/kfd", "/dev/dri"]
    podman = " ".join(v for k, v in container if k == "PodmanArgs")
    assert "--group-add" in podman and "--shm-size 20g" in podman and "--health-cmd" in podman


# --- secrets, several profiles, several nodes -------------------------------------------------

SECRETS = ("HF_TOKEN=hf_do_not_leak", "VLLM_EXTRA_ARGS=--api-key sk-do-not-leak")


# The cluster targets (kserve, llm-d, lws) are checked in test_export_cluster.py.
@pytest.mark.parametrize("target", (service.PRODUCTION_STACK, service.KUBE, service.QUADLET))
def test_secrets_are_references_never_values(project: Project, target: str, tmp_path: Path) -> None:
    p = plan(project, target, [SEED[1]], SEED[0], *SECRETS)
    done = service.export(project, p, tmp_path)
    text = "".join(path.read_text() for path in done.written)
    assert "hf_do_not_leak" not in text and "sk-do-not-leak" not in text
    assert "HF_TOKEN" in text and "VLLMSTACK_SECRET_API_KEY" in text
    if target == service.KUBE:
        (deployment,) = [d for d in yaml.safe_load_all(text) if d["kind"] == "Deployment"]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
        assert refs == {"HF_TOKEN": {"name": "vllmstack-secrets", "key": "HF_TOKEN"},
                        "VLLMSTACK_SECRET_API_KEY": {"name": "vllmstack-secrets",
                                                     "key": "VLLMSTACK_SECRET_API_KEY"}}
        assert container["args"][-2:] == ["--api-key", "$(VLLMSTACK_SECRET_API_KEY)"]
    if target == service.QUADLET:
        assert "--secret vllmstack-secrets-HF_TOKEN,type=env,target=HF_TOKEN" in text
        assert unit_exec(text)[-2:] == ["--api-key", "***"]


def test_several_profiles_make_one_values_file_with_one_model_spec_each(project: Project) -> None:
    p = plan(project, service.PRODUCTION_STACK, ["qwen3.8-27b", "qwen3-0.6b"], "2xr9700")
    assert errors(p) == []
    values = yaml.safe_load(p.files["values.yaml"])
    names = [m["name"] for m in values["servingEngineSpec"]["modelSpec"]]
    assert names == ["qwen3-8-27b", "qwen3-0-6b"]
    assert [m["requestGPU"] for m in values["servingEngineSpec"]["modelSpec"]] == [2, 1]
    kube = plan(project, service.KUBE, ["qwen3.8-27b", "qwen3-0.6b"], "2xr9700")
    assert sorted(kube.files) == ["qwen3-0.6b.yaml", "qwen3.8-27b.yaml"]


def test_more_gpus_than_one_box_has_becomes_the_charts_ray_spec(project: Project) -> None:
    """The seed's 2xr9700 profile on two such boxes: TP 2 inside a box, PP 2 across them."""
    p = plan(project, service.PRODUCTION_STACK, [SEED[1]], SEED[0],
             "VLLM_EXTRA_ARGS=--pipeline-parallel-size 2")
    assert errors(p) == []
    (entry,) = yaml.safe_load(p.files["values.yaml"])["servingEngineSpec"]["modelSpec"]
    assert entry["raySpec"] == {"enabled": True, "headNode": {
        "requestCPU": 8, "requestMemory": "32Gi", "requestGPU": 2}}
    assert (entry["replicaCount"], entry["requestGPU"]) == (1, 2)  # one worker box of 2 GPUs
    assert "export-ray-needs-ray" in {f.code for f in p.findings}
    for target in (service.KUBE, service.QUADLET):
        other = plan(project, target, [SEED[1]], SEED[0], "VLLM_TP=4")
        assert "export-multi-node" in {f.code for f in other.findings if f.severity == "error"}


# --- what does not translate -------------------------------------------------------------------

def test_host_paths_and_gpu_selection_stay_on_the_host(project: Project) -> None:
    sets = ("ENGINE_ENV=TRITON_CACHE_DIR=/home/op/triton VLLM_LOGGING_LEVEL=DEBUG",)
    p = plan(project, service.KUBE, [SEED[1]], SEED[0], *sets)
    env = {e["name"]: e.get("value") for e in next(
        d for d in yaml.safe_load_all(p.files[f"{SEED[1]}.yaml"]) if d["kind"] == "Deployment"
    )["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TRITON_CACHE_DIR"] == "/cache/engine/triton"  # compose's, not the host's
    assert env["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert "HIP_VISIBLE_DEVICES" not in env
    codes = {f.code: f for f in p.findings}
    assert codes["export-host-path"].key == "TRITON_CACHE_DIR"
    assert codes["export-image-local"].fix and "--set VLLM_IMAGE=" in codes["export-image-local"].fix
    unit = plan(project, service.QUADLET, [SEED[1]], SEED[0], *sets).files["vllmstack-qwen3.8-27b.container"]
    assert "Environment=TRITON_CACHE_DIR=/home/op/triton" in unit  # the same host: as compose


def test_a_gguf_under_models_dir_is_read_from_a_volume_mounted_at_the_same_path(project: Project) -> None:
    p = plan(project, service.KUBE, ["qwen3-0.6b-gguf"], "r9700", "MODELS_DIR=~/models")
    documents = list(yaml.safe_load_all(p.files["qwen3-0.6b-gguf.yaml"]))
    pod = next(d for d in documents if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    models = str(Path("~/models").expanduser())  # as the argv builder expands it
    assert f"{models}/Qwen3-0.6B-Q8_0.gguf" in container["args"]
    assert {"name": "models", "mountPath": models, "readOnly": True} in container["volumeMounts"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "vllmstack-models",
                                                        "readOnly": True}} in pod["volumes"]
    assert "export-models-dir" in {f.code for f in p.findings}


def test_a_bad_value_stops_the_export_and_writes_nothing(project: Project, tmp_path: Path) -> None:
    p = plan(project, service.QUADLET, [SEED[1]], SEED[0], "EXPORT_SHM_SIZE=lots")
    with pytest.raises(ExportError) as caught:
        service.export(project, p, tmp_path)
    assert "EXPORT_SHM_SIZE" in caught.value.render()
    assert list(tmp_path.iterdir()) == []


def test_a_file_export_did_not_write_is_never_overwritten(project: Project, tmp_path: Path) -> None:
    (tmp_path / "values.yaml").write_text("mine: true\n")
    with pytest.raises(ExportError, match="not written by `invoke export`"):
        service.export(project, plan(project, service.PRODUCTION_STACK, [SEED[1]], SEED[0]), tmp_path)
    assert (tmp_path / "values.yaml").read_text() == "mine: true\n"
    (tmp_path / "values.yaml").unlink()
    service.export(project, plan(project, service.PRODUCTION_STACK, [SEED[1]], SEED[0]), tmp_path)
    service.export(project, plan(project, service.PRODUCTION_STACK, [SEED[1]], SEED[0]), tmp_path)


def test_an_inspected_image_carries_its_labels_overlays_and_tuned_configs(
        project: Project, tmp_path: Path) -> None:
    from vllmstack.core.runner import Result

    runner = RecordingRunner()
    labels = {"vllmstack.vllm-package": "/opt/vllm-package", "vllmstack.pin.vllm_ref": "v0.31.0"}
    runner.respond(["docker", "image", "inspect"], Result((), 0, json.dumps(labels)))
    p = service.plan_export(project, service.KUBE, [SEED[1]], SEED[0], [MODELS], ENV, runner)
    documents = list(yaml.safe_load_all(p.files[f"{SEED[1]}.yaml"]))
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    assert deployment["spec"]["template"]["metadata"]["annotations"]["vllmstack/pin.vllm_ref"] == "v0.31.0"
    mounts = {m["mountPath"] for m in deployment["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert "/opt/vllm-package/entrypoints/openai/chat_completion/protocol.py" in mounts
    config_map = next(d for d in documents if d["kind"] == "ConfigMap")
    overlay = (project.root / "patches/vllm/overlays/chat_completion/protocol.py").read_text()
    assert overlay in config_map["data"].values()
    assert validate.validate_manifests(documents) == []


def test_quadlet_validation_refuses_keys_podman_44_does_not_know() -> None:
    unit = "[Container]\nImage=x\nGroupAdd=video\nShmSize=1g\n"
    assert validate.validate_unit(unit) == [
        "[Container] GroupAdd= is not a key of Podman 4.4's Quadlet",
        "[Container] ShmSize= is not a key of Podman 4.4's Quadlet"]


def test_values_validation_refuses_a_wrong_type_and_a_key_the_chart_would_ignore(project: Project) -> None:
    values = yaml.safe_load(plan(project, service.PRODUCTION_STACK, [SEED[1]], SEED[0]).files["values.yaml"])
    (entry,) = values["servingEngineSpec"]["modelSpec"]
    assert validate.validate_values(values) == []
    entry["requestGPU"] = [2]
    entry["vllmConfig"]["maxModelLenn"] = 4  # misspelt: the chart would drop it without a word
    entry["vllmConfig"]["v1"] = "1"          # only the RayCluster reads it
    problems = validate.validate_values(values)
    shown = validate.OWN_SCHEMA_SHOWN
    assert any(p.startswith("servingEngineSpec.modelSpec.0.requestGPU: [2] is not of type 'integer'")
               and p.endswith(f"(per {shown})") for p in problems)
    assert any(p.startswith("servingEngineSpec.modelSpec.0.vllmConfig: Additional properties are not "
                            "allowed ('maxModelLenn' was unexpected)") for p in problems)
    assert (f"servingEngineSpec.modelSpec.0.vllmConfig: this object should not be valid under "
            f"{{'required': ['v1']}} (per {shown})") in problems
    assert len(problems) == 3


def test_the_own_schema_names_its_chart_and_agrees_with_the_chart_model() -> None:
    schema = validate.own_schema()
    assert validate.CHART_VERSION in schema["$comment"] and validate.CHART_COMMIT in schema["$comment"]
    fields = schema["$defs"]["vllmConfig"]["properties"]
    for field in chart.FIELDS:  # every field chart.py lifts out of the argv is declared, typed alike
        declared = fields[field.field]
        kind = declared.get("type") or schema["$defs"][declared["$ref"].rsplit("/", 1)[1]]["type"]
        assert kind == {int: "integer", str: "string"}[field.kind], field.field


def stand_in_chart(gpu_type: str = "string") -> str:
    """A chart's values.schema.json that wants requestGPU as `gpu_type` and knows no shmSize."""
    return json.dumps({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {"servingEngineSpec": {"type": "object", "properties": {"modelSpec": {
            "type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "requestGPU": {"type": gpu_type}}}}}}},
    })


def test_a_chart_schema_the_user_names_is_applied_too(project: Project, tmp_path: Path) -> None:
    file = tmp_path / "vllm-stack" / "values.schema.json"
    file.parent.mkdir()
    file.write_text(stand_in_chart())
    for given in (file, file.parent):  # the file, or the folder `helm pull --untar` made
        p = service.plan_export(project, service.PRODUCTION_STACK, [SEED[1]], SEED[0], [MODELS], ENV,
                                RecordingRunner(), chart_schema=given)
        (refused,) = [f for f in p.findings if f.severity == "error"]
        assert refused.code == "export-chart-schema"
        assert refused.message == (f"servingEngineSpec.modelSpec.0.requestGPU: 2 is not of type "
                                   f"'string' (per {file})")
        assert refused.fix and f"--version {validate.CHART_VERSION}" in refused.fix
        undeclared = {f.message.split(":")[0] for f in p.findings if f.code == "export-chart-undeclared"}
        assert "servingEngineSpec.modelSpec.0.shmSize" in undeclared
        assert any(str(file) in how for how in p.validated)
        with pytest.raises(ExportError):
            service.export(project, p, tmp_path / "out")
        assert not (tmp_path / "out").exists()
    # The same chart with requestGPU as a number: the export goes through, the notes stay.
    file.write_text(stand_in_chart("integer"))
    p = service.plan_export(project, service.PRODUCTION_STACK, [SEED[1]], SEED[0], [MODELS], ENV,
                            RecordingRunner(), chart_schema=file)
    assert errors(p) == []
    assert "export-chart-undeclared" in {f.code for f in p.findings}


def test_a_chart_schema_that_cannot_be_used_stops_with_the_file_and_line(project: Project,
                                                                          tmp_path: Path) -> None:
    def refusal(path: Path, target: str = service.PRODUCTION_STACK) -> str:
        with pytest.raises(ExportError) as caught:
            service.plan_export(project, target, [SEED[1]], SEED[0], [MODELS], ENV, RecordingRunner(),
                                chart_schema=path)
        return caught.value.render()

    broken = tmp_path / "values.schema.json"
    broken.write_text('{\n  "type": "object",\n  "properties": {,}\n}\n')
    assert f"error: {broken}:3: not JSON" in refusal(broken)
    broken.write_text('{"type": 12}')
    assert f"error: {broken}: not a JSON schema" in refusal(broken)
    assert "cannot be read" in refusal(tmp_path / "absent.json")
    assert "helm pull vllm/vllm-stack" in refusal(tmp_path / "absent.json")
    assert "--to kube writes no chart values" in refusal(broken, service.KUBE)


def test_the_task_writes_and_reports_and_refuses_with_error_and_fix(project: Project, tmp_path: Path) -> None:
    import subprocess

    def invoke(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["invoke", "export", *args], cwd=project.root, capture_output=True,
                              text=True, timeout=300)

    done = invoke("--to", "kube", "--platform", "2xr9700", "--model", "qwen3.8-27b", "--out",
                  str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["files"] == [str(tmp_path / "qwen3.8-27b.yaml")]
    assert "export-image-local" in {f["code"] for f in report["findings"]}
    refused = invoke("--to", "production-stack", "--platform", "r9700", "--model", "qwen3-0.6b-gguf",
                     "--set", MODELS, "--out", str(tmp_path / "chart"))
    assert refused.returncode == 1
    assert "export-chart-vllm-only" in refused.stderr and "fix:" in refused.stderr
    assert not (tmp_path / "chart").exists()
    stand_in = tmp_path / "values.schema.json"
    stand_in.write_text(stand_in_chart())
    checked = invoke("--to", "production-stack", "--platform", "2xr9700", "--model", "qwen3.8-27b",
                     "--chart-schema", str(stand_in), "--out", str(tmp_path / "chart"))
    assert checked.returncode == 1
    assert (f"servingEngineSpec.modelSpec.0.requestGPU: 2 is not of type 'string' (per {stand_in})"
            in checked.stderr)
    assert not (tmp_path / "chart").exists()
