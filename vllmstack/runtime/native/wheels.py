"""Wheel files as pip sees them: name, version and tags from the file name (PEP 427, parsed by
`packaging`, pip's own library), and whether an interpreter accepts them. install-engine reads
its --wheels folders and the source build's wheel with these."""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from vllmstack.core.errors import StackError
from vllmstack.runtime.native import elf


class WheelError(StackError):
    """A wheel that cannot be installed as asked; `fix` says what to do instead."""


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str  # normalised (PEP 503)
    version: str  # normalised (PEP 440), as a wheel's file name spells it
    tags: frozenset[Tag]  # the file name's compressed tag set, expanded

    @property
    def public_version(self) -> str:
        return Version(self.version).public

    @property
    def platforms(self) -> tuple[str, ...]:
        """e.g. ("manylinux_2_28_x86_64",), or ("linux_x86_64",)."""
        return tuple(sorted({tag.platform for tag in self.tags}))


def normalise_name(name: str) -> str:
    return str(canonicalize_name(name))


def parse_wheel(path: Path) -> Wheel | None:
    """None for a file pip would not take as a wheel either (a name without its five or six
    parts, a version that is not PEP 440): callers name what they looked for instead."""
    try:
        name, version, _build, tags = parse_wheel_filename(path.name)
    except (InvalidWheelFilename, InvalidVersion):
        return None
    return Wheel(path, str(name), str(version), tags)


def scan_wheels(folder: Path) -> list[Wheel]:
    return [w for w in map(parse_wheel, sorted(folder.glob("*.whl"))) if w is not None]


def wheel_fits_python(wheel: Wheel, python: tuple[int, int]) -> bool:
    """Whether pip on this CPython would accept the wheel's python/abi tags: the tags it accepts,
    as pip lists them, for the wheel's own platforms (the platform is another question: the C
    library's is `needed_glibc`). The ABI is named, not read from this interpreter: the engine's
    Python is another one, and packaging would otherwise take debug or free-threading flags from
    this one."""
    interpreter = f"cp{python[0]}{python[1]}"
    accepted = chain(cpython_tags(python, abis=[interpreter], platforms=wheel.platforms),
                     compatible_tags(python, interpreter, platforms=wheel.platforms))
    return not wheel.tags.isdisjoint(accepted)


def describe_tags(wheel: Wheel) -> str:
    """The Pythons a wheel is for, in words: "CPython 3.12", "CPython 3.8 or later" (abi3)."""
    described = []
    # By length first: cp39 before cp310.
    for interpreter in sorted({t.interpreter for t in wheel.tags}, key=lambda t: (len(t), t)):
        digits = interpreter[2:]
        if interpreter.startswith("cp") and digits.isdigit():
            abi3 = any(t.abi == "abi3" for t in wheel.tags if t.interpreter == interpreter)
            described.append(f"CPython {digits[0]}.{digits[1:]}" + (" or later" if abi3 else ""))
        else:
            described.append(interpreter)
    return ", ".join(described)


# manylinux_X_Y (PEP 600) and the older names it replaced (PEP 513, 571, 599): the glibc each needs.
# Read here because packaging has no public way to ask a tag's glibc: its _manylinux module is
# private and answers only which tags this host's glibc accepts.
MANYLINUX = re.compile(r"^manylinux_(\d+)_(\d+)_")
LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


def tag_glibc(wheel: Wheel) -> tuple[int, int] | None:
    """The glibc the wheel's platform tags promise to run on (the oldest, as pip takes any of
    them); None for a plain linux_x86_64 tag, which promises nothing."""
    found = []
    for tag in wheel.platforms:
        match = MANYLINUX.match(tag)
        legacy = LEGACY_MANYLINUX.get(tag.split("_", 1)[0])
        if match:
            found.append((int(match[1]), int(match[2])))
        elif legacy:
            found.append(legacy)
    return min(found, default=None)


def needed_glibc(path: Path) -> tuple[str, tuple[int, int]] | None:
    """What in the wheel needs the newest C library, and which: its platform tag (manylinux_X_Y),
    or the newest GLIBC_x.y symbol version a shared library in it needs (elf.needed_glibc). The
    libraries decide: a wheel compiled in an image is tagged linux_x86_64, and says nothing."""
    wheel = parse_wheel(path)
    tagged = tag_glibc(wheel) if wheel is not None else None
    newest: tuple[str, tuple[int, int]] | None = (
        (f"the platform tag {'.'.join(wheel.platforms)}", tagged) if wheel and tagged else None)
    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            if name.endswith(".so") or ".so." in name:
                version = elf.needed_glibc(archive.read(name))
                if version is not None and (newest is None or version > newest[1]):
                    newest = (name, version)
    return newest


def check_built_wheel(path: Path, version: str, python: tuple[int, int],
                      host_glibc: tuple[int, int] | None, image: str = "") -> None:
    """The wheel is the build's vLLM at `version`, for the environment's Python and this host's C
    library (which the engine would otherwise only find out at import: "version `GLIBC_2.38' not
    found"). `image`: the one it came out of, for the fix."""
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
        what, (major, minor) = needed
        raise WheelError(
            f"{path.name} needs glibc {major}.{minor} or newer ({what} asks for GLIBC_{major}.{minor}); "
            f"this host has glibc {host_glibc[0]}.{host_glibc[1]}, so vLLM cannot load here natively",
            "serve the image through Compose instead: invoke up --platform cpu --set "
            f"VLLM_IMAGE={image or '<the image invoke build tagged>'}; or install the wheel on a "
            f"host with glibc {major}.{minor} or newer (the cpu target compiles on Debian trixie's "
            "gcc-12 and C library, and links against that glibc)")
