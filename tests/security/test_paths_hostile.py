"""Issue 36, rows 7 to 10: paths a user names that are not what the option needs.

Each case runs the task as a user does (`python -m invoke ...` in a copy of the project) and
asserts what the user depends on: exit 1, `error:` and `fix:` as the last two lines, no
traceback, nothing written, and for the chart schema bounded memory and time:

  * row 7: `export --chart-schema /dev/zero` read until memory ran out (MemoryError under a
    2 GiB cap, the host's OOM killer without one); a huge regular file did the same;
  * row 8: a chart schema whose $ref leads back to itself: RecursionError;
  * row 9: `export --out` naming a file, a path under a file, a device, /proc (and a folder or
    FIFO where an exported file belongs: IsADirectoryError, a hang);
  * row 10: `make-model --out` the same (NotADirectoryError, FileExistsError), and a folder of
    someone else's files, which make-model deleted to put the model in its place.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import copy_project

from vllmstack.core.paths import Project

# A profile every target exports without an error finding (tests/test_export.py's task test).
PROFILE = ("--platform", "2xr9700", "--model", "qwen3.8-27b")
MEMORY_CAP = 2 * 1024**3
TIMEOUT = 120  # a refusal takes seconds; a read of /dev/zero or a hang would not end


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Project:
    return Project(copy_project(tmp_path_factory.mktemp("paths-hostile")))


def cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def invoke(project: Project, *args: str) -> subprocess.CompletedProcess[str]:
    """The task as a user runs it, with its address space capped: whatever it reads is bounded."""
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=project.root, text=True,
                          capture_output=True, check=False, timeout=TIMEOUT, preexec_fn=cap_memory)


def refused(done: subprocess.CompletedProcess[str]) -> str:
    """The error line of a refusal: exit 1, `error:`/`fix:` last, no traceback, no MemoryError."""
    both = done.stdout + done.stderr
    assert "Traceback" not in both and "MemoryError" not in both and "RecursionError" not in both, both
    assert done.returncode == 1, both
    error, fix = done.stderr.splitlines()[-2:]
    assert error.startswith("error: ") and fix.startswith("fix:"), done.stderr
    return error


def tree(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under `folder` (links not followed) with its kind, size and mtime: what a write
    changes, without reading a 4 GiB file."""
    found = {}
    for top, folders, files in os.walk(folder):
        for name in folders + files:
            info = (Path(top) / name).lstat()
            found[str((Path(top) / name).relative_to(folder))] = (
                info.st_mode, info.st_size, info.st_mtime_ns)
    return found


def making_leftovers(folder: Path) -> list[str]:
    """make-model's staging folders (`.making-*`) left in `folder`."""
    try:
        return [p.name for p in folder.iterdir() if p.name.startswith(".making-")]
    except OSError:
        return []


# --- row 7: a chart schema that is a device or too large ---------------------------------------

@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "sparse-4-GiB"])
def test_a_chart_schema_that_never_ends_is_refused_before_it_is_read(
        project: Project, tmp_path: Path, kind: str) -> None:
    if kind == "dev-zero":
        schema, expect = Path("/dev/zero"), "is not a regular file (it is a device)"
    elif kind == "fifo":
        schema, expect = tmp_path / "values.schema.json", "is not a regular file (it is a FIFO"
        os.mkfifo(schema)
    else:  # a regular file larger than the cap: read whole, it was a MemoryError too
        schema, expect = tmp_path / "values.schema.json", "is larger than 8388608 bytes"
        with schema.open("wb") as handle:
            handle.truncate(4 * 1024**3)
    before = tree(tmp_path)
    error = refused(invoke(project, "export", "--to", "production-stack", *PROFILE,
                           "--chart-schema", str(schema), "--out", str(tmp_path / "out")))
    assert error.startswith(f"error: --chart-schema {schema} ") and expect in error
    assert tree(tmp_path) == before  # no --out folder, nothing else


