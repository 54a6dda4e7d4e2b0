"""The llama-server argv (ENGINE=llamacpp): flags from schema.yaml's llamacpp-flag keys, the
endpoint both engines share, GGUF paths under MODELS_DIR, and values llama-server would refuse
refused here with their key and file:line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllmstack.config.engines.table import engine_kind
from vllmstack.config.llamacpp_args import (
    ALWAYS_FLAGS,
    LlamacppFlags,
    build_llamacpp_argv,
    gguf_path,
    llamacpp_flags,
)
from vllmstack.config.profiles import Resolved, resolve
from vllmstack.config.schema import SchemaError, load_schema
from vllmstack.config.vllm_args import ArgvError
from vllmstack.core.paths import Project

DATA = Path(__file__).parent / "data" / "llamacpp"
ENVIRON = {"HOME": "/home/op"}


def image_of(resolved: Resolved) -> str:
    return engine_kind(resolved).image(resolved)


def profile(project: Project, *sets: str, model: str = "qwen3.6-27b-gguf",
            platform: str = "nvidia") -> Resolved:
    return resolve(project, model=model, platform=platform,
                   overrides=["MODELS_DIR=/models", *sets], environ=ENVIRON)


def value_of(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_the_profile_becomes_llama_servers_argv(project: Project) -> None:
    argv = build_llamacpp_argv(profile(project), host="127.0.0.1", binary="/opt/llama-server").argv
    assert argv[0] == "/opt/llama-server"
    # A relative GGUF is under MODELS_DIR; the endpoint is the one both engines share.
    assert value_of(argv, "--model") == "/models/Qwen3.6-27B-Q8_0.gguf"
    assert value_of(argv, "--host") == "127.0.0.1" and value_of(argv, "--port") == "8180"
    assert value_of(argv, "--alias") == "qwen3.6-27b-gguf"
    assert value_of(argv, "--ctx-size") == "131072" and value_of(argv, "--parallel") == "2"
    assert value_of(argv, "--spec-type") == "draft-mtp" and value_of(argv, "--spec-draft-n-max") == "2"
    assert "--kv-unified" in argv
    # The stack reads /metrics and templates tool calls; the web page is not served.
    assert set(ALWAYS_FLAGS) <= set(argv) and "--metrics" in argv and "--no-webui" in argv
    # Removed in the pinned server: it would abort at start.
    assert "--draft-max" not in argv and "--model-draft" not in argv


def test_keys_no_layer_sets_leave_llama_servers_defaults(project: Project) -> None:
    argv = build_llamacpp_argv(profile(project, model="tiny-gguf", platform="cpu"), host="h").argv
    for flag in ("--n-gpu-layers", "--flash-attn", "--cache-type-k", "--cache-type-v",
                 "--spec-draft-n-max", "--n-cpu-moe", "--spec-draft-model", "--spec-type"):
        assert flag not in argv, flag
    # An empty value drops a flag the profile set.
    argv = build_llamacpp_argv(profile(project, "LLAMACPP_CTX="), host="h").argv
    assert "--ctx-size" not in argv


def test_a_bool_key_switches_its_flag_on_and_off(project: Project) -> None:
    on = build_llamacpp_argv(profile(project, "LLAMACPP_KV_UNIFIED=true"), host="h").argv
    off = build_llamacpp_argv(profile(project, "LLAMACPP_KV_UNIFIED=false"), host="h").argv
    assert "--kv-unified" in on and "--no-kv-unified" not in on
    assert "--no-kv-unified" in off and "--kv-unified" not in off


def test_extra_args_are_appended_last_as_shell_words(project: Project) -> None:
    argv = build_llamacpp_argv(profile(
        project, "LLAMACPP_EXTRA_ARGS=--cache-ram 0 --chat-template-kwargs '{\"a\": 1}'"), host="h").argv
    assert argv[-4:] == ["--cache-ram", "0", "--chat-template-kwargs", '{"a": 1}']


def test_absolute_paths_and_a_runtime_folder_for_models_dir(project: Project) -> None:
    resolved = profile(project, "LLAMACPP_DRAFT_MODEL=/srv/draft.gguf")
    argv = build_llamacpp_argv(resolved, host="h", models_dir="/mnt/models").argv
    assert value_of(argv, "--model") == "/mnt/models/Qwen3.6-27B-Q8_0.gguf"
    assert value_of(argv, "--spec-draft-model") == "/srv/draft.gguf"
    assert gguf_path(resolved, "LLAMACPP_DRAFT_MODEL") == Path("/srv/draft.gguf")


@pytest.mark.parametrize(("setting", "key", "words"), [
    ("LLAMACPP_GPU_LAYERS=lots", "LLAMACPP_GPU_LAYERS", "whole number, auto or all"),
    ("LLAMACPP_GPU_LAYERS=-3", "LLAMACPP_GPU_LAYERS", "whole number, auto or all"),
    ("LLAMACPP_PARALLEL=0", "LLAMACPP_PARALLEL", "llama-server refuses"),
    ("LLAMACPP_SPEC_TYPE=draft-mtp,eagle", "LLAMACPP_SPEC_TYPE", "eagle"),
    ("LLAMACPP_FLASH_ATTN=maybe", "LLAMACPP_FLASH_ATTN", "'on', 'off', 'auto'"),
    ("LLAMACPP_CACHE_TYPE_K=q3_k", "LLAMACPP_CACHE_TYPE_K", "q8_0"),
    ("LLAMACPP_CTX=lots", "LLAMACPP_CTX", "whole number"),
    ("LLAMACPP_EXTRA_ARGS=--alias 'open", "LLAMACPP_EXTRA_ARGS", "shell words"),
])
def test_a_value_llama_server_would_refuse_names_its_key_and_line(
        project: Project, setting: str, key: str, words: str) -> None:
    with pytest.raises(ArgvError) as caught:
        build_llamacpp_argv(profile(project, setting), host="h")
    assert key in caught.value.cause and "--set" in caught.value.cause
    assert words in caught.value.cause + caught.value.fix


def test_a_bad_value_in_a_profile_file_is_named_with_its_line(project: Project) -> None:
    path = project.env_dir / "models" / "qwen3.6-27b-gguf.env"
    path.write_text(path.read_text() + "LLAMACPP_PARALLEL=0\n")
    line = len(path.read_text().splitlines())
    with pytest.raises(ArgvError) as caught:
        build_llamacpp_argv(profile(project), host="h")
    assert f"env/models/qwen3.6-27b-gguf.env:{line}" in caught.value.cause


def test_missing_model_name_or_models_dir_are_refused_with_a_fix(project: Project) -> None:
    with pytest.raises(ArgvError, match="LLAMACPP_MODEL is empty") as caught:
        build_llamacpp_argv(profile(project, "LLAMACPP_MODEL="), host="h")
    assert "env/models/qwen3.6-27b-gguf.env" in caught.value.fix
    with pytest.raises(ArgvError, match="VLLM_SERVED_NAME is empty"):
        build_llamacpp_argv(profile(project, "VLLM_SERVED_NAME="), host="h")
    # Without MODELS_DIR a relative GGUF path is under the stack's default models folder, where
    # `invoke gguf-convert` writes (issue 23: the walk-through needs no .env edit).
    resolved = resolve(project, model="tiny-gguf", platform="cpu", environ=ENVIRON)
    argv = build_llamacpp_argv(resolved, host="h").argv
    assert str(Path.home() / ".cache" / "vllmstack-models" / "tiny-qwen3-f16.gguf") in argv


def test_every_llamacpp_key_has_a_flag_and_the_table_follows_the_file() -> None:
    schema = load_schema()
    keys = [k.name for k in schema.keys.values() if k.becomes == "llamacpp-flag"]
    table = llamacpp_flags()
    assert [k for k, _ in table.value] + [k for k, _ in table.bools] + list(table.args) != []
    assert sorted(keys) == sorted([*dict(table.value), *dict(table.bools), *table.args])
    assert [k for k in keys if k in dict(table.value)] == [k for k, _ in table.value]
    assert table.flag("LLAMACPP_MODEL") == "--model"


def test_a_schema_entry_without_a_flag_is_a_schema_error() -> None:
    text = ("LLAMACPP_MODEL:\n  type: path\n  becomes: llamacpp-flag\n  flag: --model\n"
            "  description: m\nLLAMACPP_X:\n  type: int\n  becomes: llamacpp-flag\n  description: x\n")
    with pytest.raises(SchemaError, match="LLAMACPP_X"):
        llamacpp_flags(load_schema(text))
    ok = llamacpp_flags(load_schema(text.replace("  description: x\n", "  flag: --x\n  description: x\n")))
    assert isinstance(ok, LlamacppFlags) and ok.value == (("LLAMACPP_MODEL", "--model"),
                                                          ("LLAMACPP_X", "--x"))


def test_every_flag_the_stack_writes_is_in_the_pinned_servers_help() -> None:
    """tests/data/llamacpp/llama-server-help.txt is `llama-server --help` of the pinned build
    (b9993, CPU): a flag renamed or removed upstream fails here, not at boot."""
    help_text = (DATA / "llama-server-help.txt").read_text()
    flags = {flag for _, flag in (*llamacpp_flags().value, *llamacpp_flags().bools)}
    flags |= {"--host", "--port", "--alias", *ALWAYS_FLAGS}
    flags |= {"--no-" + flag.removeprefix("--") for _, flag in llamacpp_flags().bools}
    missing = sorted(f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", help_text))
    assert missing == []


def test_the_image_is_named_after_the_ref_and_the_platforms_backend(project: Project) -> None:
    assert image_of(profile(project)) == "localhost/llamacpp:9993-cuda"
    assert image_of(profile(project, model="tiny-gguf", platform="cpu")) == "localhost/llamacpp:9993-cpu"
    assert image_of(profile(project, platform="r9700")) == "localhost/llamacpp:9993-rocm"
    assert image_of(profile(project, "LLAMACPP_BACKEND=vulkan", platform="r9700")) == \
        "localhost/llamacpp:9993-vulkan"
    assert image_of(profile(project, "LLAMACPP_IMAGE=reg/llama:x")) == "reg/llama:x"
