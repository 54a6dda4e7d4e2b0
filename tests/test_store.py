"""The build store (vllmstack/core/store.py): content-keyed entries shared by a machine's checkouts.
An entry is used only when complete; a build killed halfway, one that failed, a damaged marker or
a marked file gone is built again; two builders at once build once; `clear` says what it frees
and keeps what a build or a running process holds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import ROOT, wait_for

from vllmstack.core.store import (
    OFF,
    STORE_VAR,
    Key,
    Store,
    format_bytes,
    link_entry,
    open_store,
    store_root,
    users,
)

KEY = Key("thing", "thing-1.0", {"version": "1.0", "python": "/usr/bin/python3.11", "flags": ["avx2"]})


def build_tree(calls: list[Path]):  # type: ignore[no-untyped-def]
    def build(target: Path) -> None:
        calls.append(target)
        (target / "bin").mkdir(parents=True)
        (target / "bin" / "tool").write_text("#!/bin/sh\necho built\n")
        (target / "data.bin").write_bytes(b"x" * 1000)
    return build


def test_the_key_is_what_the_result_depends_on() -> None:
    same = Key("thing", "thing-1.0", {"flags": ["avx2"], "python": "/usr/bin/python3.11", "version": "1.0"})
    assert same.digest == KEY.digest and len(KEY.digest) == 16  # order of the parts does not matter
    for change in ({"version": "1.1"}, {"python": "/opt/python3.12"}, {"flags": ["avx2", "avx512f"]}):
        assert Key("thing", "thing-1.0", {**KEY.parts, **change}).digest != KEY.digest
    assert Store(Path("/s")).entry(KEY).path == Path(f"/s/thing/thing-1.0-{KEY.digest}")


def test_an_entry_is_built_once_then_reused_by_anyone(tmp_path: Path) -> None:
    store, calls = Store(tmp_path / "store"), []
    first = store.ensure(KEY, build_tree(calls), files=["bin/tool", "data.bin"])
    assert not first.reused and (first.path / "data.bin").read_bytes() == b"x" * 1000
    # Built under a temporary name, renamed into place: the entry's own path never half-exists.
    assert calls[0].name.startswith(f"{KEY.slug}.partial-") and not calls[0].exists()
    marker = json.loads(store.entry(KEY).marker.read_text())
    assert marker["files"] == {"bin/tool": 21, "data.bin": 1000} and marker["bytes"] == 1021
    assert marker["key"]["parts"]["version"] == "1.0"
    again = Store(tmp_path / "store").ensure(KEY, build_tree(calls), files=["bin/tool"])
    assert again.reused and again.path == first.path and len(calls) == 1


def test_a_failed_build_leaves_nothing_and_the_next_one_builds(tmp_path: Path) -> None:
    store, calls = Store(tmp_path / "store"), []

    def full_disk(target: Path) -> None:
        build_tree(calls)(target)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        store.ensure(KEY, full_disk, files=["data.bin"])
    assert not store.entry(KEY).marker.exists() and not store.entry(KEY).path.exists()
    assert not list((tmp_path / "store" / "thing").glob("*.partial-*"))
    assert not store.ensure(KEY, build_tree(calls), files=["data.bin"]).reused


@pytest.mark.parametrize("damage", ["marker cut short", "marked file gone", "marked file shorter",
                                    "other key", "marker of another format"])
def test_a_damaged_entry_is_built_again_never_used(tmp_path: Path, damage: str) -> None:
    store, calls = Store(tmp_path / "store"), []
    entry = store.entry(KEY)
    store.ensure(KEY, build_tree(calls), files=["bin/tool", "data.bin"])
    data = json.loads(entry.marker.read_text())
    if damage == "marker cut short":
        entry.marker.write_text(entry.marker.read_text()[:40])
    elif damage == "marked file gone":
        (entry.path / "data.bin").unlink()
    elif damage == "marked file shorter":
        (entry.path / "data.bin").write_bytes(b"x" * 10)
    elif damage == "other key":
        data["key"]["parts"]["version"] = "0.9"
        entry.marker.write_text(json.dumps(data))
    else:
        data["format"] = 0
        entry.marker.write_text(json.dumps(data))
    assert not entry.is_complete()
    rebuilt = store.ensure(KEY, build_tree(calls), files=["bin/tool", "data.bin"])
    assert not rebuilt.reused and len(calls) == 2 and entry.is_complete()
    assert (rebuilt.path / "data.bin").stat().st_size == 1000


# A builder in a process of its own that writes half the entry, says so, and waits to be killed.
HALFWAY = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from vllmstack.core.store import Key, Store
    key = Key("thing", "thing-1.0", {"version": "1.0", "python": "/usr/bin/python3.11", "flags": ["avx2"]})
    def build(target):
        (target / "bin").mkdir(parents=True)
        (target / "bin" / "tool").write_text("half")
        Path(sys.argv[2]).write_text("halfway")
        time.sleep(600)
    Store(Path(sys.argv[1])).ensure(key, build, files=["bin/tool"], in_place=sys.argv[3] == "1")
""")


