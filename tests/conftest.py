from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Defined in helpers.py (shared with the benchmarks); tests may import them from here too.
from helpers import ROOT as ROOT
from helpers import copy_project as copy_project
from helpers import write_dotenv as write_dotenv

from vllmstack.core.cpu import cpu_flags, describe_isa
from vllmstack.core.paths import Project
from vllmstack.core.store import OFF, STORE_VAR, link_entry, store_root
from vllmstack.image.cpu import cpu_build_runs, fp8_kv_serves

SHARED = ROOT.parent / "shared"


def full_run() -> bool:
    """`invoke test` (not --quick) promises the Docker engine and browser exist: never skip then."""
    return os.environ.get("VLLMSTACK_TEST_FULL") == "1"


def need(condition: bool, why: str) -> None:
    """Skip when a facility is missing during a quick run; fail during a full run."""
    if condition:
        return
    if full_run():
        pytest.fail(f"{why} (the full test run provisions it: scripts/test-env.sh)")
    pytest.skip(why)


# CPU features no install can provide, by what needs them: a test that needs one is skipped on a
# host without it, in a full run too (need() fails there, since it names what test-env provisions).
# Hosts of CI's kind differ: some have AVX-512 and AMX, some only AVX2.
CPU_FEATURES: dict[str, tuple[str, Callable[[set[str], str | None], bool]]] = {
    "fp8 KV on vLLM's CPU build": ("AVX-512 or AMX (avx512f, avx512vl, avx512bw, avx512dq; or amx_tile)",
                                   fp8_kv_serves),
    "vLLM's CPU build": ("AVX2 (avx2, fma)", cpu_build_runs),
}


def cpu_missing(feature: str, *, flags: set[str] | None = None, machine: str | None = None) -> str | None:
    """Why this CPU cannot run `feature` (a CPU_FEATURES key), or None where it can."""
    needs, runs = CPU_FEATURES[feature]
    flags = cpu_flags() if flags is None else flags
    if runs(flags, machine):
        return None
    return (f"{feature} needs {needs}; this CPU has {describe_isa(flags)} "
            "(a CPU feature: no install provides it)")


def need_cpu(feature: str) -> None:
    """Skip, naming the feature, where this host's CPU cannot run `feature`."""
    reason = cpu_missing(feature)
    if reason:
        pytest.skip(reason)


# The build store (vllmstack/core/store.py): the integration tier (tests marked slow, docker,
# browser or real_engine) shares the machine's, so what they provision (the CPU engine, the parser
# environment, llama-server, the trained model) is built once per machine, whatever HOME a test
# gives its subprocesses. The unit tier runs with the store off unless a test names its own: a fake
# runner's "install" must never become an entry of the machine's store.
INTEGRATION_MARKERS = ("slow", "docker", "browser", "real_engine", "source_build")


def machine_store() -> str:
    """The store of whoever runs the tests (their VLLMSTACK_STORE or HOME's), or `off`."""
    saved = os.environ.get("VLLMSTACK_TEST_MACHINE_STORE")
    if saved:
        return saved
    root = store_root(os.environ)
    os.environ["VLLMSTACK_TEST_MACHINE_STORE"] = str(root) if root is not None else OFF
    return os.environ["VLLMSTACK_TEST_MACHINE_STORE"]


def machine_environ() -> dict[str, str]:
    """os.environ with the machine's store, for provisioning that must outlive the run."""
    return {**os.environ, STORE_VAR: machine_store()}


@pytest.fixture(scope="session", autouse=True)
def engine_compile_cache_in_the_store() -> None:
    """The real-engine tests' HOST_CACHE_DIR, .cache/real-engine-tests (vLLM's and Inductor's
    compile caches: a boot without them takes a minute longer), lives in the machine's store and
    the checkout links to it, so a fresh clone boots as fast as the last run. A link, not the
    store's own path: the engine's ZeroMQ sockets go under that folder, and a socket path has at
    most 107 bytes. A real folder there (an earlier run's) is kept."""
    store = machine_store()
    link = ROOT / ".cache" / "real-engine-tests"
    if store == OFF or (link.exists() and not link.is_symlink()):
        return
    shared = Path(store) / "compile-cache" / "real-engine-tests"
    shared.mkdir(parents=True, exist_ok=True)
    link_entry(link, shared)


@pytest.fixture(autouse=True)
def build_store_of_the_tier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    integration = any(request.node.get_closest_marker(m) for m in INTEGRATION_MARKERS)
    monkeypatch.setenv(STORE_VAR, machine_store() if integration else OFF)


