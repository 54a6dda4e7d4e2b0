"""Every key a shipped file uses is known and documented; the schema is internally consistent."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllmstack.config import vllm_args
from vllmstack.config.profiles import read_env_file
from vllmstack.config.schema import load_schema, validate_value

ROOT = Path(__file__).resolve().parents[1]
# `# KEY=value` lines in .env.example are keys a user is invited to uncomment.
COMMENTED_KEY = re.compile(r"^#\s*([A-Z][A-Z0-9_]*)=")


def shipped_keys() -> dict[str, str]:
    """KEY -> first file:line that uses it, across env/ and .env.example."""
    files = [*sorted((ROOT / "env").rglob("*.env")), ROOT / ".env.example"]
    keys: dict[str, str] = {}
    for path in files:
        display = str(path.relative_to(ROOT))
        lines, problems = read_env_file(path, display)
        assert problems == [], problems
        for line in lines:
            keys.setdefault(line.key, f"{display}:{line.line}")
        for number, text in enumerate(path.read_text().splitlines(), start=1):
            match = COMMENTED_KEY.match(text)
            if match:
                keys.setdefault(match.group(1), f"{display}:{number}")
    return keys


def test_every_shipped_key_is_in_the_schema_with_a_description() -> None:
    schema = load_schema()
    missing = {k: where for k, where in shipped_keys().items() if k not in schema}
    assert missing == {}, f"add these to vllmstack/schema.yaml: {missing}"
    undocumented = [k for k in shipped_keys() if len(schema.keys[k].description) < 10]
    assert undocumented == []


def test_every_schema_key_is_documented_and_its_default_is_valid() -> None:
    for key in load_schema().keys.values():
        assert key.description, key.name
        if key.default is not None:
            assert validate_value(key, key.default) is None, key.name


def test_every_flag_key_really_becomes_a_flag() -> None:
    built = {k for k, _ in vllm_args.VALUE_FLAGS} | {k for k, _ in vllm_args.JSON_FLAGS}
    built |= set(vllm_args.ARGS_KEYS) | {"VLLM_MODEL", "VLLM_CHAT_TEMPLATE", "VLLM_SPEC_DECODE",
                                         "VLLM_ENABLE_PREFIX_CACHING", "VLLM_ENFORCE_EAGER"}
    flags = {k.name for k in load_schema().keys.values() if k.becomes == "vllm-flag"}
    assert flags == built


@pytest.mark.parametrize("key", ["VLLM_MODEL", "VLLM_TOKENIZER", "VLLM_SERVED_NAME",
                                 "VLLM_MAX_MODEL_LEN", "VLLM_MAX_BATCHED_TOKENS", "VLLM_GPU_MEM_UTIL",
                                 "VLLM_MAX_NUM_SEQS", "VLLM_KV_CACHE_DTYPE", "VLLM_TP",
                                 "VLLM_SPEC_DECODE", "VLLM_TOOL_CHOICE", "VLLM_IMAGE"])
def test_the_earlier_stacks_key_names_are_kept(key: str) -> None:
    assert key in load_schema()
