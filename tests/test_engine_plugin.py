"""The engine plugin behind ROUTER_SLEEP_FREES=kv (engine-plugins/vllmstack_sleep): a level-1
sleep that releases only the KV cache and leaves the weights mapped, a wake that maps back only
what was released, and vLLM finding it through its entry point.

The allocator here is a stand-in with vLLM's shape (CuMemAllocator.pointer_to_data: a handle,
a tag, is_asleep, a host backup) in a fake `vllm` package, run in a child process so nothing of
it stays in this one; the last test loads the plugin into the real vLLM (the CPU build), whose
plugin loader and sleep-mode backend registry are the same code as on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import ROOT

PLUGINS = ROOT / "engine-plugins"

FAKE_VLLM = {
    "vllm/__init__.py": "",
    "vllm/device_allocator/__init__.py": textwrap.dedent("""
        class Data:
            def __init__(self, tag, size):
                self.tag, self.handle, self.is_asleep, self.cpu_backup_tensor = tag, (0, size), False, None

        class Allocator:
            def __init__(self):
                self.pointer_to_data = {100: Data("weights", 15), 200: Data("kv_cache", 60),
                                        300: Data("kv_cache", 4), 400: Data("cudagraph", 1)}

        ALLOCATOR = Allocator()

        def get_mem_allocator_instance():
            return ALLOCATOR
        """),
    "vllm/device_allocator/cumem.py": textwrap.dedent("""
        EVENTS = []

        def unmap_and_release(handle):
            EVENTS.append(("unmap", handle[1]))

        def create_and_map(handle):
            EVENTS.append(("map", handle[1]))

        class _RT:
            def cudaMemcpy(self, dst, src, size):
                EVENTS.append(("copy", dst, size))

        libcudart = _RT()
        """),
    "vllm/device_allocator/sleep_mode_backend.py": textwrap.dedent("""
        class SleepModeBackend:
            def __init__(self):
                self._state = "RUNNING"

        class CuMemBackend(SleepModeBackend):
            def suspend(self, level=1):
                from vllm.device_allocator.cumem import EVENTS
                EVENTS.append(("vllm-suspend", level))

            def resume(self, tags=None):
                from vllm.device_allocator.cumem import EVENTS
                EVENTS.append(("vllm-resume", tags))

        class SleepModeBackendFactory:
            _registry = {"cumem": lambda: CuMemBackend}

            @classmethod
            def get_backend_class(cls, name):
                return cls._registry[name]()
        """),
    "torch/__init__.py": "class accelerator:\n    empty_cache = staticmethod(lambda: None)\n",
}

SCENARIO = """
import json, vllmstack_sleep
from vllm.device_allocator import ALLOCATOR
from vllm.device_allocator.cumem import EVENTS
from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
vllmstack_sleep.register()
backend = SleepModeBackendFactory.get_backend_class("cumem")()
data = ALLOCATOR.pointer_to_data
out = {"class": type(backend).__name__}
backend.suspend(1)
out["asleep"] = sorted(ptr for ptr, d in data.items() if d.is_asleep)
out["after_sleep"], EVENTS[:] = list(EVENTS), []
backend.resume(["kv_cache"])
out["after_wake"], EVENTS[:] = list(EVENTS), []
backend.suspend(1); backend.resume(None)
out["cycle"], EVENTS[:] = list(EVENTS), []
backend.suspend(2)
out["level2"], out["state"] = list(EVENTS), backend._state
print(json.dumps(out))
"""


def run_scenario(tmp_path: Path, *, env_value: str | None,
                 frees_file: Path | None = None) -> dict[str, object]:
    for name, text in FAKE_VLLM.items():
        path = tmp_path / "fake" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "VLLMSTACK_SLEEP_FREES"}
    env["PYTHONPATH"] = f"{tmp_path / 'fake'}:{PLUGINS}"
    if env_value is not None:
        env["VLLMSTACK_SLEEP_FREES"] = env_value
    env.pop("VLLMSTACK_SLEEP_FREES_FILE", None)
    if frees_file is not None:
        env["VLLMSTACK_SLEEP_FREES_FILE"] = str(frees_file)
    result = subprocess.run([sys.executable, "-c", SCENARIO], env=env, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def test_a_kv_sleep_releases_the_kv_cache_and_keeps_the_weights_mapped(tmp_path: Path) -> None:
    out = run_scenario(tmp_path, env_value="kv")
    assert out["class"] == "KeepWeightsBackend"
    # Only the two KV cache allocations are released; the weights (and a graph pool) stay
    # mapped and nothing is copied to host RAM (vLLM's level 1 copies every weight).
    assert out["asleep"] == [200, 300]
    assert out["after_sleep"] == [["unmap", 60], ["unmap", 4]]
    # The wake maps back exactly what was released: never an allocation still mapped.
    assert out["after_wake"] == [["map", 60], ["map", 4]]
    assert out["cycle"] == [["unmap", 60], ["unmap", 4], ["map", 60], ["map", 4]]
    # Level 2 is vLLM's own.
    assert out["level2"] == [["vllm-suspend", 2]]


def test_the_routers_file_makes_a_sleep_back_the_weights_up_as_vllms_level_1(
        tmp_path: Path) -> None:
    """The tier `asleep` for an engine started kv-able: the router writes `all` before /sleep,
    and that sleep is vLLM's own level 1 (weights to host RAM); `kv` there is the plugin's."""
    said = tmp_path / "a.sleep-frees"
    said.write_text("all\n")
    out = run_scenario(tmp_path, env_value="kv", frees_file=said)
    assert out["class"] == "KeepWeightsBackend"
    assert out["after_sleep"] == [["vllm-suspend", 1]] and out["asleep"] == []
    said.write_text("kv\n")
    assert run_scenario(tmp_path, env_value="kv", frees_file=said)["asleep"] == [200, 300]
    # A file that cannot be read is the plugin's own sleep, never a crash in the engine.
    missing = run_scenario(tmp_path, env_value="kv", frees_file=tmp_path / "gone")
    assert missing["asleep"] == [200, 300]


@pytest.mark.parametrize("env_value", [None, "all", ""])
def test_without_the_switch_the_engine_sleeps_as_vllm_does(tmp_path: Path,
                                                            env_value: str | None) -> None:
    out = run_scenario(tmp_path, env_value=env_value)
    assert out["class"] == "CuMemBackend"
    assert out["after_sleep"] == [["vllm-suspend", 1]]


@pytest.mark.slow
@pytest.mark.real_engine
def test_the_real_vllm_finds_the_plugin_through_its_entry_point() -> None:
    """vLLM's own plugin loader (vllm.general_plugins) finds the plugin on PYTHONPATH and its
    sleep-mode registry then gives ours for the default backend; everything the plugin imports
    from vLLM exists there."""
    from integration.test_real_cpu_engine import provision_engine

    engine = provision_engine()
    probe = textwrap.dedent("""
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.device_allocator.sleep_mode_backend import CuMemBackend, SleepModeBackendFactory
        from vllm.device_allocator.cumem import create_and_map, libcudart, unmap_and_release
        from vllm.device_allocator import get_mem_allocator_instance
        cls = SleepModeBackendFactory.get_backend_class("cumem")
        print(cls.__name__, issubclass(cls, CuMemBackend))
        """)
    said = {}
    for value in ("kv", "all"):
        env = {**os.environ, "PYTHONPATH": str(PLUGINS), "VLLMSTACK_SLEEP_FREES": value}
        result = subprocess.run([str(engine / "bin" / "python"), "-c", probe], env=env,
                                capture_output=True, text=True, timeout=300, check=False)
        assert result.returncode == 0, result.stderr[-2000:]
        said[value] = result.stdout.split()[-2:]
    assert said == {"kv": ["KeepWeightsBackend", "True"], "all": ["CuMemBackend", "True"]}
