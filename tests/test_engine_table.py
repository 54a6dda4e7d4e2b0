"""One table per engine kind (vllmstack/config/engines): every layer asks it, none names an engine.

A difference between vLLM and llama.cpp is a field of `EngineKind`; a test on the engine's name
anywhere else (`engine_of(r) == LLAMACPP`, `spec.engine == "llamacpp"`, `get_str("ENGINE") ==
...`) is what made a new kind a grep through 16 files. The scan below fails on one, and is itself
tested on the shapes it must catch and those it must let through.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import ROOT

from vllmstack.config.engines import llamacpp, vllm
from vllmstack.config.engines.kind import EngineKind, Placement
from vllmstack.config.engines.table import ENGINES, UnknownEngineError, engine_kind, kind_named
from vllmstack.config.profiles import list_profiles, resolve
from vllmstack.config.schema import load_schema
from vllmstack.core.paths import Project

PACKAGE = ROOT / "vllmstack"
TABLE = PACKAGE / "config" / "engines"
NAMES = frozenset(ENGINES)
CONSTANTS = frozenset({"VLLM", "LLAMACPP", "KIND"})  # the old name constants, a kind's record
ENGINE_CALLS = frozenset({"engine_of", "engine_name"})
SHIPPED = Project(ROOT)
ENVIRON = {"HOME": "/home/op"}


def _word(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_engine_expr(node: ast.AST) -> bool:
    """An expression that holds an engine's name: engine_of(...), x.engine, engine, ENGINE read."""
    if isinstance(node, ast.Call):
        name = _word(node.func)
        if name in ENGINE_CALLS:
            return True
        return any(isinstance(a, ast.Constant) and a.value == "ENGINE" for a in node.args)
    word = _word(node)
    return word is not None and "engine" in word.lower() and word not in ("engines",)


