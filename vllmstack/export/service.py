"""`invoke export`: profiles to production-stack values, Kubernetes manifests, Quadlet units,
KServe LLMInferenceServices, llm-d modelservice values or LeaderWorkerSets.

`plan_export` builds every document in memory with what did not translate (findings) and the
validators' verdicts; `invoke check --target` shows those findings. `export` writes the plan
into a folder a user reads (default generated/export/<target>/), and refuses when an error
finding remains: nothing invalid or half-translated is written. A file there that `invoke
export` did not write is never overwritten.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vllmstack.config.profiles import Resolved, resolve
from vllmstack.core.files import FileWriteError, file_head, writable_folder, write_text
from vllmstack.core.findings import Finding, has_errors, sort_findings
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.export import cluster, crds, helm, kube, quadlet, runline, standalone, validate
from vllmstack.export.pod import resource_name
from vllmstack.export.spec import PLACEHOLDER, EngineSpec, ExportError, engine_spec
from vllmstack.export.targets import (
    CHART_TARGETS,
    CRD_TARGETS,
    KSERVE,
    KUBE,
    LLM_D,
    LWS,
    PRODUCTION_STACK,
    QUADLET,
    TARGETS,
)

__all__ = ["KSERVE", "KUBE", "LLM_D", "LWS", "PRODUCTION_STACK", "QUADLET", "TARGETS", "Exported",
           "Plan", "export",
           "export_json", "plan_export", "plan_profiles", "render_exported", "target_findings"]
MARKER = "Written by `invoke export"
# What an exported folder's files may be read by: they hold no secret (references only).
MODE = 0o644
LLMD_SCHEMA_FIX = (f"pass the chart's own schema: helm pull llm-d-modelservice/llm-d-modelservice --version "
                   f"{cluster.LLMD_CHART_VERSION} --untar, then --chart-schema llm-d-modelservice")
# Where each custom resource holds core/v1 PodSpecs (checked by kubernetes-validate).
POD_PATHS = {KSERVE: (("spec", "template"), ("spec", "worker")),
             LWS: (("spec", "leaderWorkerTemplate", "leaderTemplate", "spec"),
                   ("spec", "leaderWorkerTemplate", "workerTemplate", "spec"))}
RESOURCE_SCHEMA = {KSERVE: crds.KSERVE_SCHEMA, LWS: crds.LWS_SCHEMA}
APPLY = {KSERVE: "KServe with its LLMInferenceService CRD", LWS: "the LeaderWorkerSet controller"}


@dataclass
class Plan:
    target: str
    specs: list[EngineSpec]
    files: dict[str, str] = field(default_factory=dict)   # file name -> text
    findings: list[Finding] = field(default_factory=list)
    validated: list[str] = field(default_factory=list)    # what was validated, and how

    @property
    def ok(self) -> bool:
        return not has_errors(self.findings)


@dataclass
class Exported:
    plan: Plan
    folder: Path
    written: list[Path]


def plan_export(project: Project, target: str, models: Sequence[str | None], platform: str | None,
                sets: Sequence[str], environ: Mapping[str, str], runner: Runner,
                chart_schema: Path | None = None, crd: Path | None = None) -> Plan:
    """Every document of the export, its findings and its validation, nothing written;
    `chart_schema`: the values.schema.json of the chart the user deploys (production-stack,
    llm-d); `crd`: the CRD of the custom resource the user's cluster has (kserve, lws)."""
    profiles = [resolve(project, platform=platform, model=model, overrides=list(sets), environ=environ)
                for model in models or [None]]
    return plan_profiles(project, target, profiles, environ, runner, chart_schema, crd)


