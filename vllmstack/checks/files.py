"""Checks of paths a profile names: model folder, tokenizer, chat template, HF config override.

A new check goes here when a setting points at a file or folder: that it exists, has the
expected content, and reaches the engine (containers see local paths only under MODELS_DIR).
"""

from __future__ import annotations

from pathlib import Path

from vllmstack.checks.context import CheckContext
from vllmstack.config.modelinfo import is_local_path
from vllmstack.core.findings import Finding


def rule_files_exist(ctx: CheckContext) -> list[Finding]:
    out: list[Finding] = []
    model = ctx.get("VLLM_MODEL")
    if model and is_local_path(model):
        path = Path(model).expanduser()
        if not path.is_dir():
            out.append(ctx.finding("error", "missing-model-dir", "VLLM_MODEL",
                                   f"model folder {path} does not exist",
                                   fix="download or copy the model there, or use a Hugging Face id"))
        elif not (path / "config.json").exists():  # a FIFO there: bad-model-config below
            out.append(ctx.finding("error", "missing-model-config", "VLLM_MODEL",
                                   f"{path} has no config.json: not a model folder",
                                   fix="point VLLM_MODEL at the folder that holds config.json"))
        out += _check_mounted(ctx, "VLLM_MODEL", path)
    tokenizer = ctx.get("VLLM_TOKENIZER")
    if tokenizer and is_local_path(tokenizer):
        path = Path(tokenizer).expanduser()
        if not path.exists():
            out.append(ctx.finding("error", "missing-tokenizer", "VLLM_TOKENIZER",
                                   f"tokenizer path {path} does not exist",
                                   fix="point it at the model folder or use a Hugging Face id"))
        else:
            out += _check_mounted(ctx, "VLLM_TOKENIZER", path)
    template = ctx.get("VLLM_CHAT_TEMPLATE")
    if template:
        path = ctx.project.root / "chat-templates" / template
        # Only when nothing is there: a FIFO, a device or a folder by that name is the template
        # rule's (chat-template-limit: "is a FIFO, not a regular file"), not "does not exist".
        if not path.exists():
            have = sorted(p.name for p in (ctx.project.root / "chat-templates").glob("*.jinja"))
            out.append(ctx.finding("error", "missing-chat-template", "VLLM_CHAT_TEMPLATE",
                                   f"chat template chat-templates/{template} does not exist",
                                   fix="use one of: " + (", ".join(have) or "(none shipped)")
                                   + ", or leave it empty for the model's own template"))
    hf_config = ctx.get("VLLM_HF_CONFIG_PATH")
    if hf_config:
        path = Path(hf_config).expanduser()
        if not (path / "config.json").exists():
            out.append(ctx.finding("error", "missing-hf-config", "VLLM_HF_CONFIG_PATH",
                                   f"{path}/config.json does not exist",
                                   fix="point it at a folder holding the replacement config.json"))
        else:
            out += _check_mounted(ctx, "VLLM_HF_CONFIG_PATH", path)
    problem = ctx.facts.config_problem
    if problem is not None:  # config.json gave no facts: the other rules use the profile's
        key = "VLLM_HF_CONFIG_PATH" if hf_config else "VLLM_MODEL"
        out.append(ctx.finding("error", "bad-model-config", key, problem.cause, fix=problem.fix))
    return out


def _check_mounted(ctx: CheckContext, key: str, path: Path) -> list[Finding]:
    """Local paths reach the container only through MODELS_DIR (mounted read-only); a native
    engine reads them where they are, so there it is only a note for a later container run."""
    models_dir = ctx.get("MODELS_DIR")
    if models_dir and _is_within(path, Path(models_dir).expanduser()):
        return []
    where = f" ({models_dir})" if models_dir else " (MODELS_DIR is not set)"
    fix = f"set MODELS_DIR in .env to a folder that contains {path}"
    if ctx.runtime == "native":
        return [ctx.finding(
            "info", "path-not-mounted", key,
            f"{path} is outside MODELS_DIR{where}: fine for the native runtime, which reads it "
            "directly; a container run would not see it", fix=fix)]
    return [ctx.finding(
        "error", "path-not-mounted", key,
        f"{path} is a local path, but only MODELS_DIR is mounted into the engine container{where}",
        fix=fix)]


def _is_within(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return True
