"""`invoke gguf-convert`: llama.cpp's own converter, run right, with clear errors around it.

Unit level: which checkpoint and which output path, which Python (one with torch, transformers,
numpy and pyyaml, or an error naming what each candidate lacks), the argv (the wrapper, the
pinned tree, the outtype, a temporary output renamed into place), a made model's recorded
pre-tokenizer, a name llama.cpp does not implement refused, and the converter's refusal of an
unknown pre-tokenizer turned into a fix. The wrapper script is run for real against a stand-in
converter (no torch needed). The real conversion of the tiny model is in
tests/test_gguf_convert_real.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy
import pytest

from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.image.llamacpp_source import PreparedSource
from vllmstack.models import gguf_convert as gc
from vllmstack.models.tiny import GGUF_PRE_TOKENIZER, MODEL_RECORD, make_model

VOCAB_CPP = ('if (tokenizer_pre == "gpt-2" ||\n    tokenizer_pre == "qwen2" ||\n'
             '    tokenizer_pre == "llama3") {}\n')


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for the prepared llama.cpp tree (what prepare_source returns)."""
    folder = tmp_path / "llama.cpp"
    (folder / "src").mkdir(parents=True)
    (folder / "src" / "llama-vocab.cpp").write_text(VOCAB_CPP)
    prepared = PreparedSource(folder, "9993", tmp_path / "sdist.tar.gz", "0" * 64, "1" * 64)
    monkeypatch.setattr(gc, "prepare_source", lambda *a, **k: prepared)
    return folder