# --- row 8: a chart schema that refers to itself ----------------------------------------------

SELF_REFERENCING = {
    "root": {"$ref": "#"},
    "cycle": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
              "$ref": "#/$defs/a"},
    "in-a-property": {"type": "object", "properties": {
        "servingEngineSpec": {"allOf": [{"$ref": "#/properties/servingEngineSpec"}]}}},
}


@pytest.mark.parametrize("name", sorted(SELF_REFERENCING))
def test_a_self_referencing_chart_schema_is_a_named_error(project: Project, tmp_path: Path,
                                                           name: str) -> None:
    schema = tmp_path / "values.schema.json"
    schema.write_text(json.dumps(SELF_REFERENCING[name]))
    before = tree(tmp_path)
    error = refused(invoke(project, "export", "--to", "production-stack", *PROFILE,
                           "--chart-schema", str(schema), "--out", str(tmp_path / "out")))
    assert error.startswith(f"error: {schema}: refers to itself without end")
    assert tree(tmp_path) == before


# --- rows 9 and 10: an output folder that is not one ------------------------------------------

def hostile_out(tmp_path: Path, case: str) -> tuple[Path, str]:
    """An --out of the kind `case` names, and what the error line must say about it."""
    file = tmp_path / "a-file"
    file.write_text("someone's notes\n")
    if case == "existing-file":
        return file, f"--out {file} is a file, not a folder"
    if case == "under-a-file":
        return file / "sub", f"--out {file / 'sub'} is under {file}, which is a file, not a folder"
    if case == "dev-null":
        return Path("/dev/null"), "--out /dev/null is a device, not a folder"
    if case == "proc":
        return Path("/proc/x"), "--out /proc/x is in /proc"
    assert case == "link-into-proc"
    (tmp_path / "link").symlink_to("/proc/self")
    return tmp_path / "link" / "x", f"--out {tmp_path / 'link' / 'x'} is in /proc"


OUT_CASES = ["existing-file", "under-a-file", "dev-null", "proc", "link-into-proc"]


@pytest.mark.parametrize("case", OUT_CASES)
def test_export_out_that_is_not_a_folder_is_refused(project: Project, tmp_path: Path,
                                                    case: str) -> None:
    out, expect = hostile_out(tmp_path, case)
    before = tree(tmp_path)
    error = refused(invoke(project, "export", "--to", "kube", *PROFILE, "--out", str(out)))
    assert error == f"error: {expect}" or error.startswith(f"error: {expect}")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_export_refuses_what_is_not_a_file_where_it_writes_one(project: Project, tmp_path: Path,
                                                               kind: str) -> None:
    """The reverse: a folder (or a FIFO, which the old check read and hung on) where the export
    writes a file."""
    out = tmp_path / "out"
    out.mkdir()
    target = out / "qwen3.8-27b.yaml"
    target.mkdir() if kind == "folder" else os.mkfifo(target)
    before = tree(tmp_path)
    error = refused(invoke(project, "export", "--to", "kube", *PROFILE, "--out", str(out)))
    what = "a folder" if kind == "folder" else "a FIFO (named pipe)"
    assert error.startswith(f"error: {target} is {what}, where a file belongs")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("case", OUT_CASES)
def test_make_model_out_that_is_not_a_folder_is_refused(project: Project, tmp_path: Path,
                                                        case: str) -> None:
    out, expect = hostile_out(tmp_path, case)
    before = tree(tmp_path)
    error = refused(invoke(project, "make-model", "--out", str(out)))
    assert error.startswith(f"error: {expect}")
    assert tree(tmp_path) == before
    assert making_leftovers(tmp_path) == making_leftovers(Path("/dev")) == []


