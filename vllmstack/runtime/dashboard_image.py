"""The dashboard image: its build context and the `docker build` that works with any builder.

Dockerfile.dashboard uses no BuildKit-only syntax, so a docker client without buildx (whose
default is the classic builder), compose v1's hosts and BuildKit all build it. The context is
assembled under generated/dashboard-build/: the Dockerfile, pyproject.toml, the vllmstack
package and, when the host has one, its CA bundle (pip-ca.crt) for a proxy that re-signs TLS.
The bundle is used only in the build stage and never reaches the final image. An own folder,
not the project root, because the classic builder reads only `.dockerignore`, which is written
for the full build.
"""

from __future__ import annotations

import shutil
from pathlib import Path

DOCKERFILE = "Dockerfile.dashboard"
CONTEXT_DIR = "dashboard-build"  # under generated/
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
CA_IN_CONTEXT = "pip-ca.crt"


def build_context(source: Path, folder: Path, *, ca_bundle: Path | None = CA_BUNDLE) -> Path:
    """A fresh build context in `folder` from the checkout at `source` (Dockerfile.dashboard,
    pyproject.toml, vllmstack/); returns `folder`."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    shutil.copy2(source / DOCKERFILE, folder / "Dockerfile")
    shutil.copy2(source / "pyproject.toml", folder / "pyproject.toml")
    shutil.copytree(source / "vllmstack", folder / "vllmstack",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if ca_bundle is not None and ca_bundle.is_file():
        shutil.copyfile(ca_bundle, folder / CA_IN_CONTEXT)
    return folder


def build_argv(docker: str, image: str, base_image: str, context: Path) -> list[str]:
    """`docker build` of the assembled context; no DOCKER_BUILDKIT: the client's default builder."""
    return [docker, "build", "-f", str(context / "Dockerfile"), "-t", image,
            "--build-arg", f"BASE_IMAGE={base_image}", str(context)]
