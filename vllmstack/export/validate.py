"""Offline validation of what `invoke export` writes, before it is written.

  * production-stack values: the stack's own JSON schema of the values it writes
    (chart_values.schema.json: the keys, types and required fields the export relies on, as this
    stack reads chart CHART_VERSION; unknown keys refused where the chart would ignore them
    silently) through `jsonschema`; and, when the user names it (`--chart-schema`), the
    values.schema.json of the chart they deploy, which Helm itself applies at install. The chart's
    own schema is not shipped here: it is another project's file;
  * Kubernetes manifests: `kubernetes-validate` in strict mode (no unknown fields) against the
    bundled OpenAPI schemas of KUBERNETES_VERSION;
  * Quadlet units: the keys of Podman 4.4's Quadlet, the sections, and the words of each line;
    where a Quadlet generator is installed (Podman >= 4.4), its `-dryrun` as well.

The validators are the `export` extra (`pip install -e '.[export]'`, part of `.[dev]`); without
them the export still writes its files and says what was not validated.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shlex
import tempfile
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from vllmstack.core.files import JsonFileError, json_syntax_error, read_json_file
from vllmstack.core.runner import Runner
from vllmstack.export.quadlet import QUADLET_44_KEYS
from vllmstack.export.spec import ExportError

KUBERNETES_VERSION = "1.33.0"
OWN_SCHEMA = "chart_values.schema.json"
OWN_SCHEMA_SHOWN = f"vllmstack/export/{OWN_SCHEMA}"
# The chart our schema and chart.py were read against (the schema's $comment names the same).
CHART_VERSION = "0.1.12"
CHART_COMMIT = "01eaf92cb895ececa44ee86083f11522adafbbc9"
CHART_SCHEMA_NAME = "values.schema.json"  # where `helm pull --untar` puts it in the chart folder
# Keys chart 0.1.12's templates read that its schema does not declare: ray-cluster.yaml reads
# vllmConfig.v1 (VLLM_USE_V1), _helpers.tpl's probe helper a probe's timeoutSeconds. Against a
# user's chart schema they are not reported as undeclared.
UNDECLARED_BUT_READ = {("servingEngineSpec", "modelSpec", "*", "vllmConfig", "v1"),
                       ("servingEngineSpec", "startupProbe", "timeoutSeconds"),
                       ("servingEngineSpec", "readinessProbe", "timeoutSeconds"),
                       ("servingEngineSpec", "livenessProbe", "timeoutSeconds")}
# A chart's values.schema.json is tens of KiB (vllm-stack 0.1.12's: the keys of its values.yaml);
# far above that, and the read stays bounded whatever --chart-schema names.
CHART_SCHEMA_MAX_BYTES = 8 * 1024 * 1024
MESSAGE_CHARS = 240  # jsonschema quotes the offending value; a ConfigMap's would fill a screen
UNIT_SECTIONS = ("Unit", "Container", "Service", "Install")
# Where distributions install Quadlet (Fedora/RHEL/Debian 13: libexec; Arch, openSUSE: lib).
QUADLET_BINARIES = ("/usr/libexec/podman/quadlet", "/usr/lib/podman/quadlet")
EXTRA_HINT = "pip install -e '.[export]'"
CHART_SCHEMA_FIX = (f"pass the chart's own schema: helm pull vllm/vllm-stack --version {CHART_VERSION} "
                    f"--untar, then --chart-schema vllm-stack/{CHART_SCHEMA_NAME}")


class ValidatorMissingError(Exception):
    """A validator library is not installed; the message names it."""


class ChartSchemaError(ExportError):
    """The chart schema named with --chart-schema cannot be read or is not a JSON schema."""


@functools.cache
def own_schema() -> dict[str, Any]:
    text = (resources.files("vllmstack.export") / OWN_SCHEMA).read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def _jsonschema() -> Any:
    try:
        import jsonschema
    except ImportError as exc:
        raise ValidatorMissingError(f"jsonschema is not installed ({EXTRA_HINT})") from exc
    return jsonschema


def validate_values(values: dict[str, Any]) -> list[str]:
    """Problems of a values document against the stack's own schema of them, one line each."""
    jsonschema = _jsonschema()
    return schema_problems(values, jsonschema.Draft202012Validator(own_schema()), OWN_SCHEMA_SHOWN)