def test_make_model_leaves_a_folder_of_other_files_as_it_is(project: Project, tmp_path: Path) -> None:
    """`--out ~/models` (the folder above the model): making the model there deleted the folder."""
    models = tmp_path / "models"
    (models / "other-model").mkdir(parents=True)
    (models / "other-model" / "config.json").write_text("{}\n")
    (models / "notes.txt").write_text("keep me\n")
    before = tree(tmp_path)
    error = refused(invoke(project, "make-model", "--out", str(models)))
    assert error.startswith(f"error: --out {models} is a folder that holds files make-model did "
                            "not write")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("target", ["/dev/zero", "fifo", "folder", "sparse"])
def test_a_tokenizer_that_is_not_a_tokenizer_file_is_refused_before_it_is_read(
        tmp_path: Path, target: str) -> None:
    # bench --tokenizer, and every probe: the Rust reader would take /dev/zero whole.
    from helpers import finishes

    from vllmstack.workload.prompts import TokenizerError, load_tokenizer

    if target == "fifo":
        path = tmp_path / "tokenizer.json"
        os.mkfifo(path)
    elif target == "folder":
        path = tmp_path / "tokenizer.json"
        path.mkdir()
    elif target == "sparse":
        path = tmp_path / "tokenizer.json"
        with path.open("wb") as sparse:
            sparse.truncate(4 * 2**30)
    else:
        path = Path(target)
    with pytest.raises(TokenizerError) as err:
        finishes(lambda: load_tokenizer(path), 30)
    said = str(err.value)
    assert str(path) in said and ("not a tokenizer.json file" in said or "more than a tokenizer" in said)


def test_a_safetensors_header_that_claims_too_much_is_refused(tmp_path: Path) -> None:
    import struct

    from vllmstack.core.files import PathKindError
    from vllmstack.models.tiny import ModelMakerError, read_safetensors_header

    lying = tmp_path / "model.safetensors"
    lying.write_bytes(struct.pack("<Q", 2**62) + b"{}")
    with pytest.raises(ModelMakerError, match="more than safetensors allows"):
        read_safetensors_header(lying)
    os.mkfifo(tmp_path / "pipe.safetensors")
    with pytest.raises(PathKindError, match="FIFO"):
        read_safetensors_header(tmp_path / "pipe.safetensors")


WRONG_KINDS = ("a folder", "under a file", "/dev/zero", "/proc/x", "a fifo")
OUTPUT_OPTIONS = (("report", "--out"), ("gguf-convert", "--out"), ("bench", "--history-dir"))


@pytest.mark.parametrize(("task", "where"), [
    (task, where) for task in OUTPUT_OPTIONS for where in WRONG_KINDS
    if not (where == "a folder" and task[1] == "--history-dir")])  # a folder is what it names
def test_every_other_output_path_option_refuses_the_wrong_kind(
        tmp_path: Path, where: str, task: tuple[str, str]) -> None:
    # The rule for every path option: report --out and gguf-convert --out name a file,
    # bench --history-dir a folder; each refuses what cannot be written there, before any work.
    from helpers import copy_project

    project = Project(copy_project(tmp_path / "stack"))
    name, option = task
    if where == "a folder":
        path = tmp_path / "out"
        path.mkdir()
    elif where == "under a file":
        (tmp_path / "file").write_text("mine")
        path = tmp_path / "file" / "x"
    elif where == "a fifo":
        path = tmp_path / "pipe"
        os.mkfifo(path)
    else:
        path = Path(where)
    model = tmp_path / "model"
    if name == "gguf-convert":  # a real checkpoint, so the refusal is --out's, not the model's
        from vllmstack.models import tiny

        tiny.make_model("tiny", out=model)
    args = {"report": ["report", "--out", str(path)],
            "gguf-convert": ["gguf-convert", str(model), "--out", str(path)],
            "bench": ["bench", "--history-dir", str(path), "--url", "http://127.0.0.1:9"]}[name]
    error = refused(invoke(project, *args))
    assert option in error and str(path) in error
    assert (tmp_path / "file").read_text() == "mine" if where == "under a file" else True
