"""The domain errors of config/ and image/ are StackErrors that keep their old bases and messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllmstack.config.profiles import ProfileError, resolve
from vllmstack.config.view import ConfigError, render_config
from vllmstack.config.vllm_args import ArgvError
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.image.build import BuildError, rocm_wheel_target
from vllmstack.image.patches import PatchError, parse_component_pairs
from vllmstack.image.sources import GitTool, SourceError, download_sdist


@pytest.mark.parametrize(("error", "extra_base"), [
    (ProfileError, None), (ConfigError, None), (ArgvError, ValueError), (BuildError, None),
    (PatchError, ValueError), (SourceError, ValueError),
])
def test_every_domain_error_is_a_stack_error(error: type[Exception],
                                             extra_base: type[Exception] | None) -> None:
    assert issubclass(error, StackError)
    if extra_base is not None:
        assert issubclass(error, extra_base)


def test_messages_stay_whole_and_the_fix_comes_apart(project: Project) -> None:
    with pytest.raises(BuildError) as build_err:
        rocm_wheel_target("rocm/dev:latest", "gfx1201")
    assert str(build_err.value).endswith("must start with X.Y (e.g. :10.1.0-full)")
    assert build_err.value.render().splitlines()[-1].startswith("fix:   use a tag like ")

    with pytest.raises(PatchError, match="unknown component 'vlm'"):
        parse_component_pairs(["vlm=v1"], "--ref")

    resolved = resolve(project, overrides=["VLLM_EXTRA_ARGS='--a"], environ={})
    with pytest.raises(ConfigError, match="VLLM_EXTRA_ARGS is not valid shell words") as cfg:
        render_config(resolved, vllm_args=True)
    assert cfg.value.fix is not None and "VLLM_EXTRA_ARGS" in cfg.value.fix


def test_a_repository_that_cannot_be_mirrored_says_what_to_check(tmp_path: Path) -> None:
    runner = RecordingRunner()
    runner.respond(["git"], lambda argv: Result(argv, 128, "", "fatal: unreachable")
                   if "fetch" in argv else None)
    git = GitTool(runner, tmp_path, {})
    with pytest.raises(SourceError, match=r"cannot mirror \S+/x\.git: git fetch failed") as err:
        git.ensure_mirror("https://example.invalid/x.git")
    assert err.value.fix is not None and "URL" in err.value.fix


def test_a_cached_sdist_is_used_without_the_network(tmp_path: Path) -> None:
    archive = tmp_path / "vllm-1.0.tar.gz"
    archive.write_bytes(b"")
    assert download_sdist(tmp_path, "vllm", "1.0") == archive
