"""Dockerfile.fullbuild's two targets, parsed: the ROCm path cannot rot unseen while CI builds CPU.

The Dockerfile is read with dockerfile-parse (the Docker client here has no `docker build --check`),
then each target's graph is resolved with the very build args `invoke build` passes for it: the
stages the default target (`runtime`) reaches through FROM, COPY --from and RUN --mount from=,
and their build order. The two graphs must share every stage but each target's framework,
dependencies and runtime platform layer (and the dependency chains behind them), and each source's
fetch variant; every ARG a reached stage reads must come from `invoke build`.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project
from vllmstack.image import build, cpu
from vllmstack.image.patches import VerifyReport

ROOT = Path(__file__).resolve().parents[1]
VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")
# Each target's own stages: its selector picks, and what only they reach.
OWN = {
    "rocm": {"framework-rocm", "dependencies-rocm", "runtime-rocm", "flash-attn-build",
             "aiter-build", "flash-attn-source", "flash-attn-fetched", "aiter-source",
             "aiter-fetched", "aiter-remote", "flash-attn-remote"},
    "cpu": {"framework-cpu", "dependencies-cpu", "runtime-cpu", "onednn-fetched", "onednn-remote"},
}
# The stages both targets run, in the order they are built (fetch, verify and apply, build, labels).
SHARED = ["source-base", "vllm-fetched", "vllm-source", "framework-base", "dependencies",
          "vllm-build", "runtime"]


@dataclass
class Stage:
    name: str
    base: str  # the FROM expression, unexpanded
    args: list[str] = field(default_factory=list)  # ARGs declared in the stage
    edges: list[str] = field(default_factory=list)  # COPY --from / RUN --mount from=
    text: list[str] = field(default_factory=list)  # every instruction, as written


def load(path: Path) -> DockerfileParser:
    # A file object: given a path not named `Dockerfile`, the parser takes it for a folder.
    return DockerfileParser(fileobj=io.BytesIO(path.read_bytes()))


def parse(path: Path) -> tuple[dict[str, str | None], dict[str, Stage]]:
    """(global ARGs with their defaults, the stages by name) of a Dockerfile."""
    parser = load(path)
    global_args: dict[str, str | None] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for item in parser.structure:
        instruction, value = item["instruction"], item["value"]
        if instruction == "COMMENT":
            continue
        if instruction == "FROM":
            parts = value.split()
            assert len(parts) == 3 and parts[1].upper() == "AS", f"unnamed stage: FROM {value}"
            assert parts[2] not in stages, f"stage {parts[2]} defined twice"
            current = stages[parts[2]] = Stage(parts[2], parts[0])
            continue
        if instruction == "ARG":
            name, _, default = value.partition("=")
            if current is None:
                global_args[name] = default if "=" in value else None
            else:
                current.args.append(name)
            continue
        assert current is not None, f"{instruction} before the first FROM"
        current.text.append(f"{instruction} {value}")
        current.edges += re.findall(r"(?:--|,)from=([\w.-]+)", value)
    return global_args, stages


def expand(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: expand(values.get(m.group(1), ""), values), text)


@dataclass
class Graph:
    order: list[str]  # reached stages, each after the stages it needs
    bases: dict[str, str]  # stage -> what its FROM resolved to


def resolve_graph(stages: dict[str, Stage], values: dict[str, str], top: str = "runtime") -> Graph:
    bases = {name: expand(stage.base, values) for name, stage in stages.items()}
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"cycle: {' -> '.join((*path, name))}"
        if name in order:
            return
        stage = stages[name]
        for dep in [bases[name], *stage.edges]:
            if dep in stages:
                visit(dep, (*path, name))
        order.append(name)

    visit(top, ())
    return Graph(order, {name: bases[name] for name in order})


def cpu_inputs() -> cpu.SourceInputs:
    folder = Path("/nonexistent")
    return cpu.SourceInputs(folder, folder / "vllm-0.31.0.tar.gz", "ab" * 32, "2.13.0+cpu", "cd" * 32)


def plan_args(target: str) -> dict[str, str]:
    """The --build-arg values `invoke build` passes for `target`, from the shipped profiles."""
    project = Project(ROOT)
    resolved = resolve(project, platform="cpu" if target == "cpu" else "r9700", environ={})
    assert build.target_of(resolved).name == target
    plan = build.plan_build(project, resolved, VerifyReport([]),
                            inputs=cpu_inputs() if target == "cpu" else None)
    argv = plan.argv
    return dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--build-arg")


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str | None], dict[str, Stage]]:
    return parse(ROOT / build.BUILD_FILE)


@pytest.fixture(scope="module")
def graphs(dockerfile: tuple[dict[str, str | None], dict[str, Stage]]) -> dict[str, Graph]:
    global_args, stages = dockerfile
    out = {}
    for target in build.TARGETS:
        values = {k: v for k, v in global_args.items() if v is not None}
        values.update(plan_args(target))
        out[target] = resolve_graph(stages, values)
    return out


def test_both_targets_share_every_stage_but_their_own(graphs: dict[str, Graph]) -> None:
    rocm, cpu_graph = set(graphs["rocm"].order), set(graphs["cpu"].order)
    shared = rocm & cpu_graph
    assert set(SHARED) <= shared
    # What differs: each target's own stages, and where vLLM's source comes from (the fetch
    # variant: a mirror for rocm, the pinned sdist for cpu); nothing else.
    assert rocm - shared == OWN["rocm"] | {"vllm-remote"}
    assert cpu_graph - shared == OWN["cpu"] | {"vllm-sdist"}
    assert shared == set(SHARED)


def test_shared_stages_run_in_the_same_order(
        graphs: dict[str, Graph], dockerfile: tuple[dict[str, str | None], dict[str, Stage]]) -> None:
    """BuildKit runs stages that do not need each other in parallel: the order is which shared
    stage needs which, and it is the same for both targets."""
    _, stages = dockerfile
    orders = {}
    for target, graph in graphs.items():
        needs = {name: {d for d in [graph.bases[name], *stages[name].edges] if d in stages}
                 for name in graph.order}
        closure: dict[str, set[str]] = {}
        for name in graph.order:  # every stage comes after what it needs
            closure[name] = set().union(*(closure[d] | {d} for d in needs[name]))
        # What `dependencies` needs is the target's own chain (ROCm's wheels are built on the
        # framework; oneDNN is only fetched), so only what comes after it is compared.
        orders[target] = {(a, b) for b in SHARED for a in closure[b]
                          if a in SHARED and b != "dependencies"}
    assert orders["rocm"] == orders["cpu"]
    # fetch -> verify and apply -> build -> runtime; the build also needs the framework and deps.
    for before, after in [("source-base", "vllm-fetched"), ("vllm-fetched", "vllm-source"),
                          ("vllm-source", "vllm-build"), ("framework-base", "vllm-build"),
                          ("dependencies", "vllm-build"), ("vllm-build", "runtime"),
                          ("framework-base", "runtime")]:
        assert (before, after) in orders["cpu"], (before, after)


def test_only_the_framework_and_runtime_layers_pick_the_base_image(
        graphs: dict[str, Graph], dockerfile: tuple[dict[str, str | None], dict[str, Stage]]) -> None:
    _, stages = dockerfile
    assert graphs["rocm"].bases["framework-base"] == "framework-rocm"
    assert graphs["cpu"].bases["framework-base"] == "framework-cpu"
    assert graphs["cpu"].bases["framework-cpu"] == cpu.DEBIAN_BASE
    assert graphs["rocm"].bases["framework-rocm"] == plan_args("rocm")["ROCM_IMAGE"]
    assert graphs["cpu"].bases["runtime"] == "runtime-cpu"
    for name in ("vllm-build", "runtime-cpu", "runtime-rocm"):
        assert stages[name].base in ("framework-base", "${PLATFORM_RUNTIME}")


def test_shared_stages_do_not_branch_on_the_target(
        dockerfile: tuple[dict[str, str | None], dict[str, Stage]]) -> None:
    """A target difference inside a shared stage is a flag's value, never a test of the name."""
    _, stages = dockerfile
    for name in SHARED:
        for line in stages[name].text:
            assert not re.search(r"VLLM_TARGET_DEVICE\}?\"?\s*(!?=\s*\"?(rocm|cpu)|in\b)", line), (name, line)
            assert not re.search(r"\b(gfx\d+|/opt/rocm|amdsmi|hip)\b", line, re.I), (name, line)


