"""Offline validation of the custom resources and chart values the cluster targets write:
KServe's LLMInferenceService, LeaderWorkerSet and llm-d-modelservice's values.

  * the stack's own JSON schema of each (OWN_SCHEMAS, written from the projects' own API types
    and chart; each schema's description names the file and commit it was read from), with no
    unknown field: the API server prunes one without a word, a chart ignores it;
  * the pod specs inside them (a custom resource embeds core/v1 PodSpecs, which no bundled
    schema covers) wrapped in a Pod and checked by kubernetes-validate --strict;
  * when the user names it (`--crd`), the CRD installed in their cluster (`kubectl get crd NAME
    -o yaml`, or the release's CRD file): its openAPIV3Schema for the version written, as the
    API server applies it; a field it does not declare is a warning (it would be pruned).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from vllmstack.core.files import file_head
from vllmstack.export import validate
from vllmstack.export.spec import ExportError

KSERVE_SCHEMA = "kserve_llmisvc.schema.json"
LWS_SCHEMA = "lws.schema.json"
LLMD_SCHEMA = "llmd_values.schema.json"
LLMD_ENDPOINTS_SCHEMA = "llmd_endpoints.schema.json"
OWN_SCHEMAS = (KSERVE_SCHEMA, LWS_SCHEMA, LLMD_SCHEMA, LLMD_ENDPOINTS_SCHEMA)
# A CRD with the whole PodSpec schema is a few MiB (KServe's LLMInferenceService: two PodSpecs
# per workload); far above that, and the read stays bounded whatever --crd names.
CRD_MAX_BYTES = 32 * 1024 * 1024
# The CRD each kind is defined by, for the fix of a --crd that cannot be used.
CRD_NAMES = {"LLMInferenceService": "llminferenceservices.serving.kserve.io",
             "LeaderWorkerSet": "leaderworkersets.leaderworkerset.x-k8s.io"}


class CrdError(ExportError):
    """The CRD named with --crd cannot be read or does not define the kind written."""


def shown(name: str) -> str:
    return f"vllmstack/export/{name}"


@functools.cache
def own_schema(name: str) -> dict[str, Any]:
    if name not in OWN_SCHEMAS:
        raise KeyError(name)
    schema: dict[str, Any] = json.loads((resources.files("vllmstack.export") / name).read_text("utf-8"))
    return schema


def validate_own(document: dict[str, Any], name: str) -> list[str]:
    """Problems of a document against the stack's own schema `name`, one line each."""
    jsonschema = validate._jsonschema()
    return validate.schema_problems(document, jsonschema.Draft202012Validator(own_schema(name)),
                                    shown(name))


def validate_pods(document: dict[str, Any], paths: Sequence[tuple[str, ...]],
                  chart_keys: Sequence[str] = ()) -> list[str]:
    """Each PodSpec at `paths` inside the document, wrapped in a Pod, through kubernetes-validate
    --strict; `chart_keys`: container keys a chart reads and never writes into the pod."""
    problems: list[str] = []
    for path in paths:
        spec: Any = document
        for part in path:
            spec = spec.get(part) if isinstance(spec, dict) else None
        if not isinstance(spec, dict):
            continue
        spec = {**spec, "containers": [{k: v for k, v in c.items() if k not in chart_keys}
                                       for c in spec.get("containers", [])]}
        where = ".".join(path)
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "check"}, "spec": spec}
        problems += [f"{where} (a PodSpec): {p.removeprefix('Pod/check: ')}"
                     for p in validate.validate_manifests([pod])]
    return problems


def load_crd(path: Path, kind: str, version: str) -> tuple[Path, Any]:
    """The openAPIV3Schema of `kind` at `version` in the user's CRD file, and a validator for
    it; CrdError naming the file, and the line for YAML that does not parse."""
    fix = (f"pass the CRD your cluster has: kubectl get crd {CRD_NAMES.get(kind, kind)} -o yaml "
           "> crd.yaml, then --crd crd.yaml")
    if not path.exists():
        raise CrdError(f"--crd {path}: cannot be read (no such file)", fix)
    if not path.is_file():
        raise CrdError(f"--crd {path}: not a file", fix)
    head = file_head(path, CRD_MAX_BYTES + 1) or b""
    if len(head) > CRD_MAX_BYTES:
        raise CrdError(f"--crd {path}: more than {CRD_MAX_BYTES} bytes, far more than a CRD holds", fix)
    try:
        documents = [d for d in yaml.safe_load_all(head.decode("utf-8", errors="replace"))
                     if isinstance(d, dict)]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise CrdError(f"{path}{line}: not YAML ({getattr(exc, 'problem', None) or exc})", fix) from None
    # `kubectl get crd A B -o yaml` writes one List of them.
    documents += [i for d in documents if d.get("kind") == "List" for i in d.get("items") or []
                  if isinstance(i, dict)]
    crds = [d for d in documents if d.get("kind") == "CustomResourceDefinition"
            and (d.get("spec") or {}).get("names", {}).get("kind") == kind]
    if not crds:
        raise CrdError(f"{path}: no CustomResourceDefinition of kind {kind} in it", fix)
    versions = crds[0]["spec"].get("versions") or []
    schema = next(((v.get("schema") or {}).get("openAPIV3Schema") for v in versions
                   if isinstance(v, dict) and v.get("name") == version), None)
    if not isinstance(schema, dict):
        names = ", ".join(str(v.get("name")) for v in versions if isinstance(v, dict)) or "none"
        raise CrdError(f"{path}: the {kind} CRD has no schema for {version} (versions: {names})",
                       f"{fix}; this export writes {version}")
    jsonschema = validate._jsonschema()
    # A CRD's structural schema is OpenAPI v3's subset of JSON Schema; x-kubernetes-* keys are
    # extensions a JSON Schema validator passes over.
    cls = jsonschema.Draft7Validator
    try:
        cls.check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        raise CrdError(f"{path}: not a usable schema ({exc.message})", fix) from None
    return path, cls(schema)


def validate_crd(document: dict[str, Any], file: Path, validator: Any) -> tuple[list[str], list[str]]:
    """The document against the user's CRD: (problems the API server refuses, fields it does
    not declare and would prune)."""
    problems = validate.schema_problems(document, validator, str(file))
    undeclared = [f"{'.'.join(p)}: not a field {file} declares; the API server would drop it"
                  for p in pruned_fields(document, validator.schema, ())
                  if p[0] not in ("apiVersion", "kind", "metadata")]
    return problems, undeclared


def pruned_fields(value: Any, schema: Any, path: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Paths the API server prunes: keys of an object whose schema lists its properties, does
    not list them, and does not keep unknown fields (x-kubernetes-preserve-unknown-fields)."""
    if not isinstance(schema, dict):
        return []
    out: list[tuple[str, ...]] = []
    if isinstance(value, dict):
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        keeps = schema.get("x-kubernetes-preserve-unknown-fields") is True
        for key, item in value.items():
            here = (*path, str(key))
            if isinstance(properties, dict) and key in properties:
                out += pruned_fields(item, properties[key], here)
            elif isinstance(extra, dict):
                out += pruned_fields(item, extra, here)
            elif isinstance(properties, dict) and not keeps and extra is not True:
                out.append(here)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            out += pruned_fields(item, schema["items"], (*path, str(index)))
    return out
