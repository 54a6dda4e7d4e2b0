"""Offline validation of what `invoke export` writes, before it is written.

  * production-stack values: the chart's own values.schema.json (vendored, schemas/
    production-stack/PROVENANCE.md) through `jsonschema`, draft 2020-12; and, stricter than the
    chart, every key we write must be one the schema declares (the chart ignores unknown keys
    silently, so a misspelt one would be lost);
  * Kubernetes manifests: `kubernetes-validate` in strict mode (no unknown fields) against the
    bundled OpenAPI schemas of KUBERNETES_VERSION;
  * Quadlet units: the keys of Podman 4.4's Quadlet, the sections, and the words of each line;
    where a Quadlet generator is installed (Podman >= 4.4), its `-dryrun` as well.

The validators are the `export` extra (`pip install -e '.[export]'`, part of `.[dev]`); without
them the export still writes its files and says what was not validated.
"""

from __future__ import annotations

import functools
import json
import shlex
import tempfile
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from vllmstack.core.runner import Runner
from vllmstack.export.quadlet import QUADLET_44_KEYS

KUBERNETES_VERSION = "1.33.0"
CHART_SCHEMA = ("production-stack", "values.schema.json")
CHART_VERSION = "0.1.12"  # vllm-stack's version at the vendored schema's commit (PROVENANCE.md)
CHART_SCHEMA_SHA256 = "c6f98c9146c09e4ef01609afb9a1667da1694de3ca4d84247c942d875622a86a"
# Keys the chart's templates read that its schema does not declare: ray-cluster.yaml reads
# vllmConfig.v1 (VLLM_USE_V1), _helpers.tpl's chart.templateProbe a probe's timeoutSeconds.
UNDECLARED_BUT_READ = {("servingEngineSpec", "modelSpec", "*", "vllmConfig", "v1"),
                       ("servingEngineSpec", "livenessProbe", "timeoutSeconds")}
UNIT_SECTIONS = ("Unit", "Container", "Service", "Install")
# Where distributions install Quadlet (Fedora/RHEL/Debian 13: libexec; Arch, openSUSE: lib).
QUADLET_BINARIES = ("/usr/libexec/podman/quadlet", "/usr/lib/podman/quadlet")
EXTRA_HINT = "pip install -e '.[export]'"


class ValidatorMissingError(Exception):
    """A validator library is not installed; the message names it."""


@functools.cache
def chart_schema() -> dict[str, Any]:
    folder, name = CHART_SCHEMA
    text = (resources.files("vllmstack.export") / "schemas" / folder / name).read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def validate_values(values: dict[str, Any]) -> list[str]:
    """Problems of a values document against the chart's schema, one line each."""
    try:
        import jsonschema
    except ImportError as exc:
        raise ValidatorMissingError(f"jsonschema is not installed ({EXTRA_HINT})") from exc
    schema = chart_schema()
    validator = jsonschema.Draft202012Validator(schema)
    problems = [f"{'.'.join(str(p) for p in e.absolute_path) or '(top)'}: {e.message}"
                for e in sorted(validator.iter_errors(values), key=lambda e: list(e.absolute_path))]
    problems += [f"{'.'.join(path)}: not a key the chart's schema declares"
                 for path in undeclared_keys(values, schema, ())]
    return problems


def undeclared_keys(value: Any, schema: dict[str, Any], path: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Paths of mapping keys under an object whose schema lists its properties but not them."""
    out: list[tuple[str, ...]] = []
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            here = (*path, str(key))
            generic = tuple("*" if p.isdigit() else p for p in here)
            if key in schema["properties"]:
                out += undeclared_keys(item, schema["properties"][key], here)
            elif generic not in UNDECLARED_BUT_READ:
                out.append(here)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            out += undeclared_keys(item, schema["items"], (*path, str(index)))
    return out


def validate_manifests(documents: Sequence[dict[str, Any]],
                       version: str = KUBERNETES_VERSION) -> list[str]:
    """kubernetes-validate --strict on each document, one line per problem."""
    try:
        import kubernetes_validate
    except ImportError as exc:
        raise ValidatorMissingError(f"kubernetes-validate is not installed ({EXTRA_HINT})") from exc
    problems: list[str] = []
    for document in documents:
        where = f"{document.get('kind')}/{document.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(document, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            problems.append(f"{where}: {path + ': ' if path else ''}{exc.message}")
        except (kubernetes_validate.SchemaNotFoundError,
                kubernetes_validate.InvalidSchemaError) as exc:
            problems.append(f"{where}: {exc}")
    return problems


def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """A unit file's sections as (key, value) lists, in order; ValueError on a malformed line."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", ";")):
            continue
        if stripped.startswith("[") and stripped.endswith("]"):
            current = sections.setdefault(stripped[1:-1], [])
            continue
        key, eq, value = line.partition("=")
        if not eq or current is None or not key.strip().isidentifier():
            raise ValueError(f"line {number}: {line!r} is not KEY=VALUE inside a section")
        if value.rstrip().endswith("\\"):
            raise ValueError(f"line {number}: ends with a backslash (a continuation line)")
        current.append((key.strip(), value.strip()))
    return sections


def unit_words(value: str) -> list[str]:
    """A value's words as Quadlet's splitter reads them, for the quoting unit_word writes
    (double quotes with \\\\ and \\" escapes): shlex reads that subset the same way."""
    return shlex.split(value)


def validate_unit(text: str) -> list[str]:
    """Problems of a .container unit for Podman 4.4's Quadlet, one line each."""
    try:
        sections = parse_unit(text)
    except ValueError as exc:
        return [str(exc)]
    problems = [f"[{name}] is not a section a .container unit has" for name in sections
                if name not in UNIT_SECTIONS]
    container = sections.get("Container", [])
    problems += [f"[Container] {key}= is not a key of Podman 4.4's Quadlet"
                 for key, _ in container if key not in QUADLET_44_KEYS]
    if not any(key == "Image" and value for key, value in container):
        problems.append("[Container] has no Image=")
    for key, value in container:
        if key in ("Exec", "PodmanArgs", "Environment", "Label", "Annotation"):
            try:
                unit_words(value)
            except ValueError as exc:
                problems.append(f"[Container] {key}={value}: {exc}")
    return problems


def quadlet_binary() -> str | None:
    return next((b for b in QUADLET_BINARIES if Path(b).is_file()), None)


def run_quadlet(runner: Runner, text: str, name: str, binary: str) -> list[str]:
    """Quadlet's own `-dryrun` on the unit (the generator's check); its complaints, if any."""
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / f"{name}.container").write_text(text, encoding="utf-8")
        result = runner.run([binary, "-dryrun", "-no-kmsg-log"], mutates=False,
                            env={"QUADLET_UNIT_DIRS": folder, "PATH": "/usr/bin:/bin"})
    if result.ok and f"---{name}.service---" in result.stdout:
        return []
    return [f"quadlet -dryrun: {(result.stderr or result.stdout).strip() or 'generated no service'}"]
