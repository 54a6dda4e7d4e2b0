"""Every file `up` renders into generated/ (compose override, compose.env, resolved.env, argv), byte
for byte, for every shipped model profile on every shipped platform.

tests/data/generated_files_golden.json was rendered by the stack before its package was split into
layers (main fe30ade), so the restructuring provably left these files unchanged. The project root
is written as <ROOT>. When a change is intended, regenerate it and review the diff:

  VLLMSTACK_REGEN_GOLDEN=1 python3 -m pytest -q tests/test_generated_golden.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from helpers import copy_project

from vllmstack.config.profiles import resolve
from vllmstack.config.vllm_args import build_serve_argv
from vllmstack.core.checkout import default_compose_project
from vllmstack.core.paths import Project
from vllmstack.runtime import compose_files, engine_env

GOLDEN = Path(__file__).resolve().parent / "data" / "generated_files_golden.json"
ENVIRON = {"HOME": "/home/u", "PATH": "/usr/bin"}
IDS = engine_env.HostIds(1000, 1000, 992, 44)
PACKAGE_DIR = "/opt/vllm-package"  # a vllmstack-built image: overlays are mounted too


def render_all(project: Project, pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        model, platform = pair.split(" on ")
        resolved = resolve(project, platform=platform, model=model, overrides=[], environ=ENVIRON)
        command = build_serve_argv(resolved)
        paths = engine_env.stack_paths(resolved, ENVIRON)
        override, notes = compose_files.build_override(
            project, resolved, command, runtime="compose", ids=IDS, paths=paths,
            package_dir=PACKAGE_DIR)
        env = compose_files.interpolation_env(resolved, IDS, paths)
        compose_files.write_rendered(project, resolved, command, override, env, notes)
        root = str(project.root)
        # The default Compose project name is derived from the checkout's path, like <ROOT>.
        checkout = default_compose_project(project.root)
        out[pair] = {
            "files": {p.name: p.read_text().replace(root, "<ROOT>")
                      .replace(checkout, "vllmstack-<CHECKOUT>")
                      for p in sorted(project.generated.iterdir())},
            "notes": [n.replace(root, "<ROOT>") for n in notes],
        }
    return out


def test_rendered_files_match_the_golden_copy(tmp_path: Path) -> None:
    golden = json.loads(GOLDEN.read_text())
    project = Project(copy_project(tmp_path))
    rendered = render_all(project, sorted(golden))
    if os.environ.get("VLLMSTACK_REGEN_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(rendered, indent=1, sort_keys=True) + "\n")
    assert len(golden) >= 30  # every shipped profile on every platform, not a sample
    for pair in sorted(golden):
        for name, text in golden[pair]["files"].items():
            assert rendered[pair]["files"][name] == text, f"{pair}: generated/{name} changed"
        assert rendered[pair]["notes"] == golden[pair]["notes"], pair
