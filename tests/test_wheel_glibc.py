"""install-engine --wheel FILE / --from-image IMAGE refuse a built wheel whose libraries need a
newer glibc than the host's, early (before pip, before an environment is replaced), naming the
wheel, the glibc it needs, the host's and the fix. What is read: each shared library's version
needs (runtime/native/elf.py), and the wheel's manylinux tag where it has one."""

from __future__ import annotations

import io
import re
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from test_native_source_wheel import PY, VERSION, WHEEL, built_host, sdist_with_pin

from vllmstack.core.paths import Project
from vllmstack.core.runner import Result
from vllmstack.runtime.native import elf, install
from vllmstack.runtime.native.cpu_build import BuiltWheel, read_built_file
from vllmstack.runtime.native.install import engine_dir, install_engine, read_manifest
from vllmstack.runtime.native.wheels import WheelError, check_built_wheel, needed_glibc

# What `invoke build --platform cpu` left in vllm/_C.abi3.so on 2026-12-01 (readelf -V): trixie's
# headers turn strtol/strtoul/fscanf into their GLIBC_2.38 __isoc23_ forms.
TRIXIE_C = {"libc.so.6": ["GLIBC_2.2.5", "GLIBC_2.34", "GLIBC_2.38", "GLIBC_2.3.4"],
            "libm.so.6": ["GLIBC_2.29"], "libstdc++.so.6": ["GLIBCXX_3.4.21", "CXXABI_1.3"]}


def make_library(needs: dict[str, list[str]], strings: bytes = b"") -> bytes:
    """A minimal ELF64 shared library laid out as the linker lays out its version needs: .dynstr,
    .gnu.version_r naming `needs` ({library: [versions]}), and a data section holding `strings`."""
    dynstr = bytearray(b"\0")

    def add(text: str) -> int:
        at = len(dynstr)
        dynstr.extend(text.encode() + b"\0")
        return at

    verneed = bytearray()
    for i, (library, versions) in enumerate(needs.items()):
        file = add(library)
        aux = b"".join(struct.pack("<IHHII", 0, 0, 2 + j, add(v), 16 if j + 1 < len(versions) else 0)
                       for j, v in enumerate(versions))
        following = 16 + len(aux) if i + 1 < len(needs) else 0
        verneed += struct.pack("<HHIII", 1, len(versions), file, 16, following) + aux
    body = [bytes(dynstr), bytes(verneed), strings]
    offsets = [64 + sum(len(b) for b in body[:i]) for i in range(len(body))]
    table = 64 + sum(len(b) for b in body)
    sections = [struct.pack("<IIQQQQIIQQ", *[0] * 10),
                struct.pack("<IIQQQQIIQQ", 0, 3, 2, 0, offsets[0], len(body[0]), 0, 0, 1, 0),
                struct.pack("<IIQQQQIIQQ", 0, elf.SHT_GNU_VERNEED, 2, 0, offsets[1], len(body[1]), 1,
                            len(needs), 8, 0),
                struct.pack("<IIQQQQIIQQ", 0, 1, 2, 0, offsets[2], len(body[2]), 0, 0, 1, 0)]
    header = b"\x7fELF\x02\x01\x01" + bytes(9) + struct.pack(
        "<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, table, 0, 64, 0, 0, 64, len(sections), 0)
    return header + b"".join(body) + b"".join(sections)


def make_wheel(folder: Path, libraries: dict[str, bytes], name: str = WHEEL) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / name, "w") as archive:
        archive.writestr("vllm/__init__.py", "")
        for member, data in libraries.items():
            archive.writestr(member, data)
    return folder / name


def readelf_needs(path: Path, strings: bytes = b"") -> list[tuple[str, str]]:
    """The version needs binutils' readelf lists. Without a dynamic segment (the crafted library)
    it gives string offsets only: `strings` (the .dynstr bytes) resolves them."""
    shown = subprocess.run(["readelf", "-V", "--wide", str(path)], capture_output=True, text=True,
                           check=True).stdout

    def name(found: str) -> str:
        return strings[int(found, 16):].split(b"\0", 1)[0].decode() if strings else found

    needs, library = [], ""
    for line in shown[shown.find("Version needs section"):].splitlines():
        if found := re.search(r"File: (\S+)", line):
            library = name(found[1])
        elif found := re.search(r"Name(?: index)?: (\S+)", line):
            needs.append((library, name(found[1])))
    return needs


@pytest.mark.skipif(shutil.which("readelf") is None, reason="binutils' readelf is not installed")
def test_version_needs_are_read_as_readelf_reads_them(tmp_path: Path) -> None:
    crafted = tmp_path / "_C.abi3.so"
    crafted.write_bytes(make_library(TRIXIE_C))
    needs = [(library, v) for library, versions in TRIXIE_C.items() for v in versions]
    assert readelf_needs(crafted, crafted.read_bytes()[64:]) == needs  # .dynstr comes first
    assert elf.needed_versions(crafted.read_bytes()) == needs
    # A real library, linked by a real linker: the interpreter running this test.
    python = Path(sys.executable).resolve()
    assert sorted(elf.needed_versions(python.read_bytes()) or []) == sorted(readelf_needs(python))
    assert elf.needed_glibc(crafted.read_bytes()) == (2, 38)
    mine = elf.needed_glibc(Path(sys.executable).resolve().read_bytes())
    host = install.host_glibc()
    assert mine is not None and host is not None and mine <= host  # it runs here, after all