def plan_profiles(project: Project, target: str, profiles: Sequence[Resolved],
                  environ: Mapping[str, str], runner: Runner, chart_schema: Path | None = None,
                  crd: Path | None = None) -> Plan:
    """plan_export for profiles already resolved."""
    if target not in TARGETS:
        raise ExportError(f"{target!r} is not an export target" if target else "no export target given",
                          f"name one: --to {' | --to '.join(TARGETS)}")
    if chart_schema is not None and target not in CHART_TARGETS:
        raise ExportError(f"--chart-schema is a Helm chart's values schema; --to {target} writes no "
                          "chart values", f"leave --chart-schema out, or export --to "
                          f"{' or --to '.join(CHART_TARGETS)}")
    if crd is not None and target not in CRD_TARGETS:
        raise ExportError(f"--crd is the CRD of a custom resource; --to {target} writes none",
                          f"leave --crd out, or export --to {' or --to '.join(CRD_TARGETS)}")
    # Read before any profile is planned: a schema that cannot be used stops at once.
    fix = LLMD_SCHEMA_FIX if target == LLM_D else validate.CHART_SCHEMA_FIX
    chart = validate.load_chart_schema(chart_schema, fix) if chart_schema is not None else None
    crd_schema = crds.load_crd(crd, *CRD_TARGETS[target]) if crd is not None else None
    specs = [engine_spec(project, resolved, environ, runner) for resolved in profiles]
    names = [s.profile for s in specs]
    if len(set(names)) != len(names):
        raise ExportError(f"--model names a profile twice ({', '.join(names)})",
                          "give each profile once")
    plan = Plan(target, specs)
    for spec in specs:
        plan.findings += spec.findings
    if any(f.severity == "error" for spec in specs for f in spec.resolved.problems):
        # The settings themselves are refused (a value outside its choices or type): there is
        # nothing sound to translate, and no document is built from them.
        plan.findings = sort_findings(_unique(plan.findings))
        return plan
    if target == PRODUCTION_STACK:
        _plan_chart(plan, chart)
    elif target == KUBE:
        _plan_kube(plan)
    elif target == QUADLET:
        _plan_quadlet(plan, dict(environ), runner)
    elif target == LLM_D:
        _plan_llmd(plan, chart, dict(environ))
    else:
        _plan_resource(plan, target, crd_schema)
    plan.findings = sort_findings(_unique(plan.findings))
    return plan


def target_findings(project: Project, target: str, resolved: Resolved, environ: Mapping[str, str],
                    runner: Runner, findings: Sequence[Finding]) -> list[Finding]:
    """`invoke check --target`: the checks' findings and the export's (what does not translate)."""
    planned = plan_profiles(project, target, [resolved], environ, runner)
    return sort_findings(_unique([*findings, *planned.findings]))


def _plan_chart(plan: Plan, chart: tuple[Path, Any] | None) -> None:
    values, findings = helm.build_values(plan.specs)
    plan.findings += findings
    if not values:
        return
    _checked(plan, lambda: validate.validate_values(values),
             f"values.yaml against the stack's schema of the values it writes for vllm-stack "
             f"{validate.CHART_VERSION} ({validate.OWN_SCHEMA_SHOWN}: no key the chart would ignore)")
    if values.get("extraObjects"):
        _checked(plan, lambda: validate.validate_manifests(values["extraObjects"]),
                 f"values.yaml's extraObjects with kubernetes-validate --strict, Kubernetes "
                 f"{validate.KUBERNETES_VERSION}")
    if chart is not None:
        _plan_chart_schema(plan, values, *chart)
    profiles = ", ".join(s.profile for s in plan.specs)
    header = (f"# {MARKER} --to {PRODUCTION_STACK}` for {profiles} on {plan.specs[0].platform}.\n"
              f"# helm install vllm vllm/vllm-stack --version {validate.CHART_VERSION} -f values.yaml "
              "(docs/export.md)\n")
    plan.files["values.yaml"] = header + _yaml(values)


def _plan_chart_schema(plan: Plan, values: dict[str, Any], file: Path, validator: Any) -> None:
    """The values against the user's own chart: what Helm would refuse the install for is an
    error, a key that chart does not declare a warning (it may ignore it)."""
    problems, undeclared = validate.validate_chart_values(values, file, validator)
    plan.findings += [Finding("error", "export-chart-schema", problem, fix=(
        f"this export writes values for vllm-stack {validate.CHART_VERSION}; install that version "
        f"(helm pull vllm/vllm-stack --version {validate.CHART_VERSION} --untar), or report the "
        "difference so the export follows the newer chart")) for problem in problems]
    plan.findings += [Finding("warning", "export-chart-undeclared", note, fix=(
        f"check that chart's templates for the key; vllm-stack {validate.CHART_VERSION} reads it"))
        for note in undeclared]
    plan.validated.append(f"values.yaml against {file} (the chart's own schema, as helm install "
                          "applies it)")


