"""The shape of the code: small modules, thin tasks.py, imports only downward, no cycles.

The layers and the no-cycle rule are import-linter contracts in pyproject.toml
([tool.importlinter]); `invoke test` runs `lint-imports` as a step and this file runs it too, so a
plain pytest run catches a broken contract. grimp (import-linter's graph builder) reads every
import statement, including those inside functions and under `if TYPE_CHECKING:`: moving an import
into a function does not hide a dependency.
"""

from __future__ import annotations

import importlib.util
import itertools
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
from helpers import ROOT

from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner
from vllmstack.devtools.testsuite import lint_imports_argv, run_test_suite

PACKAGE = ROOT / "vllmstack"
MAX_MODULE_LINES = 500
MAX_TASKS_LINES = 400
INSTALL_HINT = ("import-linter is not installed: python3 -m pip install -e '.[dev]' "
                "(or python3 -m pip install import-linter)")


def line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def package_modules() -> list[Path]:
    """Every *.py of the package; vendored files (none are Python today) do not count."""
    return sorted(p for p in PACKAGE.rglob("*.py")
                  if "__pycache__" not in p.parts and "vendor" not in p.relative_to(PACKAGE).parts)


def test_no_module_is_over_500_lines() -> None:
    modules = package_modules()
    assert modules, f"no modules found under {PACKAGE}"
    over = [(p.relative_to(ROOT), n) for p in modules if (n := line_count(p)) > MAX_MODULE_LINES]
    assert not over, (f"{len(over)} module(s) over {MAX_MODULE_LINES} lines; split each by "
                      "concept:\n" + "\n".join(f"  {path}: {n}" for path, n in over))


def test_tasks_py_is_at_most_400_lines() -> None:
    n = line_count(ROOT / "tasks.py")
    assert n <= MAX_TASKS_LINES, (f"tasks.py has {n} lines (at most {MAX_TASKS_LINES}): tasks "
                                  "parse arguments, call one package function and render")


def test_import_contracts_are_kept() -> None:
    if importlib.util.find_spec("importlinter") is None:
        pytest.fail(INSTALL_HINT)
    done = subprocess.run(lint_imports_argv(), cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, (f"lint-imports: a contract in pyproject.toml "
                                  f"[tool.importlinter] is broken (exit {done.returncode}):\n"
                                  + done.stdout[-6000:] + done.stderr[-3000:])


def strongly_connected(nodes: Iterable[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit): the components of more than one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def shortest_cycle(start: str, members: set[str], edges: dict[str, set[str]]) -> list[str]:
    """start -> ... -> start, fewest imports, within one strongly connected component."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(edges.get(node, set()) & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is in no cycle")  # not reached for a component member


def test_no_import_cycle_between_modules() -> None:
    """Module level, not only package level: an import inside a function counts."""
    try:
        import grimp
    except ImportError:
        pytest.fail(INSTALL_HINT)
    graph = grimp.build_graph("vllmstack", cache_dir=None)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    cycles = []
    for component in strongly_connected(graph.modules, edges):
        cycle = shortest_cycle(component[0], set(component), edges)
        steps = []
        for importer, imported in itertools.pairwise(cycle):
            details = graph.get_import_details(importer=importer, imported=imported)
            where = f" (l.{details[0]['line_number']})" if details else ""
            steps.append(f"{importer}{where} -> ")
        cycles.append("".join(steps) + cycle[-1]
                      + (f"   [{len(component)} modules in this tangle: {', '.join(component)}]"
                         if len(component) > len(cycle) - 1 else ""))
    assert not cycles, "import cycles (line = the import in the importer):\n" + "\n".join(
        f"  {c}" for c in cycles)


def test_invoke_test_quick_runs_lint_imports_before_pytest(tmp_path: Path) -> None:
    runner = RecordingRunner()
    assert run_test_suite(Project(tmp_path), runner, quick=True) == 0
    steps = [" ".join(call) for call in runner.calls]
    lint = " ".join(lint_imports_argv(sys.executable))
    assert lint in steps, steps
    pytest_step = next(i for i, step in enumerate(steps) if " -m pytest " in step)
    assert steps.index(lint) < pytest_step
