"""schema.yaml's `flag:` entries are the one table the argv builder writes flags from."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vllmstack.config import vllm_args
from vllmstack.config.profiles import resolve
from vllmstack.config.schema import SchemaError, load_schema
from vllmstack.config.vllm_args import ArgvError, build_serve_argv, flag_origins, flag_table
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project

ROOT = Path(__file__).resolve().parents[1]

# The tables as vllm_args.py wrote them out by hand before schema.yaml became their source.
HAND_VALUE_FLAGS = (
    ("VLLM_SERVED_NAME", "--served-model-name"),
    ("VLLM_TOKENIZER", "--tokenizer"),
    ("VLLM_MODEL_REVISION", "--revision"),
    ("VLLM_HF_CONFIG_PATH", "--hf-config-path"),
    ("VLLM_MAX_MODEL_LEN", "--max-model-len"),
    ("VLLM_MAX_BATCHED_TOKENS", "--max-num-batched-tokens"),
    ("VLLM_MAX_NUM_SEQS", "--max-num-seqs"),
    ("VLLM_GPU_MEM_UTIL", "--gpu-memory-utilization"),
    ("VLLM_KV_CACHE_DTYPE", "--kv-cache-dtype"),
    ("VLLM_TP", "--tensor-parallel-size"),
    ("VLLM_DTYPE", "--dtype"),
    ("ATTENTION_BACKEND", "--attention-backend"),
)
HAND_JSON_FLAGS = (
    # Added after the hand-written tables (issue 24): the server's default chat-template kwargs.
    ("VLLM_CHAT_TEMPLATE_KWARGS", "--default-chat-template-kwargs"),
    ("VLLM_LIMIT_MM_PER_PROMPT", "--limit-mm-per-prompt"),
    ("VLLM_GENERATION_CONFIG", "--override-generation-config"),
)
HAND_ARGS_KEYS = ("VLLM_TOOL_CHOICE", "VLLM_PROFILER_ARGS", "VLLM_EXTRA_ARGS")
# The flag -> setting table checks/deep.py once wrote by hand (it now calls flag_origins()).
HAND_ORIGINS = {
    **{flag: key for key, flag in (*HAND_VALUE_FLAGS, *HAND_JSON_FLAGS)},
    "--port": "VLLM_PORT",
    "--chat-template": "VLLM_CHAT_TEMPLATE",
    "--enable-prefix-caching": "VLLM_ENABLE_PREFIX_CACHING",
    "--no-enable-prefix-caching": "VLLM_ENABLE_PREFIX_CACHING",
    "--enforce-eager": "VLLM_ENFORCE_EAGER",
    "--speculative-config": "VLLM_SPEC_DECODE",
    "--no-async-scheduling": "VLLM_SPEC_DECODE",
}


def test_the_schema_derived_tables_equal_the_hand_written_ones() -> None:
    table = flag_table()
    assert table.value == HAND_VALUE_FLAGS
    assert table.json == HAND_JSON_FLAGS
    assert table.args == HAND_ARGS_KEYS
    assert flag_origins() == HAND_ORIGINS


def test_the_module_constants_are_the_schema_tables() -> None:
    table = flag_table()
    constants = (vllm_args.VALUE_FLAGS, vllm_args.JSON_FLAGS, vllm_args.ARGS_KEYS)
    assert (table.value, table.json, table.args) == constants
    with pytest.raises(AttributeError, match="NO_SUCH_TABLE"):
        vllm_args.__getattr__("NO_SUCH_TABLE")


def test_importing_the_builder_reads_no_schema() -> None:
    # checks/deep.py reads the table too: importing it must not read the schema either.
    code = ("import vllmstack.checks.deep; import vllmstack.config.vllm_args as m; "
            "print(m._packaged_table.cache_info().currsize)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "0"


@pytest.mark.parametrize("key", [k.name for k in load_schema().keys.values()
                                 if k.becomes == "vllm-flag" and (k.flag or "").startswith("--")])
def test_every_schema_flag_reaches_the_argv(project: Project, key: str) -> None:
    spec = load_schema().keys[key]
    value = {"bool": "true", "json": '{"method": "mtp"}', "int": "3", "float": "0.5"}.get(
        spec.type, spec.choices[-1] if spec.choices else "x.jinja")
    resolved = resolve(project, model="qwen3.8-27b-awq", overrides=[f"{key}={value}"], environ={})
    assert spec.flag in build_serve_argv(resolved).argv


def test_a_new_value_key_in_the_schema_becomes_a_flag(project: Project) -> None:
    text = (ROOT / "vllmstack" / "config" / "schema.yaml").read_text()
    text += ("VLLM_NEW_KNOB:\n  type: int\n  becomes: vllm-flag\n  flag: --new-knob\n"
             "  description: A flag vLLM grew.\n")
    schema = load_schema(text)
    resolved = resolve(project, overrides=["VLLM_NEW_KNOB=7"], environ={}, schema=schema)
    argv = build_serve_argv(resolved).argv
    assert argv[argv.index("--new-knob") + 1] == "7"
    assert argv.index("--attention-backend") < argv.index("--new-knob") < argv.index("--host")


def test_a_bool_flag_without_a_rule_is_a_schema_bug() -> None:
    text = (ROOT / "vllmstack" / "config" / "schema.yaml").read_text()
    text += ("VLLM_NEW_SWITCH:\n  type: bool\n  becomes: vllm-flag\n  flag: --new-switch\n"
             "  description: A switch vLLM grew.\n")
    with pytest.raises(SchemaError, match="VLLM_NEW_SWITCH is a bool flag"):
        flag_table(load_schema(text))


def test_an_empty_port_gets_the_schema_default(project: Project) -> None:
    resolved = resolve(project, overrides=["VLLM_PORT="], environ={})
    argv = build_serve_argv(resolved).argv
    assert argv[argv.index("--port") + 1] == load_schema().keys["VLLM_PORT"].default == "8180"


def test_argv_errors_are_stack_errors_with_a_fix(project: Project) -> None:
    resolved = resolve(project, overrides=["VLLM_GENERATION_CONFIG=[1]"], environ={})
    with pytest.raises(ArgvError, match="must be a JSON object at --set") as err:
        build_serve_argv(resolved)
    assert isinstance(err.value, StackError) and isinstance(err.value, ValueError)
    assert err.value.fix is not None and "single quotes" in err.value.fix
    resolved = resolve(project, overrides=["VLLM_MODEL="], environ={})
    with pytest.raises(ArgvError, match="VLLM_MODEL is empty") as err:
        build_serve_argv(resolved)
    assert "env/models/qwen3.8-27b.env" in (err.value.fix or "")