def _plan_kube(plan: Plan) -> None:
    for spec in plan.specs:
        documents, findings = kube.build_manifests(spec)
        plan.findings += findings
        _checked(plan, lambda d=documents: validate.validate_manifests(d),
                 f"{spec.profile}.yaml with kubernetes-validate --strict, Kubernetes "
                 f"{validate.KUBERNETES_VERSION}")
        header = (f"# {MARKER} --to {KUBE}` for {spec.profile} on {spec.platform}.\n"
                  f"# kubectl apply -f {spec.profile}.yaml (docs/export.md)\n")
        plan.files[f"{spec.profile}.yaml"] = header + "---\n".join(_yaml(d) for d in documents)


def _plan_quadlet(plan: Plan, environ: dict[str, str], runner: Runner) -> None:
    binary = validate.quadlet_binary()
    for spec in plan.specs:
        text, findings = quadlet.build_unit(spec, spec.resolved, environ)
        plan.findings += findings
        name = quadlet.unit_name(spec)
        problems = validate.validate_unit(text)
        how = f"{name}.container: the keys of Podman 4.4's Quadlet, sections, quoting"
        if binary:
            problems += validate.run_quadlet(runner, text, name, binary)
            how += f", and {binary} -dryrun"
        plan.findings += [_invalid(p) for p in problems]
        plan.validated.append(how)
        plan.files[f"{name}.container"] = text


def _plan_resource(plan: Plan, target: str, crd: tuple[Path, Any] | None) -> None:
    """--to kserve | lws: one file per profile, the custom resource after what it needs."""
    build = cluster.build_llmisvc if target == KSERVE else cluster.build_lws
    for spec in plan.specs:
        documents, findings = build(spec)
        plan.findings += findings
        if not documents:
            continue
        (resource,) = [d for d in documents if d["kind"] == CRD_TARGETS[target][0]]
        plain = [d for d in documents if d is not resource]
        name = f"{spec.profile}.yaml"
        _checked(plan, lambda r=resource: crds.validate_own(r, RESOURCE_SCHEMA[target]),
                 f"{name}'s {resource['kind']} against the stack's schema of it "
                 f"({crds.shown(RESOURCE_SCHEMA[target])}: no field the API server would drop)")
        _checked(plan, lambda r=resource: crds.validate_pods(r, POD_PATHS[target]),
                 f"{name}'s pod specs with kubernetes-validate --strict, Kubernetes "
                 f"{validate.KUBERNETES_VERSION}")
        claims = [{"apiVersion": "v1", "kind": "PersistentVolumeClaim", **c} for c in
                  resource["spec"].get("leaderWorkerTemplate", {}).get("volumeClaimTemplates", [])]
        _checked(plan, lambda d=plain + claims: validate.validate_manifests(d),
                 f"{name}'s other documents with kubernetes-validate --strict")
        if crd is not None:
            _plan_crd(plan, resource, *crd)
        header = (f"# {MARKER} --to {target}` for {spec.profile} on {spec.platform}.\n"
                  f"# kubectl apply -f {name}  (needs {APPLY[target]}; docs/export.md)\n")
        plan.files[name] = header + "---\n".join(_yaml(d) for d in documents)


def _plan_crd(plan: Plan, resource: dict[str, Any], file: Path, validator: Any) -> None:
    problems, undeclared = crds.validate_crd(resource, file, validator)
    plan.findings += [Finding("error", "export-crd", problem, fix=(
        f"this export writes {resource['apiVersion']} as its own schema reads it; install that "
        "CRD version, or report the difference so the export follows yours")) for problem in problems]
    plan.findings += [Finding("warning", "export-crd-undeclared", note,
                              fix="check your controller's version: an older CRD drops this field")
                      for note in undeclared]
    plan.validated.append(f"{resource['kind']} against {file} (the CRD's own schema, as the API "
                          "server applies it)")


