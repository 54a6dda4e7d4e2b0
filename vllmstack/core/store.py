"""The build store: what the stack builds or installs once per machine, shared by every checkout.

An engine environment (3.4 GB, minutes of pip), vLLM's parser environment, a compiled llama-server,
a downloaded sdist and a trained model depend only on what went into them, not on the checkout that
asked. So they live in a content-keyed store outside the checkout, by default
`~/.cache/vllmstack/store` (`VLLMSTACK_STORE` names another folder; `off` keeps everything in the
checkout's .cache as before), and a checkout links to the entry it needs. A second clone reuses
them; a new machine fills the store once.

An entry is `<root>/<kind>/<name>-<digest>/`: the digest is a hash of everything the result depends
on (versions, file hashes, the Python, the CPU's flags where a build is compiled for it), so a
change of any of them is another entry, never a stale one. An entry counts only once its marker
`<name>-<digest>.json` exists beside it, written last and atomically (a temporary name, then a
rename); it records the key and the size and lists the files whose presence and size `is_complete`
checks. A build killed halfway (no marker), one that filled the disk (it raised: no marker) or an
entry whose marked files went missing is removed and built again, never used. Builds take a lock
per entry, so two runs (or two test workers) at once build it once.

Where the result can move (a self-contained folder, a file), it is built under a temporary name and
renamed into place; a virtual environment cannot move (its console scripts name their interpreter
by absolute path), so it is built in place and only the marker is renamed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllmstack.core.errors import StackError

STORE_VAR = "VLLMSTACK_STORE"
OFF = "off"
FORMAT = 1  # of the marker; a marker of another format is not trusted
PARTIAL = ".partial-"
# The file kinds a key part may take; anything else is refused when the key is made.
KeyValue = str | int | float | bool | None | Sequence[str]


class StoreError(StackError):
    """The store cannot be used as asked; `fix` says what to do."""


def store_root(environ: Mapping[str, str]) -> Path | None:
    """VLLMSTACK_STORE, else ${XDG_CACHE_HOME:-$HOME/.cache}/vllmstack/store; None when it is
    `off`, or when neither is set and HOME is not an existing folder (an environment without a
    home, as a service or a test gives, gets no store created for it)."""
    value = environ.get(STORE_VAR, "").strip()
    if value.lower() == OFF:
        return None
    if value:
        return Path(value).expanduser()
    if environ.get("XDG_CACHE_HOME"):
        return Path(environ["XDG_CACHE_HOME"]).expanduser() / "vllmstack" / "store"
    home = environ.get("HOME")
    if not home or not Path(home).is_dir():
        return None
    return Path(home) / ".cache" / "vllmstack" / "store"


@dataclass(frozen=True)
class Key:
    """What an entry depends on. `name` is for people (vllm-0.32.0+cpu); `parts` make the digest."""

    kind: str
    name: str
    parts: Mapping[str, KeyValue] = field(default_factory=dict)

    def canonical(self) -> str:
        parts = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in self.parts.items()}
        return json.dumps({"kind": self.kind, "name": self.name, "parts": parts}, sort_keys=True)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.canonical().encode()).hexdigest()[:16]

    @property
    def slug(self) -> str:
        return f"{self.name}-{self.digest}"


def tree_size(path: Path) -> int:
    """Bytes under `path` (a file's own size); links are not followed, so nothing counts twice."""
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with suppress(OSError):
                total += (Path(folder) / name).lstat().st_size
    return total


def remove_path(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path)


@dataclass(frozen=True)
class Entry:
    store: Store
    key: Key

    @property
    def path(self) -> Path:
        return self.store.root / self.key.kind / self.key.slug

    @property
    def marker(self) -> Path:
        return self.path.with_name(self.key.slug + ".json")

    @property
    def lock_file(self) -> Path:
        return self.path.with_name(self.key.slug + ".lock")

    def read_marker(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def is_complete(self) -> bool:
        """The marker is there, of this format and key, and every file it lists has its size."""
        data = self.read_marker()
        if data is None or data.get("format") != FORMAT or data.get("key") != json.loads(
                self.key.canonical()) or not self.path.exists():
            return False
        files = data.get("files")
        if not isinstance(files, dict):
            return False
        for relative, size in files.items():
            target = self.path / relative if relative != "." else self.path
            try:
                if target.stat().st_size != size:
                    return False
            except OSError:
                return False
        return True

    @contextmanager
    def locked(self) -> Iterator[None]:
        """The entry's build lock (released by the kernel if the holder dies)."""
        self.lock_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.lock_file, "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def discard(self) -> None:
        """Remove the entry, its marker first (a half-removed entry is then never trusted)."""
        self.marker.unlink(missing_ok=True)
        remove_path(self.path)
        for partial in self.path.parent.glob(self.key.slug + PARTIAL + "*"):
            remove_path(partial)

    def complete(self, files: Sequence[str], started: float) -> None:
        """Write the marker: the key, the size, and the files `is_complete` checks."""
        sizes = {}
        for relative in files:
            target = self.path / relative if relative != "." else self.path
            sizes[relative] = target.stat().st_size  # FileNotFoundError: the build missed it
        data = {"format": FORMAT, "key": json.loads(self.key.canonical()), "files": sizes,
                "bytes": tree_size(self.path), "built_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                "build_seconds": round(time.monotonic() - started, 1)}
        temporary = self.marker.with_name(f"{self.marker.name}{PARTIAL}{os.getpid()}")
        temporary.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        temporary.rename(self.marker)


@dataclass
class Built:
    path: Path
    reused: bool
    seconds: float = 0.0


@dataclass(frozen=True)
class Store:
    root: Path

    def entry(self, key: Key) -> Entry:
        for text in (key.kind, key.name):
            if not text or "/" in text or text.startswith(".") or "\x00" in text:
                raise StoreError(f"{text!r} cannot name a store entry", "report it: a bug in the caller")
        return Entry(self, key)

    def ensure(self, key: Key, build: Callable[[Path], None], *, files: Sequence[str] = (),
               in_place: bool = False, force: bool = False,
               say: Callable[[str], None] | None = None) -> Built:
        """The entry for `key`, built by `build(target)` when missing or incomplete.

        `target` is a temporary sibling of the entry (renamed into place after `build` returns),
        or, `in_place`, the entry's own folder (for what cannot move). `files`: paths relative to
        the entry (`.` for the entry itself when it is a file) that a complete entry has; the
        marker records their sizes. A `build` that raises leaves nothing the store would use.
        `force` builds it again even when complete."""
        entry = self.entry(key)
        if entry.is_complete() and not force:  # the common case takes no lock
            return Built(entry.path, True)
        try:
            entry.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the build store folder {entry.path.parent}: {exc}",
                             f"make it writable, point {STORE_VAR} at another folder, or set "
                             f"{STORE_VAR}=off") from exc
        with entry.locked():
            if entry.is_complete() and not force:  # another process built it meanwhile
                return Built(entry.path, True)
            if entry.marker.exists() or entry.path.exists():
                (say or (lambda _: None))(f"removing the unfinished store entry {entry.path}")
            entry.discard()
            started = time.monotonic()
            target = entry.path if in_place else entry.path.with_name(
                f"{key.slug}{PARTIAL}{os.getpid()}")
            try:
                build(target)
                if not in_place:
                    target.rename(entry.path)
                entry.complete(files, started)
            except BaseException:
                entry.marker.unlink(missing_ok=True)
                remove_path(target)
                if not in_place:
                    remove_path(entry.path)
                raise
            return Built(entry.path, False, time.monotonic() - started)

    def entries(self) -> list[EntryInfo]:
        """Every folder or file under the store, complete or not, with its size."""
        found: list[EntryInfo] = []
        if not self.root.is_dir():
            return found
        for kind in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for path in sorted(kind.iterdir()):
                if path.name.endswith((".json", ".lock")) or PARTIAL in path.name:
                    if PARTIAL in path.name:
                        found.append(EntryInfo(kind.name, path, False, tree_size(path)))
                    continue
                marker = path.with_name(path.name + ".json")
                found.append(EntryInfo(kind.name, path, marker.is_file(), tree_size(path)))
        return found

    def clear(self, *, dry_run: bool = False) -> tuple[int, list[str]]:
        """Remove every entry no build holds (bytes freed, lines saying what); a build under way
        keeps its entry."""
        freed, lines = 0, []
        for info in self.entries():
            lock = info.path.with_name(slug_of(info.path.name) + ".lock")
            with open_lock(lock) as free:
                if not free:
                    lines.append(f"kept {info.path} (a build holds it)")
                    continue
                running = users(info.path)
                if running:
                    lines.append(f"kept {info.path} (in use by pid {', '.join(map(str, running))})")
                    continue
                if not dry_run:
                    info.path.with_name(info.path.name + ".json").unlink(missing_ok=True)
                    remove_path(info.path)
                    lock.unlink(missing_ok=True)
            freed += info.bytes
            lines.append(f"{'would remove' if dry_run else 'removed'} {info.path} "
                         f"({format_bytes(info.bytes)}{'' if info.complete else ', unfinished'})")
        return freed, lines


SLUG = re.compile(r"^(.+-[0-9a-f]{16})(\..*)?$")


def slug_of(name: str) -> str:
    """The entry a name under the store belongs to: `<slug>` itself, its `<slug>.partial-PID`
    build, a llama.cpp build's `<slug>.build` folder, its marker's temporary name. The entry's
    lock is `<slug>.lock`, held by whoever builds any of them."""
    match = SLUG.match(name)
    return match.group(1) if match else name


def users(path: Path, proc: Path = Path("/proc")) -> list[int]:
    """Live processes that run from under `path`: an argument of theirs, resolved (a checkout's
    .cache/engines link included), lies inside it. An engine started from a store entry must
    keep it while it runs."""
    root = os.path.realpath(path)
    found = []
    for folder in proc.glob("[0-9]*"):
        try:
            words = (folder / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for word in words[:4]:  # the interpreter, the script, `-m module`: enough to tell
            if word.startswith(b"/") and os.path.realpath(os.fsdecode(word)).startswith(root + os.sep):
                found.append(int(folder.name))
                break
    return found


@contextmanager
def open_lock(lock: Path) -> Iterator[bool]:
    """True while this process holds `lock` (taken without waiting); False when another does."""
    if not lock.exists():
        yield True
        return
    with open(lock, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@dataclass(frozen=True)
class EntryInfo:
    kind: str
    path: Path
    complete: bool
    bytes: int


def format_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{size} B"
        value /= 1024
    return f"{value:.1f} GiB"


def clear_store(environ: Mapping[str, str], *, dry_run: bool = False) -> list[str]:
    """`invoke clear-caches --store`: every entry no build or process holds, and the total."""
    store = open_store(environ)
    if store is None:
        return [f"no build store ({STORE_VAR}=off, or no home folder): nothing to remove there"]
    freed, lines = store.clear(dry_run=dry_run)
    verb = "would free" if dry_run else "freed"
    return [*(("(dry run) " if dry_run else "") + line for line in lines),
            f"build store {store.root}: {verb} {format_bytes(freed)}"
            + ("" if lines else " (it was empty)")
            + ("; the checkouts' links to it are rebuilt by their next install-engine, check --deep "
               "or make-model --trained" if freed and not dry_run else "")]


def open_store(environ: Mapping[str, str]) -> Store | None:
    root = store_root(environ)
    return Store(root) if root is not None else None


def link_entry(link: Path, entry: Path) -> None:
    """Point `link` (in the checkout's .cache) at a store entry, replacing an older link or an
    unfinished folder there; written under a temporary name and renamed, so it never dangles
    half-made."""
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() and Path(os.readlink(link)) == entry:
        return
    temporary = link.with_name(f".{link.name}{PARTIAL}{os.getpid()}")
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(entry, target_is_directory=entry.is_dir())
    if link.exists() and not link.is_symlink():
        remove_path(link)  # a real folder: the caller decided it is not to be kept
    temporary.replace(link)
