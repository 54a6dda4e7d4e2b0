"""The README's runnable blocks, and docs/'s, exactly as written, on a fresh clone with the real
CPU engines.

A newcomer without a GPU reads README.md top to bottom and types what its blocks say. This test
does the same in one shell session (a venv activated by the first block stays active), line by
line, on `git clone` of this checkout's HEAD:

* "## Set up": the first block (the venv, `pip install -e '.[dev]'`, ...). The block after it
  runs the test suite itself, which is what runs this test: it is left out;
* "### CPU quick start": install the CPU engine, make the model, `up`, `status`, `bench`, the
  probes and the smoke test it names, `down`;
* "### CPU walk-through": llama.cpp, `gguf-convert`, `gpu-check`, `bench-vs`, and the router
  started in the background, asked, and stopped;
* then every ```bash block of every docs/ page, in page-name order: what a page shows that runs
  without a GPU (read-only tasks, `--dry-run` and `--plan` forms; tests/test_docs.py holds them to
  that, and checks the ```sh blocks, which need a GPU or a long build, against the tasks).

Every line must exit 0. After the blocks no process of the clone is left and `git status
--porcelain` is empty. The README changes to what works, never this test to what the README says.

What the clone is given besides the README (a newcomer's machine would have made these itself,
slowly): the CPU vLLM environment and the CPU llama-server build of this checkout (symlinks into
its .cache, provisioned once like the real-engine tests do: 3.4 GB, 8 minutes of compiling), the
pinned llama.cpp sdist, and the compile cache of the real-engine tests (boots take a minute, not
two). HOME is a folder of the run (pip's download cache stays the user's own).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import need
from docs_blocks import RUNNABLE, command_lines, doc_pages, fences
from helpers import ROOT

from vllmstack.core.paths import Project
from vllmstack.runtime.native.install import engine_dir, read_manifest

pytestmark = [pytest.mark.slow, pytest.mark.real_engine]
ENGINE_VERSION = "0.32.0+cpu"  # env/platforms/cpu.env
README = ROOT / "README.md"
# The whole walk: a pip install, two vLLM boots (quick start, bench-vs) and llama.cpp's.
TIMEOUT_S = 1500
MARK = "::readme-line"


@dataclass(frozen=True)
class Block:
    heading: str
    lines: list[str]


def bash_blocks(text: str, heading: str) -> list[list[str]]:
    """The ```bash blocks of the section `heading` (up to the next heading of any level), each
    as its command lines: comments and blank lines dropped, continuation lines joined."""
    start = text.index(f"\n{heading}\n")
    rest = text[start + len(heading) + 2:]
    end = re.search(r"^#{1,6} ", rest, re.M)
    section = rest[:end.start()] if end else rest
    blocks = []
    for body in re.findall(r"^```bash\n(.*?)^```", section, re.S | re.M):
        blocks.append(command_lines(body.splitlines()))
    return blocks


def docs_walk() -> list[Block]:
    """The ```bash blocks of the docs/ pages, each as its command lines."""
    return [Block(f"docs/{page.name}", command_lines(fence.body))
            for page in doc_pages() for fence in fences(page) if fence.lang == RUNNABLE]


def walk() -> list[Block]:
    text = README.read_text()
    setup = bash_blocks(text, "## Set up")
    quick = bash_blocks(text, "### CPU quick start: a real vLLM engine without a GPU")
    tour = bash_blocks(text, "### CPU walk-through: llama.cpp, bench-vs and the router")
    assert setup and quick and tour, "a section this test walks is gone from README.md"
    docs = docs_walk()
    assert docs, "no docs/ page has a ```bash block any more"
    return [Block("set up", setup[0]), *(Block("CPU quick start", b) for b in quick),
            *(Block("CPU walk-through", b) for b in tour), *docs]


def test_the_blocks_are_found_and_hold_what_the_walk_needs() -> None:
    """Cheap and always run: the sections exist, and their blocks say what the newcomer needs."""
    joined = "\n".join(line for block in walk() for line in block.lines)
    for needed in ("pip install -e", "invoke install-engine --platform cpu", "invoke make-model",
                   "invoke up --runtime native --platform cpu --model tiny", "invoke bench",
                   "invoke probe thinkoff", "invoke probe prefix-cache", "invoke stability smoke",
                   "invoke down", "invoke gguf-convert", "invoke bench-vs", "invoke router"):
        assert needed in joined, needed
    assert not re.search(r"\s\[--", joined), "an optional [--flag] is not a runnable line"


def script(blocks: list[Block]) -> str:
    """One bash session, line by line: each line's exit status and seconds are printed after it,
    and the first failure ends the walk."""
    out = ["set -o pipefail", "export PYTHONUNBUFFERED=1"]
    number = 0
    for block in blocks:
        for line in block.lines:
            number += 1
            label = shlex.quote(f"{block.heading}: {line}")
            out += [f"echo {MARK} {number} start {label}", "__t=$(date +%s)", line,
                    # On a line of its own also after output without a final newline (curl).
                    "__rc=$?", f"echo; echo {MARK} {number} rc=$__rc s=$(( $(date +%s) - __t ))",
                    "[ $__rc -eq 0 ] || exit 100"]
    return "\n".join(out) + "\n"


def clone_processes(root: Path) -> list[str]:
    """Processes (other than this test's) whose command line names the clone."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(root) in text and int(cmdline.parent.name) != os.getpid():
            found.append(f"{cmdline.parent.name}: {text[:200]}")
    return found


def provision() -> tuple[Path, Path]:
    """This checkout's CPU vLLM environment and CPU llama-server build, made when missing."""
    from vllmstack.core.runner import SubprocessRunner
    from vllmstack.runtime.native.llamacpp_install import install_llamacpp

    project = Project(ROOT)
    engine = engine_dir(project, ENGINE_VERSION)
    if read_manifest(engine) is None:
        result = subprocess.run([sys.executable, "-m", "invoke", "install-engine", "--platform",
                                 "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=1500,
                                check=False)
        need(result.returncode == 0, "vLLM's CPU build (invoke install-engine --platform cpu)")
    server = install_llamacpp(project, SubprocessRunner(), ref="9993", backend="cpu",
                              environ=os.environ, out=sys.stderr, stream=False)
    return engine, server


def test_the_readme_walk_runs_as_written_on_a_fresh_clone(tmp_path: Path) -> None:
    engine, server = provision()
    clone = tmp_path / "vllmstack"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=300)
    engines = clone / ".cache" / "engines"
    engines.mkdir(parents=True)
    (engines / engine.name).symlink_to(engine)
    (engines / server.name).symlink_to(server)
    (clone / ".cache" / "sdist").symlink_to(ROOT / ".cache" / "sdist")
    home = tmp_path / "home"
    compile_cache = ROOT / ".cache" / "real-engine-tests" / "vllmstack-engine"
    compile_cache.mkdir(parents=True, exist_ok=True)
    (home / ".cache").mkdir(parents=True)
    (home / ".cache" / "vllmstack-engine").symlink_to(compile_cache)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("VIRTUAL_ENV", "VLLMSTACK_", "PYTEST"))}
    env.update(HOME=str(home), PIP_CACHE_DIR=os.environ.get("PIP_CACHE_DIR")
               or str(Path.home() / ".cache" / "pip"), PIP_DISABLE_PIP_VERSION_CHECK="1")
    walked = walk()
    before = set(Path("/tmp").glob("vllm_dist_*"))  # every vLLM start made one there (issue 23)
    (tmp_path / "walk.sh").write_text(script(walked))
    log = tmp_path / "walk.log"
    started = time.monotonic()
    with log.open("w") as sink:
        walker = subprocess.Popen(["bash", str(tmp_path / "walk.sh")], cwd=clone, env=env,
                                  stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = walker.wait(timeout=TIMEOUT_S)
            time.sleep(2)  # what `down` and the router's stop ended has exited
            left = clone_processes(clone)  # before the clean-up below could hide a leftover
        except subprocess.TimeoutExpired:
            code, left = -1, []
        finally:  # a background job of a failed walk (the router) goes with its session
            with contextlib.suppress(ProcessLookupError):
                os.killpg(walker.pid, signal.SIGTERM)
            walker.wait(timeout=60)
    said = log.read_text(errors="replace")
    timings = re.findall(rf"^{MARK} (\d+) rc=(\d+) s=(\d+)$", said, re.M)
    print(f"README walk: {time.monotonic() - started:.0f} s; per line: "
          + ", ".join(f"{n}:{float(s):.0f}s" for n, _, s in timings))
    if code != 0:  # stop what a failed walk left running before reporting it
        subprocess.run([str(clone / ".venv" / "bin" / "invoke"), "down"], cwd=clone, env=env,
                       capture_output=True, timeout=300, check=False)
    starts = re.findall(rf"^{MARK} (\d+) start (.*)$", said, re.M)
    failed = starts[len(timings)] if code != 0 and len(starts) > len(timings) else None
    where = f"line {failed[0]} ({failed[1]})" if failed else f"exit {code}"
    assert code == 0, f"the README walk failed at {where}; its output ends:\n{said[-6000:]}"
    assert left == [], f"processes of the clone left after the walk: {left}"
    assert set(Path("/tmp").glob("vllm_dist_*")) <= before, "an engine wrote into /tmp"
    assert list((home / ".cache" / "vllmstack-engine" / "native").glob("vllm-*/tmp/vllm_dist_*"))
    status = subprocess.run(["git", "status", "--porcelain", "--ignore-submodules"], cwd=clone,
                            capture_output=True, text=True, check=True).stdout
    assert status == "", f"the walk left the clone dirty:\n{status}"
