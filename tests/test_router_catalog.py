"""Which profiles the router offers, under which names, with which idle TTL."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import copy_project, write_dotenv

from vllmstack.core.paths import Project
from vllmstack.router.catalog import CatalogError, build_catalog

PROFILES = {
    "a": "PROFILE_PLATFORMS=cpu\nVLLM_SERVED_NAME=alpha\nIDLE_TTL=30\n",
    "b": "PROFILE_PLATFORMS=cpu,nvidia\nVLLM_SERVED_NAME=b\n",
    "c": "PROFILE_PLATFORMS=nvidia\nVLLM_SERVED_NAME=gamma\n",
    "d": "PROFILE_PLATFORMS=cpu\nENGINE=llamacpp\nVLLM_SERVED_NAME=delta\n",
}


def make_project(tmp_path: Path, extra: dict[str, str] | None = None,
                 dotenv: dict[str, str] | None = None) -> Project:
    root = copy_project(tmp_path / "stack")
    for old in (root / "env" / "models").glob("*.env"):
        old.unlink()  # only this test's profiles, whatever the shipped ones become
    for name, text in {**PROFILES, **(extra or {})}.items():
        (root / "env" / "models" / f"{name}.env").write_text(f"PROFILE_DESCRIPTION={name}\n{text}")
    write_dotenv(root, {"PLATFORM": "cpu", "VLLM_PORT": "8180", **(dotenv or {})})
    return Project(root)


def test_the_platforms_profiles_by_served_name_with_the_profile_name_as_alias(tmp_path: Path) -> None:
    catalog = build_catalog(make_project(tmp_path), {})
    assert catalog.platform == "cpu"
    assert catalog.ids == ["alpha", "b", "delta"]  # c is made for nvidia only
    assert catalog.find("alpha") is catalog.find("a") is catalog.entries["alpha"]
    assert catalog.find("c") is None and catalog.find("gamma") is None
    assert catalog.aliases == {"a": "alpha", "d": "delta"}
    assert catalog.entries["delta"].engine == "llamacpp" and catalog.entries["b"].engine == "vllm"
    assert catalog.entries["alpha"].ttl == 30 and catalog.entries["b"].ttl == 0  # IDLE_TTL, default 0
    assert catalog.entries["alpha"].url == "http://127.0.0.1:8180"
    nvidia = build_catalog(make_project(tmp_path / "n"), {}, platform="nvidia")
    assert nvidia.ids == ["b", "gamma"]


def test_ttl_flag_overrides_every_profiles_idle_ttl(tmp_path: Path) -> None:
    catalog = build_catalog(make_project(tmp_path), {}, ttl=5)
    assert {e.ttl for e in catalog.entries.values()} == {5}
    never = build_catalog(make_project(tmp_path / "n"), {}, ttl=0)
    assert {e.ttl for e in never.entries.values()} == {0}


def test_profiles_flag_takes_exactly_the_named_ones(tmp_path: Path) -> None:
    catalog = build_catalog(make_project(tmp_path), {}, profiles=["c", "a"])
    assert catalog.ids == ["gamma", "alpha"]  # named: even one not made for the platform


def test_an_unknown_profile_is_named_with_the_choices(tmp_path: Path) -> None:
    with pytest.raises(CatalogError) as caught:
        build_catalog(make_project(tmp_path), {}, profiles=["a", "zz"])
    assert "unknown model profile(s): zz" in caught.value.cause
    assert caught.value.fix == "choose among: a, b, c, d"


def test_two_profiles_serving_one_name_are_refused_naming_both(tmp_path: Path) -> None:
    project = make_project(tmp_path, {"e": "PROFILE_PLATFORMS=cpu\nVLLM_SERVED_NAME=alpha\n"})
    with pytest.raises(CatalogError) as caught:
        build_catalog(project, {})
    cause = caught.value.cause
    assert "profiles a and e both serve the name 'alpha' on platform cpu" in cause
    assert "env/models/a.env:3" in cause and "env/models/e.env:3" in cause
    assert "VLLM_SERVED_NAME" in (caught.value.fix or "")
    assert build_catalog(project, {}, profiles=["a", "b"]).ids == ["alpha", "b"]  # the way out


def test_the_routers_port_is_not_taken_for_another_engine(tmp_path: Path) -> None:
    project = make_project(tmp_path, dotenv={"OTHER_ENGINE_PORTS": "8080,8000"})
    catalog = build_catalog(project, {}, router_port=8080)
    assert catalog.entries["b"].resolved.get_list("OTHER_ENGINE_PORTS") == ["8000"]
    alone = make_project(tmp_path / "alone", dotenv={"OTHER_ENGINE_PORTS": "8080"})
    assert build_catalog(alone, {}, router_port=8080).entries["b"].resolved.get_list(
        "OTHER_ENGINE_PORTS") == []
    kept = build_catalog(project, {}, router_port=9000)
    assert kept.entries["b"].resolved.get_list("OTHER_ENGINE_PORTS") == ["8080", "8000"]


def test_the_routers_port_cannot_be_an_engine_port(tmp_path: Path) -> None:
    with pytest.raises(CatalogError) as caught:
        build_catalog(make_project(tmp_path), {}, router_port=8180)
    assert "the router's port 8180 is the engine port of profile a" in caught.value.cause
    assert "VLLM_PORT set at .env:" in caught.value.cause


def test_a_platform_without_profiles_says_how_to_add_some(tmp_path: Path) -> None:
    with pytest.raises(CatalogError) as caught:
        build_catalog(make_project(tmp_path), {}, platform="rdna3")
    assert "no model profile lists platform rdna3 in PROFILE_PLATFORMS" in caught.value.cause
    assert "--profiles" in (caught.value.fix or "")
