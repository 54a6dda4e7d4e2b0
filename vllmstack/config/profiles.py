"""Layered profiles: one resolver for every task, the dashboard and the benchmarks.

Order, last wins:
  1. schema defaults
  2. the platform layer   env/platforms/<PLATFORM>.env   (and the layers it EXTENDS)
  3. the model profile    env/models/<MODEL_PROFILE>.env (and its EXTENDS, e.g. families/qwen3)
  4. .env                 host values and build pins; it also selects PLATFORM and MODEL_PROFILE
  5. --set KEY=VALUE      repeated, in order
`--platform` and `--model` override the selection made in .env.
Every value keeps the file and line that set it.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllmstack.config.envfiles import KEY_NAME as KEY_NAME  # re-exported: the names every layer uses
from vllmstack.config.envfiles import Line as Line
from vllmstack.config.envfiles import layer_file_problem
from vllmstack.config.envfiles import layer_name_problem as layer_name_problem
from vllmstack.config.envfiles import read_env_file as read_env_file
from vllmstack.config.schema import Schema, as_bool, as_list, is_engine_env_name, load_schema, validate_value
from vllmstack.core.checkout import derived_compose_project
from vllmstack.core.errors import SettingError, StackError
from vllmstack.core.findings import Finding
from vllmstack.core.paths import Project
from vllmstack.core.runner import MASK, is_secret_name, mask_argv

PLATFORM_DIR = "platforms"
MODEL_DIR = "models"
MAX_LAYER_DEPTH = 32  # EXTENDS levels (the shipped profiles use 3), and ${...} nesting
MAX_VALUE_CHARS = 65536  # what a reference may expand to (the longest shipped value is ~200)
REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class Setting:
    key: str
    value: str
    source: str  # "env/models/x.env:12", ".env:3", "--set" or "default"

    @property
    def from_file(self) -> bool:
        return self.source not in ("--set", "default")


@dataclass
class Resolved:
    """The settings of one platform + model profile, with provenance and the problems met."""

    platform: str
    profile: str
    values: dict[str, Setting]
    layers: list[Path]
    problems: list[Finding] = field(default_factory=list)
    # Every assignment in order, so checks can say what overrode what.
    history: dict[str, list[Setting]] = field(default_factory=dict)
    schema: Schema | None = None  # for defaults; loaded on first need when absent

    def get(self, key: str, default: str | None = None) -> str | None:
        setting = self.values.get(key)
        return setting.value if setting is not None else default

    def source(self, key: str) -> str | None:
        setting = self.values.get(key)
        return setting.source if setting is not None else None

    def as_env(self) -> dict[str, str]:
        return {k: s.value for k, s in self.values.items()}

    def secrets(self) -> list[str]:
        """Every secret among the settings, for masking output: the value of a secret key
        (core.runner.is_secret_name) and a secret flag's value inside shell words
        (VLLM_EXTRA_ARGS='--api-key V')."""
        out: list[str] = []
        for key, setting in self.values.items():
            if is_secret_name(key):  # what it overrode too: a finding may quote that
                out += [setting.value, *(s.value for s in self.history.get(key, []))]
                continue
            if "-" not in setting.value and "=" not in setting.value:
                continue
            try:
                words = shlex.split(setting.value)
            except ValueError:
                continue
            for word, masked in zip(words, mask_argv(words), strict=True):
                if word != masked:
                    out.append(word.partition("=")[2] if masked.endswith("=" + MASK) else word)
        return [s for s in out if s]

    # Typed accessors: an unset or empty value falls back to the schema default, so a default is
    # written once (schema.yaml), never restated as `get(...) or <literal>` at a call site.

    def get_str(self, key: str) -> str:
        value = self.get(key)
        if value is None or value == "":
            return self._schema_default(key) or ""
        return value

    def get_int(self, key: str) -> int:
        text = self.get_str(key).strip()
        try:
            return int(text)
        except ValueError:
            raise self._bad(key, text, "a whole number") from None

    def get_float(self, key: str) -> float:
        text = self.get_str(key).strip()
        try:
            number = float(text)
        except ValueError:
            raise self._bad(key, text, "a number") from None
        if not math.isfinite(number):
            raise self._bad(key, text, "a finite number")
        return number

    def get_bool(self, key: str) -> bool:
        return as_bool(self.get_str(key))

    def get_list(self, key: str) -> list[str]:
        return as_list(self.get_str(key))

    def get_raw(self, key: str) -> str:
        """The value as the layers set it ("" when unset), never the schema default: for keys
        whose empty value means something of its own (leave a flag to vLLM, an unset pin)."""
        return self.get(key) or ""

    def _schema_default(self, key: str) -> str | None:
        spec = (self.schema or load_schema()).get(key)
        return spec.default if spec is not None else None

    def _bad(self, key: str, text: str, wanted: str) -> SettingError:
        where = self.source(key) or "default"
        return SettingError(f"{key}={text!r} (set at {where}) is not {wanted}",
                            f"fix {key} at {where} (`invoke check` lists every bad value)")


class ProfileError(StackError):
    """Selection failed (unknown platform or profile); the message says what exists."""


@dataclass
class _Stack:
    project: Project
    order: list[tuple[Path, str, list[Line]]] = field(default_factory=list)
    problems: list[Finding] = field(default_factory=list)

    def display(self, path: Path) -> str:
        try:
            return str(path.relative_to(self.project.root))
        except ValueError:
            return str(path)

    def add_layer(self, name: str, via: str | None, chain: tuple[str, ...] = ()) -> None:
        """Add env/<name>.env after the layers it EXTENDS (depth first, each file once)."""
        problem = layer_name_problem(name)
        if problem:
            self.problems.append(
                Finding("error", "bad-layer-name", f"EXTENDS entry {name!r} {problem}",
                        key="EXTENDS", source=via,
                        fix="name a layer below env/ without the .env suffix, e.g. families/qwen3")
            )
            return
        path = self.project.env_dir / f"{name}.env"
        if name in chain:
            cycle = " -> ".join([*chain, name])
            self.problems.append(
                Finding("error", "layer-cycle", f"layers extend each other in a loop: {cycle}",
                        key="EXTENDS", source=via, fix="remove one EXTENDS entry of the loop")
            )
            return
        if len(chain) >= MAX_LAYER_DEPTH:
            # Each EXTENDS is one call deeper: a 3,000-long chain ended in a RecursionError.
            self.problems.append(
                Finding("error", "layer-depth", f"EXTENDS chains more than {MAX_LAYER_DEPTH} "
                        f"layers deep ({' -> '.join(chain[:3])} -> ... -> {name}); {name} and "
                        "the layers it extends are not read", key="EXTENDS", source=via,
                        fix="flatten the chain: a layer extends a family, a family a base")
            )
            return
        if any(p == path for p, _, _ in self.order):
            return
        if not path.is_file():
            self.problems.append(
                Finding("error", "missing-layer", f"layer {name!r} does not exist ({self.display(path)})",
                        key="EXTENDS", source=via,
                        fix=f"create {self.display(path)} or fix the name")
            )
            return
        refused = layer_file_problem(self.project.root, path)
        if refused:
            self.problems.append(
                Finding("error", "layer-outside", f"layer {self.display(path)} {refused}; it is "
                        "not read", key="EXTENDS", source=via,
                        fix=f"copy the file into env/ instead of linking it ({self.display(path)})")
            )
            return
        display = self.display(path)
        lines, problems = read_env_file(path, display)
        self.problems.extend(problems)
        for line in lines:
            if line.key == "EXTENDS":
                for parent in as_list(line.value):
                    self.add_layer(parent, f"{display}:{line.line}", (*chain, name))
        self.order.append((path, display, lines))


def available(project: Project, kind: str) -> list[str]:
    folder = project.env_dir / kind
    return sorted(p.stem for p in folder.glob("*.env")) if folder.is_dir() else []


def parse_overrides(pairs: Sequence[str]) -> list[tuple[str, str]]:
    """--set KEY=VALUE pairs; ProfileError for one that is not (`=V`, `KEY`): left out with
    exit 0, it made `config` show settings the user did not ask for."""
    out: list[tuple[str, str]] = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not KEY_NAME.fullmatch(key):
            raise ProfileError(f"--set {pair[:80]!r} is not KEY=VALUE",
                               "write --set KEY=VALUE, e.g. --set VLLM_MAX_NUM_SEQS=4")
        out.append((key, value))
    return out


def resolve(
    project: Project,
    *,
    platform: str | None = None,
    model: str | None = None,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
    schema: Schema | None = None,
) -> Resolved:
    """Resolve one platform + model profile. Raises ProfileError only for an unknown selection."""
    schema = schema or load_schema()
    environ = environ or {}
    stack = _Stack(project)
    dotenv_lines: list[Line] = []
    host_file = project.dotenv if project.dotenv.is_file() else project.dotenv_example
    host_display = host_file.name
    if host_file.is_file():
        dotenv_lines, problems = read_env_file(host_file, host_display)
        stack.problems.extend(problems)
        if host_file == project.dotenv_example:
            stack.problems.append(
                Finding("info", "no-dotenv", "no .env here: using the pins and host values of "
                        ".env.example", source=".env.example",
                        fix="cp .env.example .env, then edit it for this machine")
            )
    dotenv_values = {line.key: line.value for line in dotenv_lines}
    sets = parse_overrides(overrides)
    set_values = dict(sets)

    defaults = schema.defaults()
    platform_name = (
        platform or set_values.get("PLATFORM") or dotenv_values.get("PLATFORM")
        or defaults["PLATFORM"]
    )
    model_name = (
        model or set_values.get("MODEL_PROFILE") or dotenv_values.get("MODEL_PROFILE")
        or defaults["MODEL_PROFILE"]
    )
    for kind, name, flag, key, given in (
            (PLATFORM_DIR, platform_name, "--platform", "PLATFORM", platform),
            (MODEL_DIR, model_name, "--model", "MODEL_PROFILE", model)):
        problem = layer_name_problem(name, nested=False)
        if problem:
            where = flag if given else ("--set" if key in set_values else (
                f"{host_display}:{next(ln.line for ln in dotenv_lines if ln.key == key)}"
                if key in dotenv_values else "the schema default"))
            raise ProfileError(
                f"{kind[:-1]} name {name!r} (from {where}) {problem}",
                f"choose one of: {', '.join(available(project, kind)) or 'none'} ({flag} NAME)")
        if not (project.env_dir / kind / f"{name}.env").is_file():
            names = ", ".join(available(project, kind)) or "none"
            raise ProfileError(
                f"unknown {kind[:-1]} {name!r}: env/{kind}/{name}.env does not exist. "
                f"Available: {names}", f"choose one with {flag} NAME")
        refused = layer_file_problem(project.root, project.env_dir / kind / f"{name}.env")
        if refused:
            raise ProfileError(f"env/{kind}/{name}.env {refused}; it is not read",
                               "copy the file into env/ instead of linking it")
    stack.add_layer(f"{PLATFORM_DIR}/{platform_name}", None)
    stack.add_layer(f"{MODEL_DIR}/{model_name}", None)

    values: dict[str, Setting] = {}
    history: dict[str, list[Setting]] = {}

    def assign(key: str, value: str, source: str) -> None:
        setting = Setting(key, value, source)
        values[key] = setting
        history.setdefault(key, []).append(setting)

    for key, value in defaults.items():
        assign(key, value, "default")
    assign("COMPOSE_PROJECT", *derived_compose_project(project.root))  # one per checkout
    for _, display, lines in stack.order:
        for line in lines:
            if line.key != "EXTENDS":
                assign(line.key, line.value, f"{display}:{line.line}")
    for line in dotenv_lines:
        assign(line.key, line.value, f"{host_display}:{line.line}")
    for key, value in sets:
        assign(key, value, "--set")
    # The selection is what was used, whichever layer named it.
    assign("PLATFORM", platform_name, "--platform" if platform else values["PLATFORM"].source)
    assign("MODEL_PROFILE", model_name, "--model" if model else values["MODEL_PROFILE"].source)

    _expand_references(values, environ, stack.problems)
    stack.problems.extend(validate_settings(values, schema))
    return Resolved(
        platform=platform_name,
        profile=model_name,
        values=values,
        layers=[p for p, _, _ in stack.order],
        problems=stack.problems,
        history=history,
        schema=schema,
    )


def _expand_references(
    values: dict[str, Setting], environ: Mapping[str, str], problems: list[Finding]
) -> None:
    """Expand ${NAME} from other settings (recursively), then from the host environment."""
    done: dict[str, str] = {}

    def expand(key: str, active: tuple[str, ...]) -> str:
        if key in done:
            return done[key]
        setting = values[key]

        def lookup(match: re.Match[str]) -> str:
            name = match.group(1)
            if name in values and name != key and name not in active:
                if len(active) >= MAX_LAYER_DEPTH:  # a 3,000-long chain was a RecursionError
                    problems.append(Finding(
                        "error", "reference-depth", f"{key}: ${{...}} references nest more than "
                        f"{MAX_LAYER_DEPTH} deep (from {active[0]}); not expanded", key=key,
                        source=setting.source, fix="write the value out instead of a chain"))
                    return match.group(0)
                return expand(name, (*active, key))
            if name in environ:
                return environ[name]
            problems.append(
                Finding("error", "undefined-reference",
                        f"{key} refers to ${{{name}}}, which no layer or host variable sets"
                        + (" (or refers back to itself)" if name in active or name == key else ""),
                        key=key, source=setting.source,
                        fix=f"set {name} in .env or write the value out")
            )
            return match.group(0)

        value = REFERENCE.sub(lookup, setting.value) if "${" in setting.value else setting.value
        if len(value) > MAX_VALUE_CHARS:
            # A=${B}${B}, B=${C}${C}, ...: each level doubles; forty of them are a terabyte.
            problems.append(Finding(
                "error", "reference-size", f"{key} expands to {len(value)} characters, more "
                f"than {MAX_VALUE_CHARS}; not expanded", key=key, source=setting.source,
                fix="write the value out instead of repeating references"))
            value = setting.value
        done[key] = value
        return value

    for key in list(values):
        expanded = expand(key, ())
        if expanded != values[key].value:
            values[key] = Setting(key, expanded, values[key].source)


def shown_bytes(value: str) -> str:
    """A value with surrogates as the bytes it came from (the environment's undecodable bytes
    are surrogate escapes); a lone surrogate that no byte made (U+D800) is shown escaped."""
    try:
        return repr(value.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:
        return repr(value.encode("utf-8", "backslashreplace"))


def validate_settings(values: Mapping[str, Setting], schema: Schema) -> list[Finding]:
    """Unknown keys (warning, with the closest known name) and type/range problems (error)."""
    problems: list[Finding] = []
    for key, setting in values.items():
        if any(0xD800 <= ord(c) <= 0xDFFF for c in setting.value):
            # Bytes that are not UTF-8 from --set or the environment (files are checked as read).
            problems.append(
                Finding("error", "not-utf8", f"{key} holds bytes that are not UTF-8: "
                        f"{shown_bytes(setting.value)}", key=key,
                        source=setting.source, fix=f"write {key} as UTF-8 text")
            )
            continue
        spec = schema.get(key)
        if spec is None:
            guess = schema.closest(key)
            fix = f"did you mean {guess}?" if guess else "remove it, or see `invoke config --explain`"
            fate = (
                "it is passed to the engine's environment as is"
                if is_engine_env_name(key) else "it is ignored"
            )
            problems.append(
                Finding("warning", "unknown-key", f"{key} is not a known key; {fate}",
                        key=key, source=setting.source, fix=fix)
            )
            continue
        problem = validate_value(spec, setting.value)
        if problem:
            problems.append(
                Finding("error", "bad-value", f"{key} {problem}", key=key, source=setting.source,
                        fix=_value_fix(spec.name, spec.type, spec.choices))
            )
    return problems


def _value_fix(name: str, kind: str, choices: tuple[str, ...] | None) -> str:
    if kind == "json":
        return f"quote the whole value in single quotes: {name}='{{\"key\": \"value\"}}'"
    if choices:
        return f"use one of: {', '.join(c or '(empty)' for c in choices)}"
    examples = {"int": ("a whole number", "4"), "float": ("a number", "0.9"),
                "bool": ("true or false", "true")}
    if kind in examples:
        what, example = examples[kind]
        return f"write {what}, e.g. {name}={example}"
    return f"check the value of {name}"


@dataclass(frozen=True)
class ProfileInfo:
    kind: str  # "platform" | "model"
    name: str
    description: str
    platforms: tuple[str, ...] = ()


def list_profiles(project: Project) -> list[ProfileInfo]:
    """Every platform and model profile with its one-line description."""
    out: list[ProfileInfo] = []
    for kind, folder in (("platform", PLATFORM_DIR), ("model", MODEL_DIR)):
        for name in available(project, folder):
            path = project.env_dir / folder / f"{name}.env"
            if layer_file_problem(project.root, path):
                continue  # resolving it says why; a listing never reads it
            lines, _ = read_env_file(path, name)
            values = {line.key: line.value for line in lines}
            out.append(ProfileInfo(kind, name, values.get("PROFILE_DESCRIPTION", ""),
                                   tuple(as_list(values.get("PROFILE_PLATFORMS")))))
    return out