@pytest.mark.parametrize("in_place", [False, True], ids=["renamed-into-place", "built-in-place"])
def test_a_build_killed_halfway_is_rebuilt_not_used(tmp_path: Path, in_place: bool) -> None:
    store_dir, halfway = tmp_path / "store", tmp_path / "halfway"
    child = subprocess.Popen([sys.executable, "-c", HALFWAY, str(store_dir), str(halfway),
                              "1" if in_place else "0"], cwd=ROOT)
    try:
        wait_for(halfway.exists, timeout=60, what="the builder to get halfway")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    store, calls = Store(store_dir), []
    entry = store.entry(KEY)
    assert not entry.is_complete()  # what the killed build left is not an entry
    assert entry.path.exists() if in_place else list(entry.path.parent.glob("*.partial-*"))
    rebuilt = store.ensure(KEY, build_tree(calls), files=["bin/tool"], in_place=in_place)
    assert not rebuilt.reused and len(calls) == 1  # the kernel released the dead builder's lock
    assert (rebuilt.path / "bin" / "tool").read_text().startswith("#!/bin/sh")
    assert not list(entry.path.parent.glob("*.partial-*"))


BUILDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from vllmstack.core.store import Key, Store
    key = Key("thing", "thing-1.0", {"version": "1.0"})
    def build(target):
        target.mkdir()
        with open(sys.argv[2], "a") as log:
            log.write("built\\n")
        time.sleep(1)  # long enough that the other builder arrives while this one holds the lock
        (target / "done").write_text("ok")
    print(Store(Path(sys.argv[1])).ensure(key, build, files=["done"]).reused)
