"""`invoke export`: a profile (or several) to vLLM's production-stack chart, Kubernetes manifests,
a Podman Quadlet unit, KServe's LLMInferenceService, llm-d's modelservice chart or a
LeaderWorkerSet (vllmstack/export/)."""

from __future__ import annotations

import os
from pathlib import Path

from invoke.context import Context

from vllmstack.cli.common import JSON_HELP, PROFILE_HELP, Opt, Sets, make_runner, print_json, project_here
from vllmstack.cli.task import stack_task
from vllmstack.cli.values import PATH, choice
from vllmstack.export.targets import TARGETS

# `--to` here and `invoke check --target` (where the name means a Dockerfile stage elsewhere).
EXPORT_TARGET = choice(TARGETS)
EXPORT_VALUES = {"to": EXPORT_TARGET, "chart_schema": PATH, "crd": PATH}


@stack_task(iterable=["model", "set"], positional=[], values=EXPORT_VALUES, help={
    **PROFILE_HELP, **JSON_HELP,
    "to": "production-stack (Helm values for vLLM's production-stack chart) | kube (Kubernetes "
          "manifests) | quadlet (a Podman Quadlet .container unit) | kserve (KServe's "
          "LLMInferenceService) | llm-d (llm-d-modelservice chart values) | lws (a LeaderWorkerSet "
          "for a profile over several nodes)",
    "model": "model profile, repeatable: production-stack writes one modelSpec each, the other "
             "targets one set of files each (default: MODEL_PROFILE in .env)",
    "out": "folder to write into (default: generated/export/<target>)",
    "chart_schema": "production-stack, llm-d: also validate the values against the chart you "
                    "deploy - its values.schema.json, or the folder `helm pull --untar` makes",
    "crd": "kserve, lws: also validate the resource against your cluster's CRD (`kubectl get crd "
           "NAME -o yaml`)",
    "verbose": "show the notes too (info findings)"})
def export(c: Context, to: Opt = None, model: Sets = None, platform: Opt = None, set: Sets = None,
           out: Opt = None, chart_schema: Opt = None, crd: Opt = None, json: bool = False,
           verbose: bool = False) -> None:
    """Export profiles to a cluster or a systemd host: the same argv, image, GPUs, files, checks."""
    from vllmstack.export import service

    project = project_here()
    plan = service.plan_export(project, to or "", model or [None], platform, set or [], os.environ,
                               make_runner(False),
                               Path(chart_schema).expanduser() if chart_schema else None,
                               Path(crd).expanduser() if crd else None)
    done = service.export(project, plan, Path(out) if out else None)
    print_json(service.export_json(done)) if json else print(service.render_exported(done, verbose=verbose))
