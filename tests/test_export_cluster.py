"""`invoke export --to kserve | llm-d | lws`: every shipped profile each target applies to exports,
validates offline and carries the profile's own argv flag for flag; a broken document is refused
naming the field; the user's own CRD (--crd) and chart schema (--chart-schema) are applied.

The argv a target will run is read back from what was written (the LLMInferenceService's `main`
container, the chart's custom command + args, the LeaderWorkerSet's leader and worker) and
compared with `invoke config --vllm-args --json` for the same profile.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_export import ENV, MODELS, PAIRS, config_argv, errors, k8s_word

from vllmstack.config.engines.table import engine_kind
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner
from vllmstack.export import crds, multinode, runline, service
from vllmstack.export.spec import ExportError

PP2 = "VLLM_EXTRA_ARGS=--pipeline-parallel-size 2"
SEED = ("2xr9700", "qwen3.8-27b")


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Project:
    from helpers import copy_project
    return Project(copy_project(tmp_path_factory.mktemp("export-cluster")))


def plan(project: Project, target: str, model: str, platform: str, *sets: str,
         **schemas: Path) -> service.Plan:
    return service.plan_export(project, target, [model], platform, [MODELS, *sets], ENV,
                               RecordingRunner(), **schemas)


def documents(p: service.Plan, name: str) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all(p.files[name]))


def of_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def argv_of(container: dict[str, Any]) -> list[str]:
    return [k8s_word(w) for w in container["command"] + container["args"]]


def gpu_limit(container: dict[str, Any]) -> int:
    return sum(int(v) for v in container["resources"].get("limits", {}).values())


def is_vllm(project: Project, platform: str, model: str) -> bool:
    from vllmstack.config.profiles import resolve
    return engine_kind(resolve(project, platform=platform, model=model, overrides=[MODELS],
                               environ=ENV)).vllm_cli


# --- every shipped profile, per target ---------------------------------------------------------

@pytest.mark.parametrize(("platform", "model"), PAIRS)
def test_every_profile_exports_to_kserve(project: Project, platform: str, model: str) -> None:
    p = plan(project, service.KSERVE, model, platform)
    if not is_vllm(project, platform, model):
        assert [f.code for f in p.findings if f.severity == "error"] == ["export-kserve-vllm-only"]
        return
    assert errors(p) == []
    assert len(p.validated) == 3 and any(crds.KSERVE_SCHEMA in how for how in p.validated)
    docs = documents(p, f"{model}.yaml")
    isvc = of_kind(docs, "LLMInferenceService")
    assert crds.validate_own(isvc, crds.KSERVE_SCHEMA) == []
    (container,) = isvc["spec"]["template"]["containers"]
    assert container["name"] == "main"  # merged with KServe's well-known config by this name
    assert argv_of(container) == config_argv(project, platform, model)
    assert container["image"] == p.specs[0].image
    assert isvc["spec"]["model"] == {"uri": f"hf://{p.specs[0].model}", "name": p.specs[0].served_name}
    assert gpu_limit(container) == p.specs[0].gpus
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HF_HUB_CACHE"] == "/cache/huggingface/hub"  # not KServe's /models emptyDir
    assert isvc["metadata"]["annotations"]["vllmstack/argv"] == json.dumps(p.specs[0].argv)
    # KServe's InferencePool selects its pods by app.kubernetes.io/name; spec.labels would win.
    assert not any(k.startswith("app.kubernetes.io/") for k in isvc["spec"]["labels"])


@pytest.mark.parametrize(("platform", "model"), PAIRS)
def test_every_profile_exports_to_llm_d(project: Project, platform: str, model: str) -> None:
    p = plan(project, service.LLM_D, model, platform)
    if not is_vllm(project, platform, model):
        assert [f.code for f in p.findings if f.severity == "error"] == ["export-llm-d-vllm-only"]
        return
    assert errors(p) == []
    values = yaml.safe_load(p.files[f"{model}.values.yaml"])
    assert crds.validate_own(values, crds.LLMD_SCHEMA) == []
    (container,) = values["decode"]["containers"]
    # modelCommand custom: the chart writes command and args verbatim (customModelCommand).
    assert container["modelCommand"] == "custom" and container["mountModelVolume"] is False
    assert argv_of(container) == config_argv(project, platform, model)
    # With the routing sidecar off, the chart's vllmPort helper is routing.servicePort.
    assert values["routing"] == {"servicePort": p.specs[0].port, "proxy": {"enabled": False}}
    assert f"--port={p.specs[0].port}" in " ".join(argv_of(container)).replace("--port ", "--port=")
    assert gpu_limit(container) == p.specs[0].gpus
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    pre = documents(p, f"{model}.yaml")
    assert "PersistentVolumeClaim" in {d["kind"] for d in pre}
    # Without Kubernetes: the router's endpoints file and config, the engine's podman run line.
    endpoints = yaml.safe_load(p.files[f"{model}.endpoints.yaml"])
    assert crds.validate_own(endpoints, crds.LLMD_ENDPOINTS_SCHEMA) == []
    assert endpoints["endpoints"] == [{"name": p.specs[0].profile.replace(".", "-"),
                                       "address": "127.0.0.1", "port": str(p.specs[0].port),
                                       "labels": {"llm-d.ai/model": p.specs[0].served_name,
                                                  "vllmstack/profile": model}}]
    config = yaml.safe_load(p.files[f"{model}.epp-config.yaml"])
    (discovery,) = [x for x in config["plugins"] if x["type"] == "file-discovery"]
    assert discovery["parameters"]["path"] == f"/etc/epp/{model}.endpoints.yaml"
    assert config["dataLayer"]["discovery"]["pluginRef"] == discovery["name"]
    command = runline.command_of(p.files[f"{model}.run.sh"], p.specs[0].image)
    assert command == config_argv(project, platform, model)[len(p.specs[0].entrypoint):]


@pytest.mark.parametrize(("platform", "model"), PAIRS)
def test_every_profile_over_two_nodes_exports_to_lws(project: Project, platform: str, model: str) -> None:
    """No shipped profile spans nodes as shipped; each gets pipeline parallel 2 here, which
    makes it multi-node where TP already fills a box, and refused (single node) where not."""
    p = plan(project, service.LWS, model, platform, PP2)
    spec = p.specs[0]
    if not is_vllm(project, platform, model):
        assert [f.code for f in p.findings if f.severity == "error"] == ["export-multi-node-vllm-only"]
        return
    if not (spec.gpus > spec.node_gpus > 0):
        (refused,) = [f for f in p.findings if f.severity == "error"]
        assert refused.code == "export-single-node" and refused.fix and "--to kube" in refused.fix
        assert p.files == {}
        return
    assert errors(p) == []
    docs = documents(p, f"{model}.yaml")
    lws = of_kind(docs, "LeaderWorkerSet")
    assert crds.validate_own(lws, crds.LWS_SCHEMA) == []
    template = lws["spec"]["leaderWorkerTemplate"]
    nodes = spec.gpus // spec.node_gpus
    assert template["size"] == nodes
    (leader,) = template["leaderTemplate"]["spec"]["containers"]
    (worker,) = template["workerTemplate"]["spec"]["containers"]
    profile = config_argv(project, platform, model, PP2)
    assert multinode.strip_node_flags(argv_of(leader)) == profile
    assert multinode.strip_node_flags(argv_of(worker)) == profile
    assert leader["args"][len(profile) - 2:] == [
        "--nnodes", str(nodes), "--node-rank", "0", "--master-addr", "$(LWS_LEADER_ADDRESS)",
        "--master-port", "29500"]
    assert worker["args"][-8:] == [
        "--nnodes", str(nodes), "--node-rank", "$(LWS_WORKER_INDEX)", "--master-addr",
        "$(LWS_LEADER_ADDRESS)", "--master-port", "29500", "--headless"][-8:]
    assert worker["args"][-1] == "--headless" and "--headless" not in leader["args"]
    assert gpu_limit(leader) == gpu_limit(worker) == spec.node_gpus
    assert leader["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "readinessProbe" not in worker  # a headless worker serves no HTTP
    service_doc = of_kind(docs, "Service")
    assert service_doc["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert [c["metadata"]["name"] for c in template["volumeClaimTemplates"]] == ["hf-cache"]


# --- the seed profile on two boxes: KServe's multi-node form ------------------------------------

def test_the_seed_profile_over_two_boxes_is_a_kserve_leader_and_worker(project: Project) -> None:
    p = plan(project, service.KSERVE, SEED[1], SEED[0], PP2)
    assert errors(p) == []
    isvc = of_kind(documents(p, f"{SEED[1]}.yaml"), "LLMInferenceService")
    assert isvc["spec"]["parallelism"] == {"tensor": 2, "pipeline": 2}
    (leader,) = isvc["spec"]["template"]["containers"]
    (worker,) = isvc["spec"]["worker"]["containers"]
    profile = config_argv(project, *SEED, PP2)
    assert multinode.strip_node_flags(argv_of(leader)) == profile
    assert multinode.strip_node_flags(argv_of(worker)) == profile
    assert argv_of(worker)[-1] == "--headless"
    assert gpu_limit(leader) == gpu_limit(worker) == 2
    assert "PersistentVolumeClaim" not in {d["kind"] for d in documents(p, f"{SEED[1]}.yaml")}
    plain = plan(project, service.LWS, SEED[1], SEED[0], "VLLM_EXTRA_ARGS=--data-parallel-size 2")
    assert "export-multi-node-dp" in {f.code for f in plain.findings if f.severity == "error"}


def test_secrets_stay_references_in_every_cluster_target(project: Project, tmp_path: Path) -> None:
    sets = ("HF_TOKEN=hf_do_not_leak", "VLLM_EXTRA_ARGS=--api-key sk-do-not-leak --pipeline-parallel-size 2")
    one_box = ("HF_TOKEN=hf_do_not_leak", "VLLM_EXTRA_ARGS=--api-key sk-do-not-leak")
    for target in (service.KSERVE, service.LLM_D, service.LWS):
        # llm-d's export is one node's pods; the others get the two-box layout.
        p = plan(project, target, SEED[1], SEED[0], *(one_box if target == service.LLM_D else sets))
        done = service.export(project, p, tmp_path / target)
        text = "".join(path.read_text() for path in done.written)
        assert "hf_do_not_leak" not in text and "sk-do-not-leak" not in text, target
        assert "$(VLLMSTACK_SECRET_API_KEY)" in text and "secretKeyRef" in text, target


# --- a broken document is refused naming the field ----------------------------------------------

def test_a_broken_resource_is_refused_naming_the_field(project: Project) -> None:
    isvc = of_kind(documents(plan(project, service.KSERVE, SEED[1], SEED[0]), f"{SEED[1]}.yaml"),
                   "LLMInferenceService")
    broken = copy.deepcopy(isvc)
    broken["spec"]["replicas"] = "one"
    broken["spec"]["paralelism"] = {"tensor": 2}  # misspelt: the API server would prune it
    broken["spec"]["model"]["uri"] = "Qwen/Qwen3.8-27B-FP8"  # not a storage URI
    problems = crds.validate_own(broken, crds.KSERVE_SCHEMA)
    shown = crds.shown(crds.KSERVE_SCHEMA)
    assert any(p.startswith("spec.replicas: 'one' is not of type 'integer'") for p in problems)
    assert any(p.startswith("spec: Additional properties are not allowed ('paralelism' was unexpected)")
               for p in problems)
    assert any(p.startswith("spec.model.uri: ") and p.endswith(f"(per {shown})") for p in problems)
    broken = copy.deepcopy(isvc)
    broken["spec"]["template"]["containers"][0]["imagee"] = "x"
    (problem,) = crds.validate_pods(broken, service.POD_PATHS[service.KSERVE])
    assert problem.startswith("spec.template (a PodSpec): ") and "imagee" in problem
    lws = of_kind(documents(plan(project, service.LWS, SEED[1], SEED[0], PP2), f"{SEED[1]}.yaml"),
                  "LeaderWorkerSet")
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    lws["spec"]["leaderWorkerTemplate"]["size"] = 0
    problems = crds.validate_own(lws, crds.LWS_SCHEMA)
    assert any(p.startswith("spec.leaderWorkerTemplate.restartPolicy: 'Always' is not one of")
               for p in problems)
    assert any(p.startswith("spec.leaderWorkerTemplate.size: 0 is less than the minimum of 1")
               for p in problems)
    values = yaml.safe_load(plan(project, service.LLM_D, SEED[1], SEED[0]).files[f"{SEED[1]}.values.yaml"])
    values["decode"]["containers"][0]["modelCommand"] = "customm"
    del values["decode"]["containers"][0]["command"]
    values["routing"]["proxy"]["enable"] = False
    problems = crds.validate_own(values, crds.LLMD_SCHEMA)
    assert any(p.startswith("decode.containers.0.modelCommand: 'customm' is not one of") for p in problems)
    assert any(p.startswith("routing.proxy: Additional properties are not allowed ('enable'")
               for p in problems)


# --- the user's own CRD and chart schema --------------------------------------------------------

def stand_in_crd(kind: str, group: str, version: str, replicas: str = "integer") -> str:
    """A CRD of `kind` whose spec declares replicas as `replicas` and nothing else."""
    return yaml.safe_dump({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"things.{group}"},
        "spec": {"group": group, "names": {"kind": kind, "plural": "things"}, "scope": "Namespaced",
                 "versions": [{"name": version, "served": True, "storage": True, "schema": {
                     "openAPIV3Schema": {"type": "object", "properties": {
                         "spec": {"type": "object",
                                  "properties": {"replicas": {"type": replicas}}}}}}}]}})


def test_the_users_crd_is_applied_and_a_bad_one_is_named(project: Project, tmp_path: Path) -> None:
    crd = tmp_path / "crd.yaml"
    crd.write_text(stand_in_crd("LLMInferenceService", "serving.kserve.io", "v1alpha1", "string"))
    p = plan(project, service.KSERVE, SEED[1], SEED[0], crd=crd)
    (refused,) = [f for f in p.findings if f.severity == "error"]
    assert (refused.code, refused.message) == ("export-crd", f"spec.replicas: 1 is not of type "
                                               f"'string' (per {crd})")
    undeclared = {f.message.split(":")[0] for f in p.findings if f.code == "export-crd-undeclared"}
    assert "spec.model" in undeclared and "spec.template" in undeclared
    # Fields under an object that keeps unknown fields are not pruned: no warning for them.
    kept = yaml.safe_load(stand_in_crd("LLMInferenceService", "serving.kserve.io", "v1alpha1"))
    kept["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "x-kubernetes-preserve-unknown-fields"] = True
    listed = tmp_path / "list.yaml"
    listed.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [kept]}))
    p_kept = plan(project, service.KSERVE, SEED[1], SEED[0], crd=listed)
    assert errors(p_kept) == [] and "export-crd-undeclared" not in {f.code for f in p_kept.findings}
    assert any(str(crd) in how for how in p.validated)
    with pytest.raises(ExportError):
        service.export(project, p, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    crd.write_text(stand_in_crd("LLMInferenceService", "serving.kserve.io", "v1alpha1"))
    assert errors(plan(project, service.KSERVE, SEED[1], SEED[0], crd=crd)) == []
    crd.write_text(stand_in_crd("LeaderWorkerSet", "leaderworkerset.x-k8s.io", "v1", "string"))
    p = plan(project, service.LWS, SEED[1], SEED[0], PP2, crd=crd)
    assert [f.message for f in p.findings if f.code == "export-crd"] == [
        f"spec.replicas: 1 is not of type 'string' (per {crd})"]

    def refusal(target: str, path: Path) -> str:
        with pytest.raises(ExportError) as caught:
            plan(project, target, SEED[1], SEED[0], PP2, crd=path)
        return caught.value.render()

    assert "no CustomResourceDefinition of kind LLMInferenceService" in refusal(service.KSERVE, crd)
    crd.write_text(stand_in_crd("LeaderWorkerSet", "leaderworkerset.x-k8s.io", "v2"))
    assert "has no schema for v1 (versions: v2)" in refusal(service.LWS, crd)
    crd.write_text("spec:\n  names: [\n")
    assert f"error: {crd}:3: not YAML" in refusal(service.LWS, crd)
    assert "cannot be read" in refusal(service.LWS, tmp_path / "absent.yaml")
    assert "kubectl get crd leaderworkersets.leaderworkerset.x-k8s.io" in refusal(
        service.LWS, tmp_path / "absent.yaml")
    assert "--to kube writes none" in refusal(service.KUBE, crd)


def test_the_llm_d_charts_own_schema_is_applied(project: Project, tmp_path: Path) -> None:
    schema = tmp_path / "llm-d-modelservice" / "values.schema.json"
    schema.parent.mkdir()
    schema.write_text(json.dumps({"$schema": "https://json-schema.org/draft/2020-12/schema",
                                  "type": "object", "properties": {
                                      "routing": {"type": "object", "properties": {
                                          "servicePort": {"type": "string"}}}}}))
    p = plan(project, service.LLM_D, SEED[1], SEED[0], chart_schema=schema.parent)
    assert [f.message for f in p.findings if f.code == "export-chart-schema"] == [
        f"routing.servicePort: 8180 is not of type 'string' (per {schema})"]
    assert "decode" in {f.message.split(":")[0] for f in p.findings if f.code == "export-chart-undeclared"}
    with pytest.raises(ExportError, match="writes no chart values"):
        plan(project, service.LWS, SEED[1], SEED[0], PP2, chart_schema=schema)


def test_the_task_takes_the_new_targets_and_the_crd_flag(project: Project, tmp_path: Path) -> None:
    import subprocess

    def invoke(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["invoke", "export", *args], cwd=project.root, capture_output=True,
                              text=True, timeout=300)

    done = invoke("--to", "lws", "--platform", SEED[0], "--model", SEED[1], "--set", PP2,
                  "--out", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["files"] == [str(tmp_path / f"{SEED[1]}.yaml")]
    refused = invoke("--to", "lws", "--platform", SEED[0], "--model", SEED[1], "--out", str(tmp_path / "x"))
    assert refused.returncode == 1 and "export-single-node" in refused.stderr and "fix:" in refused.stderr
    crd = tmp_path / "crd.yaml"
    crd.write_text(stand_in_crd("LLMInferenceService", "serving.kserve.io", "v1alpha1", "string"))
    checked = invoke("--to", "kserve", "--platform", SEED[0], "--model", SEED[1], "--crd", str(crd),
                     "--out", str(tmp_path / "k"))
    assert checked.returncode == 1 and f"(per {crd})" in checked.stderr
    assert not (tmp_path / "k").exists()


def test_the_run_line_runs_the_profiles_argv_as_sh_reads_it(project: Project, tmp_path: Path) -> None:
    """The script itself, run by sh with a stand-in podman that prints the words it got."""
    import os
    import subprocess
    import sys

    p = plan(project, service.LLM_D, SEED[1], SEED[0], "VLLM_EXTRA_ARGS=--api-key sk-do-not-leak")
    done = service.export(project, p, tmp_path / "out")
    script = tmp_path / "out" / f"{SEED[1]}.run.sh"
    assert script in done.written and "sk-do-not-leak" not in script.read_text()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "podman").write_text(
        f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    (bin_dir / "podman").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "VLLMSTACK_SECRET_API_KEY": "sk-from-env"}
    result = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    words = json.loads(result.stdout)
    assert words[:3] == ["run", "-d", "--replace"]
    image = p.specs[0].image
    profile = config_argv(project, *SEED, "VLLM_EXTRA_ARGS=--api-key sk-do-not-leak")
    assert words[words.index(image) + 1:] == [
        "sk-from-env" if w == "***" else w for w in profile[len(p.specs[0].entrypoint):]]
    assert f"127.0.0.1:{p.specs[0].port}:{p.specs[0].port}" in words
    assert words[words.index("--device") + 1] == "/dev/kfd"


def test_the_endpoints_file_takes_an_ipv4_address_only(project: Project) -> None:
    anywhere = plan(project, service.LLM_D, SEED[1], SEED[0], "VLLM_BIND=0.0.0.0")
    (entry,) = yaml.safe_load(anywhere.files[f"{SEED[1]}.endpoints.yaml"])["endpoints"]
    assert entry["address"] == "127.0.0.1"
    assert "export-llmd-address" in {f.code for f in anywhere.findings}
    lan = plan(project, service.LLM_D, SEED[1], SEED[0], "VLLM_BIND=192.168.1.20")
    assert yaml.safe_load(lan.files[f"{SEED[1]}.endpoints.yaml"])["endpoints"][0]["address"] == "192.168.1.20"
    six = plan(project, service.LLM_D, SEED[1], SEED[0], "VLLM_BIND=::1")
    (refused,) = [f for f in six.findings if f.severity == "error"]
    assert refused.code == "export-llmd-ipv4" and refused.key == "VLLM_BIND"
    two = service.plan_export(project, service.LLM_D, [SEED[1], "qwen3-0.6b"], SEED[0], [MODELS], ENV,
                              RecordingRunner())
    assert "export-llmd-port-clash" in {f.code for f in two.findings}
    broken = {"endpoints": [{"name": "a", "address": "engine.local", "port": 8180}]}
    problems = crds.validate_own(broken, crds.LLMD_ENDPOINTS_SCHEMA)
    assert any(p.startswith("endpoints.0.address: 'engine.local' does not match") for p in problems)
    assert any(p.startswith("endpoints.0.port: 8180 is not of type 'string'") for p in problems)


def test_an_image_from_a_registry_is_pinned_by_its_digest(project: Project) -> None:
    from vllmstack.core.runner import Result

    image = "ghcr.io/example/vllm-fullbuild:v0.31.0"
    digest = "ghcr.io/example/vllm-fullbuild@sha256:" + "ab" * 32
    runner = RecordingRunner()
    runner.respond(["docker", "image", "inspect", "--format", "{{json .RepoDigests}}"],
                   Result((), 0, json.dumps(["docker.io/other/name@sha256:" + "cd" * 32, digest])))

    def exported(target: str, *sets: str) -> service.Plan:
        return service.plan_export(project, target, [SEED[1]], SEED[0],
                                   [MODELS, f"VLLM_IMAGE={image}", *sets], ENV, runner)

    isvc = of_kind(documents(exported(service.KSERVE), f"{SEED[1]}.yaml"), "LLMInferenceService")
    assert isvc["spec"]["template"]["containers"][0]["image"] == digest
    assert isvc["metadata"]["annotations"]["vllmstack/image-digest"] == digest
    lws = of_kind(documents(exported(service.LWS, PP2), f"{SEED[1]}.yaml"), "LeaderWorkerSet")
    for role in ("leaderTemplate", "workerTemplate"):
        assert lws["spec"]["leaderWorkerTemplate"][role]["spec"]["containers"][0]["image"] == digest
    values = yaml.safe_load(exported(service.LLM_D).files[f"{SEED[1]}.values.yaml"])
    assert values["decode"]["containers"][0]["image"] == digest
    # A build that never left this host has no registry digest: the name is kept.
    assert spec_digest(RecordingRunner(), image) is None


def spec_digest(runner: RecordingRunner, image: str) -> str | None:
    from vllmstack.export.spec import read_image_digest
    return read_image_digest(runner, "docker", image)