def _plan_llmd(plan: Plan, chart: tuple[Path, Any] | None, environ: dict[str, str]) -> None:
    """--to llm-d: per profile, the modelservice chart's values and the manifests it needs; and
    the same engines without Kubernetes: the router's endpoints file and config, and each
    engine's `podman run` line."""
    endpoints: list[tuple[EngineSpec, str]] = []
    for spec in plan.specs:
        values, documents, findings = cluster.build_llmd_values(spec)
        plan.findings += findings
        if not values:
            continue
        name = f"{spec.profile}.values.yaml"
        _checked(plan, lambda v=values: crds.validate_own(v, crds.LLMD_SCHEMA),
                 f"{name} against the stack's schema of the values it writes for llm-d-modelservice "
                 f"{cluster.LLMD_CHART_VERSION} ({crds.shown(crds.LLMD_SCHEMA)})")
        # The pod the chart makes of decode: its containers (less the chart's own keys), volumes.
        pod = {"decode": {k: values["decode"][k] for k in
                          ("containers", "volumes", "terminationGracePeriodSeconds")}}
        _checked(plan, lambda p=pod: crds.validate_pods(p, [("decode",)], cluster.LLMD_CHART_KEYS),
                 f"{name}'s decode container with kubernetes-validate --strict")
        _checked(plan, lambda d=documents: validate.validate_manifests(d),
                 f"{spec.profile}.yaml with kubernetes-validate --strict")
        if chart is not None:
            file, validator = chart
            problems = validate.schema_problems(values, validator, str(file))
            # This chart's schema marks open maps (labels, decode) additionalProperties: true.
            undeclared = [f"{'.'.join(p)}: not a key {file} declares; that chart may ignore it"
                          for p in crds.pruned_fields(values, validator.schema, ())]
            plan.findings += [Finding("error", "export-chart-schema", p, fix=(
                f"this export writes values for llm-d-modelservice {cluster.LLMD_CHART_VERSION}; "
                "install that version, or report the difference")) for p in problems]
            plan.findings += [Finding("warning", "export-chart-undeclared", n, fix=(
                f"check that chart's templates for the key; llm-d-modelservice "
                f"{cluster.LLMD_CHART_VERSION} reads it")) for n in undeclared]
            plan.validated.append(f"{name} against {file} (the chart's own schema, as helm install "
                                  "applies it)")
        release = resource_name(spec.profile)
        plan.files[f"{spec.profile}.yaml"] = (
            f"# {MARKER} --to {LLM_D}` for {spec.profile} on {spec.platform}: apply before the chart.\n"
            f"# kubectl apply -f {spec.profile}.yaml (docs/export.md)\n"
            + "---\n".join(_yaml(d) for d in documents))
        plan.files[name] = (
            f"# {MARKER} --to {LLM_D}` for {spec.profile} on {spec.platform}.\n"
            f"# helm install {release} llm-d-modelservice/llm-d-modelservice --version "
            f"{cluster.LLMD_CHART_VERSION} -f {name} (docs/export.md)\n" + _yaml(values))
        address, findings = standalone.endpoint_address(spec)
        plan.findings += findings
        container, _, findings = quadlet.unit_entries(spec, spec.resolved, environ)
        plan.findings += [f for f in findings if f.severity != "info"]
        script = runline.run_script(
            f"# {MARKER} --to {LLM_D}` for {spec.profile} on {spec.platform}: the engine without\n"
            f"# Kubernetes, the container of `--to {QUADLET}`; the llm-d router finds it through "
            f"{spec.profile}.endpoints.yaml.\n", *runline.run_words(container))
        wanted = [PLACEHOLDER.sub(r"${\1}", w) for w in spec.command_args]
        if runline.command_of(script, spec.image) != wanted:
            plan.findings.append(_invalid(f"{spec.profile}.run.sh: the words after the image are "
                                          "not the profile's argv"))
        plan.validated.append(f"{spec.profile}.run.sh: read back as sh reads it, the profile's argv")
        plan.files[f"{spec.profile}.run.sh"] = script
        if address is None:
            continue
        endpoints.append((spec, address))
        # One router per model: its endpoints are the engines of that model only.
        document = standalone.endpoints_document([(spec, address)])
        files = standalone.file_names(spec)
        _checked(plan, lambda d=document: crds.validate_own(d, crds.LLMD_ENDPOINTS_SCHEMA),
                 f"{files.endpoints} against the stack's schema of the llm-d router's endpoints "
                 f"file ({crds.shown(crds.LLMD_ENDPOINTS_SCHEMA)})")
        plan.files[files.endpoints] = (
            f"# {MARKER} --to {LLM_D}` for the llm-d router of {spec.profile}, without Kubernetes:\n"
            f"# copy it to {files.path} (docs/export.md)\n" + _yaml(document))
        plan.files[files.config] = (
            f"# {MARKER} --to {LLM_D}`: the config of {spec.profile}'s llm-d router, reading "
            f"{files.path}\n# (epp --config-file {files.config}; docs/export.md)\n"
            + _yaml(standalone.epp_config(files.path)))
    plan.findings += standalone.clashes(endpoints)


