"""Issue 36, row 1: a setting that carries a newline must not write a line of its own into what
`invoke export` generates. A Quadlet unit is read line by line, so `VLLM_IMAGE=x<newline>
PodmanArgs=--privileged` wrote a privileged unit, and export called it validated. Every settings
key of the schema, with a hostile value, through every exporter: the export is refused (an error
finding, so nothing is written) or the hostile text stays inside one value (YAML's own quoting)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import copy_project

from vllmstack.config.profiles import resolve
from vllmstack.config.schema import load_schema
from vllmstack.core.errors import StackError
from vllmstack.core.findings import has_errors
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner
from vllmstack.export import service
from vllmstack.export.spec import ExportError

HOSTILE = "x\nPodmanArgs=--privileged\nVolume=/:/host\n[Service]\nExecStartPre=/bin/sh -c id"
INJECTED = ("PodmanArgs=--privileged", "Volume=/:/host", "ExecStartPre=/bin/sh -c id")
KEYS = sorted(load_schema().keys)
ENVIRON = {"HOME": "/root"}
TARGETS = (service.QUADLET, service.KUBE, service.PRODUCTION_STACK)
PROFILE = ("nvidia", "qwen3-0.6b")


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Project:
    return Project(copy_project(tmp_path_factory.mktemp("export-injection")))


def privileged(node: Any) -> bool:
    """A YAML document that grants what the hostile text asks for, anywhere in it."""
    if isinstance(node, dict):
        if node.get("privileged") is True or node.get("hostPath", {}) == {"path": "/"}:
            return True
        return any(privileged(v) for v in node.values())
    if isinstance(node, list):
        return any(privileged(v) for v in node)
    return False


SCHEMA = load_schema()


def plan_or_refusal(project: Project, target: str, key: str, value: str) -> service.Plan | None:
    """plan_export as the task runs it (the schema read once: it is most of a plan's time)."""
    try:
        resolved = resolve(project, platform=PROFILE[0], model=PROFILE[1], overrides=[f"{key}={value}"],
                           environ=ENVIRON, schema=SCHEMA)
        return service.plan_profiles(project, target, [resolved], ENVIRON, RecordingRunner())
    except StackError:
        return None  # refused before anything was planned: `error:`/`fix:`, exit 1


@pytest.mark.parametrize("target", TARGETS)
def test_no_setting_writes_a_line_of_its_own_into_an_export(project: Project, target: str) -> None:
    leaks = []
    for key in KEYS:
        plan = plan_or_refusal(project, target, key, HOSTILE)
        if plan is None or has_errors(plan.findings):
            continue  # `export` writes nothing
        for name, text in plan.files.items():
            if name.endswith(".container"):
                lines = text.splitlines()
                if any(line in INJECTED or (line == "[Service]" and lines.count("[Service]") > 1)
                       for line in lines):
                    leaks.append(f"{key} -> {name}")
            else:
                documents = [d for d in yaml.safe_load_all(text) if d is not None]
                if any(privileged(d) for d in documents):
                    leaks.append(f"{key} -> {name}")
    assert leaks == []


@pytest.mark.parametrize("key", ["VLLM_IMAGE", "VLLM_BIND", "HF_CACHE_DIR", "HOST_CACHE_DIR",
                                 "MODELS_DIR"])
def test_the_quadlet_refusal_names_the_key_and_where_it_was_set(project: Project, key: str,
                                                                 tmp_path: Path) -> None:
    plan = plan_or_refusal(project, service.QUADLET, key, HOSTILE)
    assert plan is not None
    refusals = [f for f in plan.findings if f.code == "export-control-character"]
    assert refusals and refusals[0].key == key and refusals[0].source == "--set"
    assert "PodmanArgs=--privileged" in refusals[0].message  # quoted, so it reads as data
    assert refusals[0].fix == f"remove the newline or control character from {key}"
    with pytest.raises(ExportError, match="nothing was written"):
        service.export(project, plan, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_plain_value_still_exports(project: Project) -> None:
    plan = plan_or_refusal(project, service.QUADLET, "VLLM_IMAGE", "localhost/vllm:plain")
    assert plan is not None and not has_errors(plan.findings)
    (text,) = plan.files.values()
    assert "Image=localhost/vllm:plain" in text.splitlines()