def test_every_arg_the_reached_stages_read_is_set_by_invoke_build(
        graphs: dict[str, Graph], dockerfile: tuple[dict[str, str | None], dict[str, Stage]]) -> None:
    global_args, stages = dockerfile
    for target, graph in graphs.items():
        args = plan_args(target)
        needed = set()
        for name in graph.order:
            needed |= set(stages[name].args)
            needed |= set(VAR.findall(stages[name].base)) & set(global_args)
        missing = sorted(a for a in needed if a not in args)
        assert not missing, f"{target}: ARGs no build arg sets: {missing}"
        # And invoke build passes nothing the Dockerfile does not declare (a typo would be ignored).
        declared = set(global_args) | {a for s in stages.values() for a in s.args}
        assert set(args) <= declared, (target, set(args) - declared)
        # Empty only where a target has nothing to say: no CMake flags (rocm), no flydsl (cpu).
        empty = {a for a in needed if not args[a]}
        assert empty <= {"VLLM_CMAKE_ARGS", "FLYDSL_VERSION"}, (target, empty)


def test_both_targets_label_the_same_facts() -> None:
    """Pins, the patch set and its list, the vLLM package path and the wheel version on both."""
    project = Project(ROOT)
    shared = {"vllmstack.target", "vllmstack.patches.vllm", "vllmstack.patch-list.vllm",
              "vllmstack.overlay-lock", "vllmstack.overlay-bases", "vllmstack.dockerfile",
              "vllmstack.vllm-package", "vllmstack.vllm-wheel-version", "vllmstack.pin.vllm_ref",
              "vllmstack.pin.vllm_version", "vllmstack.pin.max_jobs"}
    for target in build.TARGETS:
        resolved = resolve(project, platform="cpu" if target == "cpu" else "r9700", environ={})
        labels = build.image_labels(project, resolved, VerifyReport([]),
                                    inputs=cpu_inputs() if target == "cpu" else None)
        assert shared <= set(labels), (target, shared - set(labels))
        patches = sorted(p.name for p in (ROOT / "patches" / "vllm").glob("*.patch"))
        assert labels["vllmstack.patch-list.vllm"].split(",") == patches
        assert labels["vllmstack.vllm-wheel-version"].split("+", 1)[1].startswith(
            "cpu.p" if target == "cpu" else "rocm")