""")


def test_two_builders_at_once_build_it_once(tmp_path: Path) -> None:
    log = tmp_path / "builds.log"
    children = [subprocess.Popen([sys.executable, "-c", BUILDER, str(tmp_path / "store"), str(log)],
                                 cwd=ROOT, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    said = sorted(child.communicate(timeout=120)[0].strip() for child in children)
    assert said == ["False", "True"] and log.read_text() == "built\n"


def test_clear_says_what_it_frees_and_keeps_what_a_build_or_a_process_holds(tmp_path: Path) -> None:
    store, calls = Store(tmp_path / "store"), []
    done = store.ensure(KEY, build_tree(calls), files=["data.bin"])
    busy_key = Key("thing", "busy-1", {})
    running_key = Key("engine", "running-1", {})

    def script(target: Path) -> None:
        target.mkdir()
        (target / "serve.py").write_text("import time\ntime.sleep(600)\n")

    running = store.ensure(running_key, script, files=["serve.py"])
    engine = subprocess.Popen([sys.executable, str(running.path / "serve.py")])
    try:
        wait_for(lambda: users(running.path) == [engine.pid], timeout=30, what="the engine")
        with store.entry(busy_key).locked():
            (store.entry(busy_key).path).mkdir(parents=True)  # a build under way
            freed, lines = store.clear(dry_run=True)
            assert done.path.exists() and freed == 1021
            freed, lines = store.clear()
    finally:
        engine.kill()
        engine.wait()
    assert freed == 1021 and not done.path.exists() and not store.entry(KEY).marker.exists()
    assert f"removed {done.path} (1021 B)" in lines
    assert any(line.startswith(f"kept {running.path} (in use by pid {engine.pid})") for line in lines)
    assert f"kept {store.entry(busy_key).path} (a build holds it)" in lines
    assert running.path.exists()
    assert store.clear()[0] > 0 and Store(tmp_path / "store").entries() == []


def test_where_the_store_is(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    assert store_root({"HOME": str(home)}) == home / ".cache" / "vllmstack" / "store"
    assert store_root({"HOME": str(home), "XDG_CACHE_HOME": "/x"}) == Path("/x/vllmstack/store")
    assert store_root({STORE_VAR: str(tmp_path / "s"), "HOME": str(home)}) == tmp_path / "s"
    assert store_root({STORE_VAR: OFF, "HOME": str(home)}) is None and open_store({STORE_VAR: "off"}) is None
    # No home to put it in (a service's environment, a test's {"HOME": "/h"}): no store is made.
    assert store_root({"HOME": str(tmp_path / "absent")}) is None and store_root({}) is None


def test_a_checkout_links_to_its_entry_replacing_an_unfinished_folder(tmp_path: Path) -> None:
    entry, other = tmp_path / "store" / "e", tmp_path / "store" / "f"
    entry.mkdir(parents=True)
    other.mkdir()
    link = tmp_path / "checkout" / ".cache" / "engines" / "vllm-1"
    link.mkdir(parents=True)
    (link / "half").write_text("an install that stopped")
    link_entry(link, entry)
    assert link.is_symlink() and link.resolve() == entry.resolve()
    link_entry(link, entry)  # again: nothing changes
    link_entry(link, other)
    assert link.resolve() == other.resolve()
    assert not list(link.parent.glob(".*partial*"))


def test_sizes_read_as_people_read_them() -> None:
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 1024**3 + 400 * 1024**2) == "3.4 GiB"


def test_users_follow_links_into_the_entry(tmp_path: Path) -> None:
    entry = tmp_path / "store" / "engine"
    entry.mkdir(parents=True)
    (entry / "serve.py").write_text("import time\ntime.sleep(600)\n")
    link = tmp_path / "checkout-link"
    link.symlink_to(entry)
    child = subprocess.Popen([sys.executable, str(link / "serve.py")])
    try:
        wait_for(lambda: child.pid in users(entry), timeout=30, what="the process")
        assert users(tmp_path / "store" / "elsewhere") == []
    finally:
        child.kill()
        child.wait()
    started = time.monotonic()
    wait_for(lambda: child.pid not in users(entry), timeout=30, what="the process to go")
    assert time.monotonic() - started < 30
    assert os.getpid() not in users(entry)


def test_clear_caches_store_says_what_it_frees(tmp_path: Path) -> None:
    from vllmstack.core.store import clear_store

    environ = {STORE_VAR: str(tmp_path / "store")}
    assert clear_store(environ) == [f"build store {tmp_path / 'store'}: freed 0 B (it was empty)"]
    Store(tmp_path / "store").ensure(KEY, build_tree([]), files=["data.bin"])
    planned = clear_store(environ, dry_run=True)
    assert planned[-1] == f"build store {tmp_path / 'store'}: would free 1021 B"
    assert planned[0].startswith("(dry run) would remove ") and Store(tmp_path / "store").entries()
    done = clear_store(environ)
    assert done[-1].startswith(f"build store {tmp_path / 'store'}: freed 1021 B; the checkouts' links")
    assert Store(tmp_path / "store").entries() == []
    assert clear_store({STORE_VAR: "off"})[0].startswith("no build store")


def test_the_clear_caches_task_takes_store(tmp_path: Path) -> None:
    from helpers import copy_project

    root = copy_project(tmp_path / "stack")
    Store(tmp_path / "store").ensure(KEY, build_tree([]), files=["data.bin"])
    env = {**os.environ, STORE_VAR: str(tmp_path / "store"), "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "invoke", "clear-caches", "--store",
                           "--runtime", "native"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert f"build store {tmp_path / 'store'}: freed 1021 B" in done.stdout
    assert Store(tmp_path / "store").entries() == []


def test_clear_keeps_a_resumable_build_folder_whose_build_runs(tmp_path: Path) -> None:
    from vllmstack.core.store import slug_of

    store = Store(tmp_path / "store")
    entry = store.entry(KEY)
    cmake = entry.path.with_name(KEY.slug + ".build")  # llama.cpp's, beside its entry
    with entry.locked():
        cmake.mkdir(parents=True)
        (cmake / "CMakeCache.txt").write_text("objects of an hour")
        freed, lines = store.clear()
        assert cmake.exists() and lines == [f"kept {cmake} (a build holds it)"] and freed == 0
    assert store.clear()[0] > 0 and not cmake.exists()

    slug = f"vllm-0.32.0+cpu-{KEY.digest}"
    for name in (slug, f"{slug}.build", f"{slug}.partial-123", f"{slug}.json.partial-9"):
        assert slug_of(name) == slug  # each under the lock of its entry
    assert slug_of("real-engine-tests") == "real-engine-tests"