def _checked(plan: Plan, check: Any, how: str) -> None:
    try:
        problems: list[str] = check()
    except validate.ValidatorMissingError as exc:
        plan.findings.append(Finding("warning", "export-not-validated", f"not validated: {exc}",
                                     fix=validate.EXTRA_HINT))
        return
    plan.findings += [_invalid(p) for p in problems]
    plan.validated.append(how)


def _invalid(problem: str) -> Finding:
    return Finding("error", "export-invalid", problem,
                   fix="report this: the export wrote something its validator refuses")


def _unique(findings: list[Finding]) -> list[Finding]:
    seen: set[Finding] = set()
    return [f for f in findings if not (f in seen or seen.add(f))]  # type: ignore[func-returns-value]


class _Dumper(yaml.SafeDumper):
    """Writes a shared dict (one probe in three places) out each time, never as &anchor/*alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _yaml(document: Any) -> str:
    return yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=1000, allow_unicode=True)


def export(project: Project, plan: Plan, out: Path | None = None) -> Exported:
    """Write the plan's files; ExportError (with every error finding) when it has errors."""
    if not plan.ok:
        errors = [f.render() for f in plan.findings if f.severity == "error"]
        raise ExportError(f"{len(errors)} problem(s) stop the export to {plan.target}; nothing "
                          "was written", "fix each one above, then export again", details=errors)
    # --out is the user's path: an existing file, a folder under a file, a device or /proc is
    # refused by what it is (PathKindError) before anything is made or written.
    folder = writable_folder(out, "--out") if out is not None else writable_folder(
        project.generated / "export" / plan.target, "the export folder")
    for name in plan.files:
        path = folder / name
        head = file_head(path, 400)  # a folder or FIFO in a file's place: refused, never read
        if head is not None and MARKER not in head.decode("utf-8", errors="replace"):
            raise ExportError(f"{path} exists and was not written by `invoke export`; it is "
                              "left as it is", "choose another --out folder, or move that file")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # made by someone else between the check and here, a full disk
        raise FileWriteError(folder, exc) from exc
    written = []
    for name, text in plan.files.items():
        write_text(folder / name, text, MODE)
        written.append(folder / name)
    return Exported(plan, folder, written)


def render_exported(done: Exported, *, verbose: bool = False) -> str:
    plan = done.plan
    lines = [f.render() for f in plan.findings if verbose or f.severity != "info"]
    lines += [f"wrote {path}" for path in done.written]
    lines += [f"validated {how}" for how in plan.validated]
    lines.append(f"{len(plan.specs)} profile(s) exported to {plan.target}; "
                 f"{sum(f.severity == 'warning' for f in plan.findings)} warning(s), "
                 f"{sum(f.severity == 'info' for f in plan.findings)} note(s)"
                 + ("" if verbose else " (--verbose shows the notes)"))
    return "\n".join(lines)


def export_json(done: Exported) -> dict[str, Any]:
    return {"target": done.plan.target, "folder": str(done.folder),
            "profiles": [s.profile for s in done.plan.specs],
            "files": [str(p) for p in done.written], "validated": done.plan.validated,
            "findings": [f.to_json() for f in done.plan.findings]}
