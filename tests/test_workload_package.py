"""`vllmstack.workload`: the corpus ships as package data, every user finds it where it is, and the
split the runners import in the engine's Python pulls in nothing else of the package."""

from __future__ import annotations

import fnmatch
import json
import subprocess
import sys
import tomllib

from helpers import ROOT

from vllmstack.tune import kv_copy
from vllmstack.workload.corpus import BUNDLED_CORPUS, CORPUS_FILE
from vllmstack.workload.prompts import load_corpus

PACKAGE = ROOT / "vllmstack"


def test_every_corpus_file_is_declared_package_data() -> None:
    # A wheel holds only what [tool.setuptools.package-data] names: a corpus file it misses
    # would be on disk in a checkout and absent from an install.
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["vllmstack"]
    shipped = sorted(p.relative_to(PACKAGE).as_posix()
                     for p in (PACKAGE / "workload" / "corpus").iterdir() if p.is_file())
    assert f"workload/corpus/{CORPUS_FILE}" in shipped
    missing = [name for name in shipped if not any(fnmatch.fnmatch(name, pat) for pat in patterns)]
    assert not missing, f"corpus files not declared as package data: {missing}"


def test_the_calibration_default_is_the_corpus_the_prompts_read() -> None:
    assert kv_copy.DEFAULT_CORPUS == BUNDLED_CORPUS
    assert BUNDLED_CORPUS.is_file()
    paragraphs = [p.strip() for p in BUNDLED_CORPUS.read_text("utf-8").split("\n\n") if p.strip()]
    assert paragraphs == load_corpus()


def test_the_split_imports_nothing_else_of_the_package() -> None:
    # train_runner imports it in the engine's Python, where the stack's dependencies are absent:
    # the package, workload's __init__ and the module itself must be all that loads.
    probe = ("import json, sys; import vllmstack.workload.corpus; "
             "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'vllmstack')))")
    done = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
                           + probe], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["vllmstack", "vllmstack.workload", "vllmstack.workload.corpus"]