def test_the_dockerfiles_are_well_formed(
        dockerfile: tuple[dict[str, str | None], dict[str, Stage]]) -> None:
    """What `docker build --check` would catch first: unknown stages in --from, ARGs used in a FROM
    that no global ARG declares, required ARGs (${X:?}) a stage reads without declaring."""
    global_args, stages = dockerfile
    for name, stage in stages.items():
        for dep in stage.edges:
            assert dep in stages, f"{name}: --from={dep} is not a stage"
        for var in VAR.findall(stage.base):
            assert var in global_args, f"{name}: FROM reads {var}, which no global ARG declares"
        for line in stage.text:
            for var in re.findall(r"\$\{(\w+):\?", line):
                assert var in stage.args, f"{name}: {var} is required but not an ARG of the stage"
    for extra in ("Dockerfile.cpu",):
        parse_known = load(ROOT / extra).structure
        assert parse_known and parse_known[0]["instruction"] in ("FROM", "ARG", "COMMENT"), extra


def test_the_source_build_runs_only_under_invoke_test_slow(tmp_path: Path) -> None:
    """CI runs `invoke test`: the hour-long compile is deselected there, and `--slow` selects it
    (in the serial integration tier; tests/test_testsuite.py holds each tier's argv)."""
    from vllmstack.core.runner import RecordingRunner
    from vllmstack.devtools.testsuite import SLOW_ONLY, run_test_suite

    def expressions(**kwargs: bool) -> list[str]:
        """The -m expression of each pytest tier, in order."""
        runner = RecordingRunner()
        assert run_test_suite(Project(tmp_path), runner, **kwargs) == 0
        calls = [c for c in runner.calls if "pytest" in c]
        return [c[c.index("-m", c.index("pytest")) + 1] for c in calls]

    assert all(e.endswith(f"not {SLOW_ONLY}") for e in expressions())
    unit, integration = expressions(slow=True)
    assert unit.endswith(f"not {SLOW_ONLY}") and integration.endswith(f"or {SLOW_ONLY}")
    [quick] = expressions(quick=True, slow=True)  # --quick wins: no Docker, so no build
    assert "not docker" in quick and quick.endswith(f"not {SLOW_ONLY}")
    marked = (ROOT / "tests" / "integration" / "test_build_cpu_source.py").read_text()
    assert f"pytest.mark.{SLOW_ONLY}" in marked