def checkpoint(folder: Path, record: str | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    if record is not None:
        (folder / MODEL_RECORD).write_text(json.dumps({"gguf_pre_tokenizer": record}))
    return folder


def converter_writes(argv: tuple[str, ...]) -> Result:
    """The converter's success: it writes a (small) GGUF file at --outfile."""
    writer = gguf.GGUFWriter(argv[argv.index("--outfile") + 1], "qwen3")
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    writer.add_tensor("token_embd.weight", numpy.zeros((4, 8), dtype=numpy.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Result(argv, 0)


def runner_with(python: str = sys.executable, missing: list[str] | None = None) -> RecordingRunner:
    runner = RecordingRunner()
    runner.respond([python, "-c", gc.FIND_SCRIPT], Result((), 0, json.dumps(missing or [])))
    runner.respond([python, str(gc.RUNNER)], converter_writes)
    return runner


def convert(project: Project, runner: RecordingRunner, model: Path | str, **kwargs: object) -> gc.Converted:
    resolved = resolve(project, platform="cpu", overrides=[f"MODELS_DIR={project.root / 'models'}"],
                       environ={})
    options: dict[str, object] = {"python": sys.executable, "stream": False, **kwargs}
    return gc.gguf_convert(project, resolved, runner, model=str(model), environ={},
                           say=lambda _: None, **options)  # type: ignore[arg-type]


def test_a_made_model_records_its_pre_tokenizer(tmp_path: Path) -> None:
    made = make_model("tiny", out=tmp_path / "tiny")
    assert gc.record_pre_tokenizer(made.folder) == GGUF_PRE_TOKENIZER == "gpt-2"


def test_the_converter_runs_through_the_wrapper_into_models_dir(project: Project, tree: Path,
                                                                tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "my-model", record="gpt-2")
    runner = runner_with()
    done = convert(project, runner, model)
    target = project.root / "models" / "my-model-f16.gguf"
    assert done.path == target
    assert (done.header["architecture"], done.header["tensors"]) == ("qwen3", 1)
    assert done.header["file_type_name"] == "MOSTLY_F16"
    argv = next(c for c in runner.calls if str(gc.RUNNER) in c)
    partial = str(target.with_name(".my-model-f16.gguf.partial"))
    assert argv == (sys.executable, str(gc.RUNNER), "--source", str(tree), "--pre-tokenizer",
                    "gpt-2", "--", str(model), "--outfile", partial, "--outtype", "f16")
    assert done.pre_tokenizer == "gpt-2" and not Path(partial).exists()
    # An explicit --pre-tokenizer wins over the record; "" asks for the converter's own detection.
    runner = runner_with()
    convert(project, runner, model, outtype="q8_0", force=True, pre_tokenizer="")
    argv = next(c for c in runner.calls if str(gc.RUNNER) in c)
    assert "--pre-tokenizer" not in argv and argv[-2:] == ("--outtype", "q8_0")
    # The same conversion again is a no-op, as `make-model` is (a walk-through run twice works).
    runner = runner_with()
    again = convert(project, runner, model)
    assert not again.made and again.path == target
    assert not any(str(gc.RUNNER) in c for c in runner.calls)
    assert gc.render_converted(again).startswith(f"already converted: {target}")
    # Another checkpoint's file of that name is not overwritten without --force.
    other = checkpoint(tmp_path / "elsewhere" / "my-model", record="gpt-2")
    with pytest.raises(gc.ConvertError) as exists:
        convert(project, runner_with(), other)
    assert "already exists" in exists.value.cause
    assert exists.value.fix is not None and "--force" in exists.value.fix


def test_bad_input_is_refused_with_the_fix(project: Project, tree: Path, tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "m")
    with pytest.raises(gc.ConvertError) as outtype:
        convert(project, runner_with(), model, outtype="q4_k")
    assert outtype.value.cause == "--outtype 'q4_k' is not one of f16, bf16, q8_0, f32"
    with pytest.raises(gc.ConvertError) as name:
        convert(project, runner_with(), model, pre_tokenizer="gpt2")
    assert "'gpt2' is not a pre-tokenizer llama.cpp 9993 implements" in name.value.cause
    assert name.value.fix == "use one of its names: gpt-2, llama3, qwen2"
    (tmp_path / "empty").mkdir()
    with pytest.raises(gc.ConvertError) as folder:
        convert(project, runner_with(), tmp_path / "empty")
    assert "has no config.json" in folder.value.cause
    with pytest.raises(gc.ConvertError) as unknown:
        convert(project, runner_with(), "nobody/nothing")
    assert unknown.value.fix is not None and "invoke make-model tiny" in unknown.value.fix


def test_without_models_dir_the_file_goes_where_llamacpp_profiles_look(
        project: Project, tree: Path, tmp_path: Path) -> None:
    """Issue 23: no MODELS_DIR, no --out: the default models folder, which tiny-gguf reads."""
    from vllmstack.config.llamacpp_args import gguf_path

    model = checkpoint(tmp_path / "tiny-qwen3")
    environ = {"HOME": str(tmp_path / "home")}
    resolved = resolve(project, platform="cpu", overrides=["MODELS_DIR="], environ=environ)
    done = gc.gguf_convert(project, resolved, runner_with(), model=str(model), environ=environ,
                           python=sys.executable, say=lambda _: None)
    assert done.path == tmp_path / "home" / ".cache" / "vllmstack-models" / "tiny-qwen3-f16.gguf"
    served = resolve(project, platform="cpu", model="tiny-gguf", environ=environ)
    assert gguf_path(served, home=tmp_path / "home") == done.path
    done = gc.gguf_convert(project, resolved, runner_with(), model=str(model), environ=environ,
                           python=sys.executable, out=tmp_path / "x.gguf", say=lambda _: None)
    assert done.path == tmp_path / "x.gguf"


def test_an_out_that_is_a_folder_or_below_a_file_is_refused_before_converting(
        project: Project, tree: Path, tmp_path: Path) -> None:
    """Issue 22 item 12: the converter ran for minutes, then left a full-size .partial."""
    model = checkpoint(tmp_path / "m")
    (tmp_path / "outdir").mkdir()
    runner = runner_with()
    with pytest.raises(gc.ConvertError) as folder:
        convert(project, runner, model, out=tmp_path / "outdir")
    assert "is a folder" in folder.value.cause
    assert folder.value.fix and str(tmp_path / "outdir" / "m-f16.gguf") in folder.value.fix
    (tmp_path / "afile").write_text("x")
    with pytest.raises(gc.ConvertError) as below:
        convert(project, runner, model, out=tmp_path / "afile" / "sub" / "x.gguf")
    assert f"{tmp_path / 'afile'} is a file" in below.value.cause
    assert not any(str(gc.RUNNER) in c for c in runner.calls)  # refused before converting
    assert list(tmp_path.glob("**/*.partial")) == []


def test_an_interrupted_conversion_leaves_no_partial_file(project: Project, tree: Path,
                                                          tmp_path: Path) -> None:
    runner = runner_with()

    def interrupted(argv: tuple[str, ...]) -> Result:
        Path(argv[argv.index("--outfile") + 1]).write_bytes(b"x" * 4096)
        raise KeyboardInterrupt

    runner.respond([sys.executable, str(gc.RUNNER)], interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(project, runner, checkpoint(tmp_path / "m"))
    assert list((project.root / "models").glob(".*partial")) == []


def test_a_python_without_torch_is_named_with_what_it_lacks(project: Project, tree: Path,
                                                            tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "m")
    with pytest.raises(gc.ConvertError) as err:
        convert(project, runner_with(missing=["torch", "transformers"]), model)
    assert f"{sys.executable}: no torch, transformers" in err.value.cause
    assert err.value.fix is not None and "--python" in err.value.fix
    # Without --python: the CPU engine's environment first, then this Python.
    engine = project.cache / "engines" / "vllm-0.32.0+cpu" / "bin" / "python"
    engine.parent.mkdir(parents=True)
    engine.touch()
    assert gc.candidate_pythons(project) == [str(engine), sys.executable]
    runner = runner_with(python=str(engine))
    runner.respond([sys.executable, "-c", gc.FIND_SCRIPT], Result((), 0, '["torch"]'))
    done = convert(project, runner, model, python=None)
    assert done.python == str(engine)


def test_a_file_that_does_not_read_back_is_an_error(project: Project, tree: Path,
                                                    tmp_path: Path) -> None:
    runner = runner_with()

    def garbage(argv: tuple[str, ...]) -> Result:
        Path(argv[argv.index("--outfile") + 1]).write_bytes(b"GGUF")
        return Result(argv, 0)

    runner.respond([sys.executable, str(gc.RUNNER)], garbage)
    with pytest.raises(gc.ConvertError, match="does not read back as GGUF"):
        convert(project, runner, checkpoint(tmp_path / "m"))


def test_an_unknown_pre_tokenizer_becomes_a_fix(project: Project, tree: Path, tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "m")
    runner = runner_with()
    runner.respond([sys.executable, str(gc.RUNNER)], Result((), 1, "", (
        "WARNING:hf-to-gguf:** WARNING: The BPE pre-tokenizer was not recognized!\n"
        "NotImplementedError: BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")))
    with pytest.raises(gc.ConvertError) as err:
        convert(project, runner, model)
    assert "llama.cpp's converter failed (exit 1)" in err.value.cause
    assert err.value.fix is not None and "--pre-tokenizer NAME" in err.value.fix
    assert "gpt-2, llama3, qwen2" in err.value.fix
    assert list((project.root / "models").glob("*")) == []


STAND_IN = '''
import sys
from conversion.base import TextModel
out = sys.argv[sys.argv.index("--outfile") + 1]
open(out, "w").write(TextModel().get_vocab_base_pre(None))
'''
BASE = '''
class TextModel:
    def get_vocab_base_pre(self, tokenizer):
        {body}
'''


@pytest.mark.parametrize(("body", "flag", "expected"), [
    ('raise NotImplementedError("BPE pre-tokenizer was not recognized")', "gpt-2", "gpt-2"),
    ('return "qwen2"', "gpt-2", "qwen2"),  # a known hash keeps its own name
])
def test_the_wrapper_names_only_an_unknown_pre_tokenizer(tmp_path: Path, body: str, flag: str,
                                                         expected: str) -> None:
    source = tmp_path / "llama.cpp"
    (source / "conversion").mkdir(parents=True)
    (source / "gguf-py").mkdir()
    (source / "conversion" / "__init__.py").write_text("")
    (source / "conversion" / "base.py").write_text(BASE.format(body=body))
    (source / "convert_hf_to_gguf.py").write_text(STAND_IN)
    out = tmp_path / "out.txt"
    done = subprocess.run([sys.executable, str(gc.RUNNER), "--source", str(source),
                           "--pre-tokenizer", flag, "--", "model", "--outfile", str(out)],
                          capture_output=True, text=True, check=False, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert out.read_text() == expected
    assert ("writing tokenizer.ggml.pre = 'gpt-2'" in done.stderr) == (expected == "gpt-2")
    # Without the flag the converter's refusal stands.
    refused = subprocess.run([sys.executable, str(gc.RUNNER), "--source", str(source), "--",
                              "model", "--outfile", str(out)], capture_output=True, text=True,
                             check=False, cwd=tmp_path)
    assert (refused.returncode != 0) == (expected == "gpt-2")


LOUD_BASE = '''
import logging
class TextModel:
    def get_vocab_base_pre(self, tokenizer):
        logging.getLogger("hf-to-gguf").warning("** WARNING: The BPE pre-tokenizer was not recognized!")
        raise NotImplementedError("BPE pre-tokenizer was not recognized")
'''
TEMPLATE_STAND_IN = '''
import logging, sys
from conversion.base import TextModel
logging.basicConfig(level=logging.INFO)
logging.getLogger("gguf.vocab").info("Setting chat_template to {%- for m in messages %}" + "x" * 3000)
out = sys.argv[sys.argv.index("--outfile") + 1]
open(out, "w").write(TextModel().get_vocab_base_pre(None))
'''


@pytest.mark.parametrize("quiet", [False, True])
def test_the_made_models_pre_tokenizer_is_applied_without_a_warning_box(
        tmp_path: Path, quiet: bool) -> None:
    """Issue 23: converting the stack's own model printed two warning boxes and the whole chat
    template; with --quiet (a made model whose record is current) it prints neither."""
    source = tmp_path / "llama.cpp"
    (source / "conversion").mkdir(parents=True)
    (source / "gguf-py").mkdir()
    (source / "conversion" / "__init__.py").write_text("")
    (source / "conversion" / "base.py").write_text(LOUD_BASE)
    (source / "convert_hf_to_gguf.py").write_text(TEMPLATE_STAND_IN)
    out = tmp_path / "out.txt"
    done = subprocess.run([sys.executable, str(gc.RUNNER), "--source", str(source),
                           "--pre-tokenizer", "gpt-2", *(["--quiet"] if quiet else []), "--",
                           "model", "--outfile", str(out)],
                          capture_output=True, text=True, check=False, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert out.read_text() == "gpt-2"
    said = done.stdout + done.stderr
    assert ("was not recognized" in said) is not quiet and ("!!!!" in said) is not quiet
    assert "Setting chat_template (3024 characters)" in said and "{%- for" not in said


def test_only_a_current_record_makes_the_conversion_quiet(project: Project, tree: Path,
                                                          tmp_path: Path) -> None:
    made = make_model("tiny", out=tmp_path / "tiny-qwen3")
    assert gc.record_is_current(made.folder)
    runner = runner_with()
    convert(project, runner, made.folder)
    argv = next(c for c in runner.calls if str(gc.RUNNER) in c)
    assert argv[argv.index("--pre-tokenizer"):argv.index("--") + 1] == (
        "--pre-tokenizer", "gpt-2", "--quiet", "--")
    # Someone edited the tokenizer: the name is no longer the stack's fact, so it is said again.
    tokenizer = made.folder / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text().replace('"<think>"', '"<thonk>"'))
    assert not gc.record_is_current(made.folder)
    runner = runner_with()
    convert(project, runner, made.folder, force=True)
    assert "--quiet" not in next(c for c in runner.calls if str(gc.RUNNER) in c)
    # An explicit --pre-tokenizer is the user's claim: never quiet.
    runner = runner_with()
    convert(project, runner, checkpoint(tmp_path / "other", record="gpt-2"), pre_tokenizer="qwen2")
    assert "--quiet" not in next(c for c in runner.calls if str(gc.RUNNER) in c)
