"""Wheel files as pip sees them: name, version and tags from the file name (PEP 427), and whether
an interpreter accepts them. install-engine reads its --wheels folders and the source build's
wheel with these."""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from vllmstack.core.errors import StackError

# {name}-{version}(-{build})?-{python tag}-{abi tag}-{platform tag}.whl (PEP 427).
WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-"
                   r"(?P<plat>[^-]+)\.whl$")


class WheelError(StackError):
    """A wheel that cannot be installed as asked; `fix` says what to do instead."""


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str  # normalised (PEP 503)
    version: str
    python_tags: tuple[str, ...]
    abi: str

    @property
    def public_version(self) -> str:
        return self.version.split("+", 1)[0]


def normalise_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_wheel(path: Path) -> Wheel | None:
    match = WHEEL.match(path.name)
    if not match:
        return None
    return Wheel(path, normalise_name(match["name"]), match["version"],
                 tuple(match["py"].split(".")), match["abi"])


def scan_wheels(folder: Path) -> list[Wheel]:
    return [w for w in map(parse_wheel, sorted(folder.glob("*.whl"))) if w is not None]


def wheel_fits_python(wheel: Wheel, python: tuple[int, int]) -> bool:
    """Whether pip on this Python would accept the wheel's python/abi tags."""
    ours = python[0] * 100 + python[1]
    for tag in wheel.python_tags:
        if tag in ("py3", f"py{python[0]}{python[1]}") or tag == f"py{python[0]}":
            return True
        digits = tag[2:]
        if tag.startswith("cp") and digits.isdigit():
            theirs = int(digits[0]) * 100 + int(digits[1:] or 0)
            # abi3 wheels run on their Python and every later one.
            if theirs == ours or (wheel.abi == "abi3" and theirs <= ours):
                return True
    return False


def describe_tags(wheel: Wheel) -> str:
    tags = []
    for tag in wheel.python_tags:
        digits = tag[2:]
        if tag.startswith("cp") and digits.isdigit():
            tags.append(f"CPython {digits[0]}.{digits[1:]}" + (" or later" if wheel.abi == "abi3" else ""))
        else:
            tags.append(tag)
    return ", ".join(tags)


def needed_glibc(path: Path) -> tuple[str, tuple[int, int]] | None:
    """The newest GLIBC_x.y symbol version a shared library in the wheel needs, and which one."""
    newest: tuple[str, tuple[int, int]] | None = None
    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            if name.endswith(".so") or ".so." in name:
                found = re.findall(rb"GLIBC_(\d+)\.(\d+)", archive.read(name))
                version = max(((int(a), int(b)) for a, b in found), default=None)
                if version is not None and (newest is None or version > newest[1]):
                    newest = (name, version)
    return newest


def check_built_wheel(path: Path, version: str, python: tuple[int, int],
                      host_glibc: tuple[int, int] | None) -> None:
    """The wheel is the build's vLLM at `version`, for the environment's Python and this host's C
    library (a wheel compiled in an image is tagged linux_x86_64, not manylinux: nothing else
    says which glibc it needs, and the engine would only fail at import)."""
    wheel = parse_wheel(path)
    if wheel is None or wheel.name != "vllm" or wheel.version != version:
        raise WheelError(f"{path} is not the vllm {version} wheel",
                                 "give the wheel invoke build made (or --from-image IMAGE)")
    if not wheel_fits_python(wheel, python):
        raise WheelError(
            f"the wheel {path.name} is for {describe_tags(wheel)}, but the environment's Python is "
            f"{python[0]}.{python[1]}", "pass --python with a matching interpreter (e.g. --python "
            "python3.11, the base image's)")
    needed = needed_glibc(path) if host_glibc is not None else None
    if needed is not None and host_glibc is not None and needed[1] > host_glibc:
        raise WheelError(
            f"{needed[0]} in {path.name} needs the C library at GLIBC {needed[1][0]}.{needed[1][1]}; "
            f"this host has {host_glibc[0]}.{host_glibc[1]}, so vLLM cannot load here natively",
            "serve it in its image instead (invoke up --platform cpu, Compose), or install on a host "
            f"with glibc {needed[1][0]}.{needed[1][1]} or newer (the cpu target compiles with Debian "
            "trixie's gcc-12 and C library)")