def test_not_an_elf_library_needs_nothing() -> None:
    assert elf.needed_versions(b"#!/bin/sh\n") is None
    assert elf.needed_glibc(make_library({})) is None
    assert elf.needed_versions(make_library(TRIXIE_C)[:100]) is None  # cut short: unreadable


def test_a_wheel_that_needs_a_newer_glibc_is_refused_naming_what_and_the_fix(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path, {"vllm/_C.abi3.so": make_library(TRIXIE_C),
                                  "vllm/spinloop.abi3.so": make_library({"libc.so.6": ["GLIBC_2.17"]})})
    with pytest.raises(WheelError) as err:
        check_built_wheel(wheel, VERSION, (3, 11), (2, 36), "localhost/vllm-cpu:src")
    assert err.value.cause == (
        f"{WHEEL} needs glibc 2.38 or newer (vllm/_C.abi3.so asks for GLIBC_2.38); this host has "
        "glibc 2.36, so vLLM cannot load here natively")
    fix = err.value.fix or ""
    assert "invoke up --platform cpu --set VLLM_IMAGE=localhost/vllm-cpu:src" in fix
    assert "host with glibc 2.38 or newer" in fix
    check_built_wheel(wheel, VERSION, (3, 11), (2, 38))  # that host: fine
    check_built_wheel(wheel, VERSION, (3, 11), None)  # not glibc (musl): nothing to compare


def test_a_version_a_library_only_mentions_is_not_needed(tmp_path: Path) -> None:
    # Searching the bytes for "GLIBC_" refused this wheel: the text is data, not a version need.
    library = make_library({"libc.so.6": ["GLIBC_2.17"]}, b"built against GLIBC_2.41 headers\0")
    wheel = make_wheel(tmp_path, {"vllm/_C.abi3.so": library})
    assert needed_glibc(wheel) == ("vllm/_C.abi3.so", (2, 17))
    check_built_wheel(wheel, VERSION, (3, 11), (2, 36))


@pytest.mark.parametrize(("platform", "needed"), [
    ("manylinux_2_39_x86_64", (2, 39)), ("manylinux2014_x86_64", (2, 17)),
    ("manylinux_2_17_x86_64.manylinux2014_x86_64", (2, 17)), ("linux_x86_64", None)])
def test_the_manylinux_tag_says_what_it_needs(tmp_path: Path, platform: str,
                                              needed: tuple[int, int] | None) -> None:
    wheel = make_wheel(tmp_path, {}, f"vllm-{VERSION}-cp311-cp311-{platform}.whl")
    found = needed_glibc(wheel)
    assert (found[1] if found else None) == needed
    if needed == (2, 39):
        with pytest.raises(WheelError) as err:
            check_built_wheel(wheel, VERSION, (3, 11), (2, 36))
        assert "the platform tag manylinux_2_39_x86_64 asks for GLIBC_2.39" in err.value.cause


def install_file(project: Project, wheel: Path, *, force: bool = False,
                 dry_run: bool = False) -> str:
    built = read_built_file(wheel, project.cache / "build-inputs")
    runner = built_host(project)
    runner.dry_run = dry_run
    out = io.StringIO()
    install_engine(project, runner, version=VERSION, python=PY, environ={"HOME": "/h"}, out=out,
                   built=built, docker="docker", force=force)
    return out.getvalue()


def test_force_over_a_working_environment_refuses_before_removing_it(
        project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(install, "host_glibc", lambda: (2, 36))
    sdist_with_pin(project.cache / "build-inputs", "0.31.0", "2.13.0+cpu")
    install_file(project, make_wheel(tmp_path / "good", {}))
    folder = engine_dir(project, VERSION)
    before = read_manifest(folder)
    assert before is not None
    rebuilt = make_wheel(tmp_path / "trixie", {"vllm/_C.abi3.so": make_library(TRIXIE_C)})
    with pytest.raises(WheelError) as err:
        install_file(project, rebuilt, force=True)
    assert "needs glibc 2.38" in err.value.cause
    assert read_manifest(folder) == before  # the engine that worked still does
    # --dry-run reads the wheel too (it changes nothing), so it says the same.
    with pytest.raises(WheelError):
        install_file(project, rebuilt, force=True, dry_run=True)


def test_from_image_refuses_after_packing_and_before_any_environment(
        project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(install, "host_glibc", lambda: (2, 36))
    runner = built_host(project)

    def copy(argv: tuple[str, ...]) -> Result:  # the packed wheel, as trixie's compiler left it
        if argv[2].endswith(":/tmp/vllmstack-wheel/."):
            make_wheel(Path(argv[3]), {"vllm/_C.abi3.so": make_library(TRIXIE_C)})
        return Result(argv, 0)

    runner.respond(["docker", "cp"], copy)
    built = BuiltWheel(VERSION, "2.13.0+cpu", image="localhost/vllm-cpu:src")
    with pytest.raises(WheelError) as err:
        install_engine(project, runner, version=VERSION, python=PY, environ={}, out=io.StringIO(),
                       built=built, docker="docker")
    assert "VLLM_IMAGE=localhost/vllm-cpu:src" in (err.value.fix or "")
    assert not any(c[1:3] == ("-m", "venv") or "pip" in c for c in runner.calls)
    assert not engine_dir(project, VERSION).exists()