# Client state that Docker's CLI (~/.docker/.buildNodeID, written by BuildKit builds) and Chromium
# (~/.config/chromium/Crash Reports) write under HOME. Each run points them at a folder of its own,
# removed at the end, so the tests leave nothing in the home folder. HOME itself stays: pip,
# pyenv and the HF cache are read from it.
CLIENT_STATE = {"DOCKER_CONFIG": "docker", "CHROME_CONFIG_HOME": "chromium"}


@pytest.fixture(scope="session", autouse=True)
def private_client_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    folder = tmp_path_factory.mktemp("client-state")
    saved = {name: os.environ.get(name) for name in CLIENT_STATE}
    home_docker = Path(os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker")
    for name, sub in CLIENT_STATE.items():
        os.environ[name] = str(folder / sub)
    docker = folder / "docker"
    docker.mkdir()
    # Keep the user's engine settings (contexts, config.json): only the state files are new.
    for part in ("config.json", "contexts", "cli-plugins"):
        if (home_docker / part).is_dir():
            shutil.copytree(home_docker / part, docker / part, symlinks=True)
        elif (home_docker / part).is_file():
            shutil.copy2(home_docker / part, docker / part)
    if not (docker / "config.json").exists():  # Podman refuses a DOCKER_CONFIG without one
        (docker / "config.json").write_text("{}\n")
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def repo_root() -> Path:
    return ROOT


@pytest.fixture
def shipped() -> Project:
    """The project as shipped (read-only use)."""
    return Project(ROOT)


@pytest.fixture
def project(tmp_path: Path) -> Project:
    """A throwaway copy of the shipped env/ layers, .env.example and tuned-config folders."""
    return Project(copy_project(tmp_path))


@pytest.fixture(scope="session")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bench corpus tokenizer, trained once per run (read-only for every test)."""
    from vllmstack.workload.selftest_tokenizer import train_corpus_tokenizer

    return train_corpus_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")



@pytest.fixture(scope="session")
def llamacpp_cpu_server() -> Path:
    """The CPU llama-server of this checkout's .cache (keyed by ref and backend), built once through
    the stack's own install code when it is missing (8 minutes on 2 cores; CI's first run)."""
    import io
    import sys

    from vllmstack.core.runner import SubprocessRunner
    from vllmstack.runtime.native.llamacpp_install import install_llamacpp

    out = io.StringIO()
    folder = install_llamacpp(Project(ROOT), SubprocessRunner(), ref="9993", backend="cpu",
                              environ=machine_environ(), out=out, stream=False)
    print(out.getvalue(), file=sys.stderr)
    return Path(os.environ.get("VLLMSTACK_LLAMA_SERVER") or folder / "bin" / "llama-server")


CPU_ENGINE_VERSION = "0.32.0+cpu"  # env/platforms/cpu.env's NATIVE_ENGINE_VERSION


@pytest.fixture(scope="session")
def cpu_engine_python() -> Path:
    """The CPU vLLM engine's interpreter (torch, transformers), installed through the stack (the
    machine's build store) when this checkout has none. For tests marked real_engine: they run
    in the integration tier, so provisioning never depends on which test ran first."""
    from vllmstack.runtime.native.install import engine_dir, read_manifest

    folder = engine_dir(Project(ROOT), CPU_ENGINE_VERSION)
    if read_manifest(folder) is None:
        import subprocess
        import sys

        result = subprocess.run([sys.executable, "-m", "invoke", "install-engine", "--platform", "cpu"],
                                cwd=ROOT, capture_output=True, text=True, timeout=1500, check=False,
                                env=machine_environ())
        need(result.returncode == 0, "the CPU engine (invoke install-engine --platform cpu failed: "
             + (result.stderr.strip()[-300:] or "?") + ")")
    return folder / "bin" / "python"


@pytest.fixture(scope="session")
def converter_python() -> str:
    """A Python with what llama.cpp's converter needs (torch, transformers, numpy): the CPU vLLM
    engine's, installed through the stack when no candidate has them (CI's first run)."""
    import subprocess
    import sys

    from vllmstack.core.runner import SubprocessRunner
    from vllmstack.models import gguf_convert as gc

    project, runner = Project(ROOT), SubprocessRunner()
    for candidate in gc.candidate_pythons(project):
        if gc.missing_modules(runner, candidate, os.environ) == []:
            return candidate
    result = subprocess.run([sys.executable, "-m", "invoke", "install-engine", "--platform", "cpu"],
                            cwd=ROOT, capture_output=True, text=True, timeout=1500, check=False,
                            env=machine_environ())
    need(result.returncode == 0, "a Python with torch for llama.cpp's converter (invoke "
         "install-engine --platform cpu failed: " + (result.stderr.strip()[-300:] or "?") + ")")
    return gc.pick_python(project, runner, None, os.environ)
