"""Layer names resolve inside env/ only (issue 11, item 2).

`--model`, `--platform`, MODEL_PROFILE/PLATFORM in .env or --set, EXTENDS in any layer and
`import-env --name/--extends` name files below env/. An absolute path or `..` is refused with
where the name came from; nothing outside env/ is ever read or written.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vllmstack.config import migrate
from vllmstack.config.profiles import ProfileError, layer_name_problem, resolve
from vllmstack.core.paths import Project

ENVIRON = {"HOME": "/home/u"}


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """An env file outside the project that sets something dangerous if it were ever loaded."""
    path = tmp_path / "evil" / "x.env"
    path.parent.mkdir()
    path.write_text("VLLM_BIND=0.0.0.0\nPROFILE_DESCRIPTION=outside\nVLLM_MODEL=evil/model\n")
    return path


def _up_to(project: Project, kind: str, target: Path) -> str:
    """A relative name from env/<kind>/ to `target` (without .env), as an attacker writes it."""
    depth = len((project.env_dir / kind).resolve().parts) - 1
    return "../" * depth + str(target.with_suffix("")).lstrip("/")


@pytest.mark.parametrize("flag", ["model", "platform"])
def test_selection_with_dotdot_or_an_absolute_path_is_refused(
        project: Project, outside: Path, flag: str) -> None:
    kind = "models" if flag == "model" else "platforms"
    for name in (_up_to(project, kind, outside), str(outside.with_suffix(""))):
        with pytest.raises(ProfileError) as info:
            if flag == "model":
                resolve(project, model=name, environ=ENVIRON)
            else:
                resolve(project, platform=name, environ=ENVIRON)
        assert f"--{flag}" in info.value.cause
        assert ("'..'" in info.value.cause) or ("absolute" in info.value.cause)
        assert info.value.fix and ("qwen3-0.6b" if flag == "model" else "cpu") in info.value.fix


def test_selection_from_dotenv_or_set_names_its_source(project: Project, outside: Path) -> None:
    name = _up_to(project, "models", outside)
    (project.root / ".env").write_text(f"PLATFORM=cpu\nMODEL_PROFILE={name}\n")
    with pytest.raises(ProfileError, match=r"from \.env:2"):
        resolve(project, environ=ENVIRON)
    (project.root / ".env").write_text("PLATFORM=cpu\n")
    with pytest.raises(ProfileError, match="from --set"):
        resolve(project, overrides=[f"MODEL_PROFILE={name}"], environ=ENVIRON)


@pytest.mark.parametrize("extends", ["../evil/x", "/etc/hostname", "families/../../x",
                                     "families/qwen3\nVLLM_BIND", "./families/qwen3"])
def test_extends_outside_env_is_a_finding_and_nothing_is_read(
        project: Project, outside: Path, extends: str) -> None:
    layer = project.env_dir / "models" / "qwen3-0.6b.env"
    lines = layer.read_text().splitlines()
    escaped = extends.replace("\n", "\\n")  # a double-quoted dotenv value decodes \n
    lines.insert(1, f'EXTENDS="{escaped}"')
    layer.write_text("\n".join(lines) + "\n")
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b", environ=ENVIRON)
    bad = [p for p in resolved.problems if p.code == "bad-layer-name"]
    assert bad and bad[0].severity == "error" and bad[0].key == "EXTENDS"
    assert bad[0].source == "env/models/qwen3-0.6b.env:2"
    assert resolved.get("VLLM_BIND") == "127.0.0.1"
    assert all(project.env_dir.resolve() in p.resolve().parents for p in resolved.layers)


def test_an_escaped_newline_in_extends_never_reaches_a_generated_comment() -> None:
    assert layer_name_problem("x\nVLLMSTACK_VLLM_BIND=0.0.0.0") is not None
    assert layer_name_problem("families/qwen3.6") is None
    assert layer_name_problem("qwen3-0.6b", nested=False) is None
    assert layer_name_problem("families/qwen3", nested=False) is not None
    assert layer_name_problem("..") is not None and layer_name_problem("a/..") is not None
    assert layer_name_problem("a/.") is not None and layer_name_problem("") is not None


def test_import_env_name_and_extends_stay_inside_env(project: Project, tmp_path: Path) -> None:
    source = tmp_path / "old.env"
    source.write_text("VLLM_MAX_NUM_SEQS=4\n")
    mappings = migrate.map_env_file(source)
    for name, extends in ((f"../../../../{tmp_path.name}/pwned", None), ("/tmp/pwned", None),
                          ("sub/name", None), ("ok", "../../etc/x"), ("ok", "/etc/x")):
        with pytest.raises(migrate.ImportEnvError):
            migrate.write_profile(project, name, source, mappings, extends)
    assert not list(tmp_path.rglob("pwned*")) and not (Path("/tmp") / "pwned.env").exists()
    assert not (project.env_dir / "models" / "ok.env").exists()


def test_invoke_check_with_a_traversing_model_is_one_clear_error(
        project: Project, outside: Path) -> None:
    name = _up_to(project, "models", outside)
    out = subprocess.run([sys.executable, "-m", "invoke", "check", "--platform", "cpu",
                          "--model", name], cwd=project.root, text=True, capture_output=True,
                         check=False)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and "outside" not in out.stdout
    assert "error: model name" in out.stderr and "--model" in out.stderr