def schema_problems(values: dict[str, Any], validator: Any, shown: str) -> list[str]:
    """`PATH.IN.VALUES: what is wrong (per SCHEMA FILE)`, one line per problem, in path order."""
    problems = []
    for error in sorted(validator.iter_errors(values), key=_path_order):
        message = error.message
        quoted = repr(error.instance)
        if isinstance(error.instance, (dict, list)) and message.startswith(quoted) and len(quoted) > 40:
            # "{...the whole vllmConfig...} should not be valid under ...": the path names it
            kind = "object" if isinstance(error.instance, dict) else "list"
            message = f"this {kind}{message[len(quoted):]}"
        if len(message) > MESSAGE_CHARS:
            message = message[:MESSAGE_CHARS] + "..."
        problems.append(f"{_dotted(error.absolute_path)}: {message} (per {shown})")
    return problems


def _path_order(error: Any) -> list[str]:
    return [f"{p:09d}" if isinstance(p, int) else str(p) for p in error.absolute_path]


def _dotted(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path) or "(top)"


def load_chart_schema(path: Path, fix: str = CHART_SCHEMA_FIX) -> tuple[Path, Any]:
    """The chart's values.schema.json (a file, or the chart folder `helm pull --untar` makes) and
    a validator for it; ChartSchemaError naming the file, and the line for bad JSON.

    Read through read_json_file: a device (/dev/zero), a FIFO or anything else that is not a
    regular file is refused before a byte is read, and a file above CHART_SCHEMA_MAX_BYTES is
    refused after reading one byte more than that, so no --chart-schema can exhaust memory."""
    file = path / CHART_SCHEMA_NAME if path.is_dir() else path
    try:
        schema = read_json_file(file, f"--chart-schema {file}", fix=fix, expect_object=False,
                                max_bytes=CHART_SCHEMA_MAX_BYTES,
                                too_large="far more than a chart's values schema holds")
    except JsonFileError as exc:
        syntax = json_syntax_error(exc)
        if syntax is not None:
            raise ChartSchemaError(f"{file}:{syntax.lineno}: not JSON ({syntax.msg})", fix) from None
        raise ChartSchemaError(exc.cause, fix) from None
    if schema is None:
        raise ChartSchemaError(f"--chart-schema {file}: cannot be read (no such file)", fix)
    if not isinstance(schema, dict):
        raise ChartSchemaError(f"{file}: not a JSON schema (the document is not an object)", fix)
    try:
        jsonschema = _jsonschema()
    except ValidatorMissingError as exc:
        raise ChartSchemaError(f"--chart-schema {file}: {exc}", EXTRA_HINT) from None
    # The chart's file names its draft ($schema); one that does not is read as 2020-12.
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        with _references_checked(file, fix):
            cls.check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        where = _dotted(exc.absolute_path)
        raise ChartSchemaError(f"{file}: not a JSON schema ({where}: {exc.message})", fix) from None
    return file, cls(schema)


@contextlib.contextmanager
def _references_checked(file: Path, fix: str) -> Iterator[None]:
    """Where jsonschema follows the user's schema: a $ref cycle and a dangling reference become
    ChartSchemaError. A cycle is caught where it bites, as the RecursionError of following it
    (jsonschema resolves references lazily, recursing as it validates), not searched for in
    advance: a $ref back to an enclosing schema is how a recursive structure is written, only a
    chain that returns to itself without descending into the values loops, and following the
    references finds that for every way of writing one ($ref, $dynamicRef, anchors, $id)."""
    from referencing.exceptions import Unresolvable  # jsonschema's own dependency

    try:
        yield
    except RecursionError:
        raise ChartSchemaError(
            f"{file}: refers to itself without end (a $ref that leads back to where it is, "
            "directly or through others), so no values can be checked against it",
            f"{fix}; a chart's own schema has no such cycle") from None
    except Unresolvable as exc:
        raise ChartSchemaError(f"{file}: refers to what it does not hold ({_clipped(str(exc))})",
                               fix) from None


def _clipped(message: str) -> str:
    return message if len(message) <= MESSAGE_CHARS else message[:MESSAGE_CHARS] + "..."


def validate_chart_values(values: dict[str, Any], file: Path, validator: Any) -> tuple[list[str], list[str]]:
    """The values against the user's chart schema: (problems Helm would refuse the install for,
    keys the schema does not declare, which that chart may ignore); ChartSchemaError when the
    schema's references loop or dangle."""
    with _references_checked(file, CHART_SCHEMA_FIX):
        problems = schema_problems(values, validator, str(file))
    undeclared = [f"{'.'.join(path)}: not a key {file} declares; that chart may ignore it"
                  for path in undeclared_keys(values, validator.schema, ())]
    return problems, undeclared


def undeclared_keys(value: Any, schema: Any, path: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Paths of mapping keys under an object whose schema lists its properties but not them."""
    out: list[tuple[str, ...]] = []
    if not isinstance(schema, dict):
        return out
    if isinstance(value, dict) and isinstance(schema.get("properties"), dict):
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