def engine_comparisons(source: str) -> list[int]:
    """Lines that compare an engine's name (or a kind's record) outside the table."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        named = any(_word(o) in CONSTANTS for o in operands)
        literal = any(isinstance(o, ast.Constant) and o.value in NAMES for o in operands)
        engine = any(_is_engine_expr(o) for o in operands)
        call = any(isinstance(o, ast.Call) and _word(o.func) in ENGINE_CALLS for o in operands)
        if named or call or (literal and engine):
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("snippet", [
    "if engine_of(resolved) == LLAMACPP: pass",
    "x = 1 if engine_of(r) != 'vllm' else 2",
    "ok = spec.engine == 'llamacpp'",
    "ok = engine in ('vllm', 'llamacpp') and engine == 'vllm'",
    "ok = resolved.get_str('ENGINE') == 'llamacpp'",
    "ok = kind is vllm.KIND",
    "ok = vt.engine != LLAMACPP",
])
def test_the_scan_catches_an_engine_name_test(snippet: str) -> None:
    assert engine_comparisons(snippet), snippet


@pytest.mark.parametrize("snippet", [
    "ok = component.name == 'llamacpp'",  # a pinned component, not an engine kind
    "ok = engine_kind(r).model_file",
    "f = FIXES[engine_of(r)]",
    "ok = name in ENGINE_SOURCES",
    "ok = service == 'vllm'",  # the compose service's name
])
def test_the_scan_lets_table_lookups_and_other_names_through(snippet: str) -> None:
    assert not engine_comparisons(snippet), snippet


def test_no_engine_name_is_compared_outside_the_table() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(TABLE) or "__pycache__" in path.parts:
            continue
        for line in engine_comparisons(path.read_text(encoding="utf-8")):
            found.append(f"{path.relative_to(ROOT)}:{line}")
    assert not found, ("an engine-name comparison outside vllmstack/config/engines; give "
                       "EngineKind a field and ask the table instead:\n  " + "\n  ".join(found))


def test_every_kind_is_named_by_the_schema_and_complete() -> None:
    choices = load_schema().keys["ENGINE"].choices
    assert sorted(ENGINES) == sorted(choices or ())
    for name, kind in ENGINES.items():
        assert isinstance(kind, EngineKind) and kind.name == name and kind_named(name) is kind
        assert kind.entrypoint and kind.routes and kind.display
        assert kind.model_key in load_schema().keys and kind.image_key in load_schema().keys
    assert kind_named("") is vllm.KIND  # ENGINE left empty is vLLM
    with pytest.raises(UnknownEngineError, match="none of vllm, llamacpp"):
        kind_named("sglang")
    # A bad ENGINE is the resolver's error (file and line); the rules meanwhile see the default.
    typo = resolve(SHIPPED, model="tiny", platform="cpu", overrides=["ENGINE=vlm"], environ=ENVIRON)
    assert [p.key for p in typo.problems if p.severity == "error"] == ["ENGINE"]
    assert engine_kind(typo) is vllm.KIND
    from vllmstack.runtime.native.command import native_placement  # the per-kind tables agree
    assert native_placement(SHIPPED, typo, ENVIRON).program[0].endswith("/bin/vllm")


def test_a_placement_changes_only_the_program_host_and_paths() -> None:
    container = resolve(SHIPPED, model="tiny", platform="cpu", environ=ENVIRON)
    inside = vllm.build(container, Placement()).argv
    assert inside[:2] == ["vllm", "serve"] and "0.0.0.0" in inside
    host = vllm.build(container, Placement(host="127.0.0.1", chat_template_dir="/ck/chat-templates",
                                           program=("/env/bin/vllm",))).argv
    assert host[:2] == ["/env/bin/vllm", "serve"]
    differ = [(a, b) for a, b in zip(inside, host, strict=True) if a != b]
    assert differ[0] == ("vllm", "/env/bin/vllm") and ("0.0.0.0", "127.0.0.1") in differ
    assert all(a.endswith(b.rsplit("/", 1)[-1]) for a, b in differ[2:])  # the template's folder
    assert Placement(program=("python3", "sim.py")).unplace(["python3", "sim.py", "serve", "m"],
                                                            "vllm") == ["vllm", "serve", "m"]


@pytest.mark.parametrize("model", [p.name for p in list_profiles(SHIPPED) if p.kind == "model"])
def test_each_shipped_profile_builds_with_its_kind(model: str) -> None:
    resolved = resolve(SHIPPED, model=model, platform="cpu", environ=ENVIRON)
    kind = engine_kind(resolved)
    assert kind in (vllm.KIND, llamacpp.KIND)
    argv = kind.build(resolved, Placement()).argv
    assert tuple(argv[:len(kind.entrypoint)]) == kind.entrypoint


def test_the_native_argv_is_the_one_check_built(tmp_path: Path) -> None:
    """`check --runtime native` builds the argv for the host placement; the native runtime runs
    exactly that list (it is handed over, never built a second time)."""
    from vllmstack.checks.registry import run_checks
    from vllmstack.runtime.native.command import native_serve_command

    resolved = resolve(SHIPPED, model="tiny", platform="cpu", environ=ENVIRON)
    _, ctx = run_checks(SHIPPED, resolved, ENVIRON, runtime="native")
    assert ctx.command is not None
    assert ctx.command.argv[0].endswith("/bin/vllm") and ctx.command.argv[1] == "serve"
    assert "--host" in ctx.command.argv
    assert ctx.command.argv[ctx.command.argv.index("--host") + 1] == resolved.get_str("VLLM_BIND")
    ran = native_serve_command(SHIPPED, resolved, ENVIRON, command=ctx.command)
    assert ran.argv == ctx.command.argv
    assert native_serve_command(SHIPPED, resolved, ENVIRON).argv == ctx.command.argv  # same build
    _, container = run_checks(SHIPPED, resolved, ENVIRON, runtime="compose")
    assert container.command is not None and container.command.argv[:2] == ["vllm", "serve"]
