"""Check a `vllm serve` argv with the installed vLLM's own parser; print findings as JSON.

Runs where vLLM is installed: the parser venv that `invoke check --deep` creates, or the
engine image (`docker run --entrypoint python3 IMAGE -c "$(cat this file)" ARGS_JSON`).
It may import only the standard library and vLLM (and what vLLM itself imports).

Input:  one argument, JSON: a list of argvs, each the list of words after `vllm serve`
        (the model first). A plain list of words is taken as one argv. Importing vLLM
        takes most of the time (about 15 s on 2 cores), so callers check many at once.
Output: one stdout line `VLLMSTACK-PARSE-RESULT {json}` with `vllm_version`, `python`,
        `parser_module` and `reports` (one per argv: `accepted`, `findings`). vLLM's own
        logging may print other lines, so the caller looks for the marker. Exit code 0
        whenever the report was written, also when it contains errors.

What it reports (each finding: severity, code, message, flag, fix):
  * the verdict of vLLM's real parser, exactly as `vllm serve` would give it;
  * every unknown flag (with the closest real one), every bad value or choice, every
    abbreviated flag (argparse accepts unambiguous prefixes) and every flag given twice
    (vLLM keeps the last) — argparse itself stops at the first error;
  * checks vLLM makes later at start-up that need no model: serve-argument rules,
    tool-call / reasoning parser names, the engine-argument dataclass, the KV-cache
    settings and the speculative-decoding config.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import io
import json
import os
import re
import sys
from typing import Any

MARKER = "VLLMSTACK-PARSE-RESULT "
# Where make_arg_parser lives, newest first (it has moved between releases).
PARSER_MODULES = (
    "vllm.entrypoints.launchers.cli_args",
    "vllm.entrypoints.common.cli_args",
    "vllm.entrypoints.openai.cli_args",
)
NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
# Actions for which giving the flag again adds to the value instead of replacing it.
ACCUMULATING = tuple(getattr(argparse, name) for name in (
    "_AppendAction", "_AppendConstAction", "_ExtendAction", "_CountAction")
    if hasattr(argparse, name))


def finding(severity: str, code: str, message: str, flag: str | None = None,
            fix: str | None = None) -> dict[str, Any]:
    return {"severity": severity, "code": code, "message": message, "flag": flag, "fix": fix}


def import_parser_module() -> tuple[Any, str]:
    """The module defining make_arg_parser; a missing dependency is raised, not skipped."""
    for name in PARSER_MODULES:
        try:
            return importlib.import_module(name), name
        except ModuleNotFoundError as exc:
            # Only "this release has no such module" moves on to the next candidate.
            if exc.name and name.startswith(exc.name):
                continue
            raise
    raise ModuleNotFoundError(f"none of {', '.join(PARSER_MODULES)} exists in this vLLM")


def build_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, str]:
    """The top-level `vllm` parser with a `serve` subparser, built the way vllm's CLI does.

    Only `serve` is registered: importing the other subcommands pulls in the HTTP
    server stack, and the top-level parser's pre-processing (underscores, dotted JSON
    keys, -O3) is the same whatever subcommands exist.
    """
    module, where = import_parser_module()
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(prog="vllm", description="vLLM CLI")
    subparsers = top.add_subparsers(required=False, dest="subparser")
    serve = subparsers.add_parser("serve", prog="vllm serve")
    serve = module.make_arg_parser(serve)
    return top, serve, where


def run_real_parser(top: argparse.ArgumentParser,
                    args: list[str]) -> tuple[argparse.Namespace | None, str]:
    """Parse exactly as `vllm serve ARGS` does. Returns (namespace or None, error text)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            namespace = top.parse_args(["serve", *args])
    except SystemExit as exc:
        lines = [line for line in err.getvalue().strip().splitlines() if "error:" in line]
        if exc.code == 0:
            return None, "the argv asks vLLM for help/version instead of serving"
        return None, lines[-1] if lines else err.getvalue().strip() or f"exit {exc.code}"
    except Exception as exc:  # FlexibleArgumentParser raises ValueError for some misuse
        return None, f"{type(exc).__name__}: {exc}"
    return namespace, ""


def looks_like_flag(word: str) -> bool:
    return word.startswith("-") and not NEGATIVE_NUMBER.match(word) and word != "-"


def normalise(word: str) -> str:
    """vLLM accepts underscores in flag names; it rewrites them before argparse sees them."""
    if not word.startswith("--"):
        return word
    name, dot, rest = word.partition(".")
    return name.replace("_", "-") + dot + rest


def closest_flags(name: str, options: list[str]) -> list[str]:
    longs = [o for o in options if o.startswith("--")]
    return difflib.get_close_matches(name, longs, n=3, cutoff=0.6)


def diagnose_words(serve: argparse.ArgumentParser,
                   args: list[str]) -> tuple[list[dict[str, Any]], set[int]]:
    """Walk the argv flag by flag the way argparse consumes it, collecting every problem.

    Also returns the indexes of the words that vLLM rejects, so that the rest of the
    argv can still be parsed and checked in depth.
    """
    out: list[dict[str, Any]] = []
    bad: set[int] = set()
    table: dict[str, argparse.Action] = serve._option_string_actions
    options = sorted(table)
    seen: dict[str, list[tuple[str, str]]] = {}
    dotted: dict[str, list[tuple[str, str]]] = {}
    i = 1 if args and not looks_like_flag(args[0]) else 0
    if i == 0:
        out.append(finding("error", "no-model", "the argv has no model before the first flag",
                           fix="put the model first: vllm serve MODEL --flag ..."))
    while i < len(args):
        start = i
        word = args[i]
        i += 1
        if not looks_like_flag(word):
            bad.add(start)
            out.append(finding("error", "stray-value",
                               f"{word!r} follows no flag that takes a value; vLLM rejects it "
                               "as an unrecognized argument", fix="quote values that contain "
                               "spaces, or remove the stray word"))
            continue
        if word == "--":
            break
        if word.startswith("-O") and word != "-O":
            word = "--optimization-level=" + (word[3:] if word[2:3] == "=" else word[2:])
        name, eq, inline = normalise(word).partition("=")
        base = name.partition(".")[0] if name.startswith("-") and "." in name else name
        action = table.get(base)
        spelled = base
        if action is None and base.startswith("--"):
            prefixed = {table[o] for o in options if o.startswith(base)}
            if len(prefixed) == 1:
                action = prefixed.pop()
                spelled = next(o for o in action.option_strings if o.startswith(base))
                out.append(finding("warning", "abbreviated-flag",
                                   f"{base} is accepted by vLLM only as an abbreviation of "
                                   f"{spelled}; a new flag starting the same way would break it",
                                   flag=base, fix=f"write {spelled} in full"))
            elif len(prefixed) > 1:
                names = ", ".join(sorted(a.option_strings[0] for a in prefixed))
                out.append(finding("error", "ambiguous-flag",
                                   f"ambiguous option: {base} could match {names}",
                                   flag=base, fix="write the full flag name"))
                i = skip_values(args, i)
                bad.update(range(start, i))
                continue
        if action is None:
            taken = args[i:skip_values(args, i)]
            shown = " ".join([word, *taken])
            guesses = closest_flags(base, options)
            out.append(finding("error", "unknown-flag",
                               f"vLLM has no flag {base} (unrecognized arguments: {shown})",
                               flag=base,
                               fix=(f"did you mean {' or '.join(guesses)}?" if guesses else
                                    "remove it; `vllm serve --help=all` lists every flag")))
            i += len(taken)
            bad.update(range(start, i))
            continue
        if "." in name:
            # --speculative-config.method mtp: one value, merged into the JSON by vLLM.
            values = [inline] if eq else args[i:i + 1]
            i += 0 if eq else 1
            dotted.setdefault(action.dest, []).append((name, " ".join(values)))
            continue
        values, i, problem = take_values(action, spelled, args, i, inline if eq else None)
        if problem:
            out.append(finding("error", "bad-value", problem, flag=spelled,
                               fix=value_fix(action)))
            bad.update(range(start, i))
            continue
        try:
            serve._get_values(action, values)
        except argparse.ArgumentError as exc:
            out.append(finding("error", "bad-value", str(exc), flag=spelled,
                               fix=value_fix(action)))
            bad.update(range(start, i))
            continue
        if not isinstance(action, ACCUMULATING):
            seen.setdefault(action.dest, []).append((spelled, " ".join(values)))
    for dest, keys in dotted.items():
        names = [name for name, _ in keys]
        for name in sorted({n for n in names if names.count(n) > 1}):
            values = [value for n, value in keys if n == name]
            out.append(finding("warning", "duplicate-flag",
                               f"{name} given {len(values)} times ({', '.join(values)}); "
                               f"vLLM keeps only the last: {values[-1]}", flag=name,
                               fix="set it in one place only"))
        if dest in seen:
            # vLLM gathers dotted keys into a new JSON value that it appends after every
            # other flag, so it replaces the whole value given with the plain flag.
            whole = seen[dest][-1][0]
            out.append(finding("warning", "json-replaced",
                               f"{', '.join(dict.fromkeys(names))} replace(s) the whole {whole} "
                               f"value: vLLM builds a new JSON from the dotted keys alone",
                               flag=whole, fix=f"put every key into the {whole} JSON"))
    for uses in seen.values():
        if len(uses) > 1:
            shown = ", ".join(f"{flag} {value}".strip() for flag, value in uses)
            last = f"{uses[-1][0]} {uses[-1][1]}".strip()
            out.append(finding("warning", "duplicate-flag",
                               f"given {len(uses)} times ({shown}); vLLM keeps only the last: "
                               f"{last}", flag=uses[0][0],
                               fix="set it in one place only"))
    return out, bad


def skip_values(args: list[str], i: int) -> int:
    while i < len(args) and not looks_like_flag(args[i]):
        i += 1
    return i


def take_values(action: argparse.Action, flag: str, args: list[str], i: int,
                inline: str | None) -> tuple[list[str], int, str | None]:
    """The words argparse gives this action, the next index, and argparse's complaint if any."""
    nargs = action.nargs
    if nargs == 0:
        if inline is not None:
            return [], i, f"argument {flag}: ignored explicit argument {inline!r}"
        return [], i, None
    if inline is not None:
        return [inline], i, None
    end = skip_values(args, i)
    if nargs is None:
        if end == i:
            return [], i, f"argument {flag}: expected one argument"
        return [args[i]], i + 1, None
    if nargs == "?":
        return args[i:i + 1] if end > i else [], min(end, i + 1), None
    if nargs in ("*", "+"):
        if nargs == "+" and end == i:
            return [], i, f"argument {flag}: expected at least one argument"
        return args[i:end], end, None
    if isinstance(nargs, int):
        if end - i < nargs:
            return [], end, f"argument {flag}: expected {nargs} arguments"
        return args[i:i + nargs], i + nargs, None
    return args[i:end], end, None


def value_fix(action: argparse.Action) -> str:
    if action.choices:
        return "use one of: " + ", ".join(str(c) for c in action.choices)
    return f"see `vllm serve --help={action.option_strings[0].lstrip('-')}`"


def pydantic_messages(exc: Exception) -> list[str]:
    """One line per pydantic error ("loc: message"); other exceptions as they are."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            items = errors()
        except Exception:
            items = None
        if items:
            lines = []
            for item in items:
                loc = ".".join(str(part) for part in item.get("loc", ()) if part != "__root__")
                msg = str(item.get("msg", "")).removeprefix("Value error, ")
                lines.append(f"{loc}: {msg}" if loc else msg)
            return lines
    return [f"{type(exc).__name__}: {exc}" if not str(exc) else str(exc)]


def check_parsers(ns: argparse.Namespace) -> list[dict[str, Any]]:
    """Tool-call and reasoning parser names against vLLM's registries (as setup_server does)."""
    out: list[dict[str, Any]] = []
    tool = getattr(ns, "tool_call_parser", None)
    if tool:
        from vllm.tool_parsers import ToolParserManager

        names = ToolParserManager.list_registered()
        if tool not in names:
            auto = bool(getattr(ns, "enable_auto_tool_choice", False))
            out.append(finding(
                "error" if auto else "warning", "unknown-tool-parser",
                f"invalid tool call parser: {tool} (chose from {{ {','.join(names)} }})"
                + ("" if auto else "; unused because --enable-auto-tool-choice is off"),
                flag="--tool-call-parser", fix=near("--tool-call-parser", tool, names)))
    reasoning = getattr(ns, "reasoning_parser", None)
    if reasoning:
        from vllm.reasoning import ReasoningParserManager

        names = ReasoningParserManager.list_registered()
        if reasoning not in names:
            out.append(finding(
                "error", "unknown-reasoning-parser",
                f"invalid reasoning parser: {reasoning} (chose from {{ {','.join(names)} }})",
                flag="--reasoning-parser", fix=near("--reasoning-parser", reasoning, names)))
    return out


def near(flag: str, value: str, names: list[str]) -> str:
    guesses = difflib.get_close_matches(value, names, n=3, cutoff=0.5)
    return f"{flag} {guesses[0]}" if guesses else f"use one of the names listed for {flag}"


def check_serve_rules(module_name: str, ns: argparse.Namespace) -> list[dict[str, Any]]:
    """vLLM's own pre-start checks of serve arguments (`validate_parsed_serve_args`)."""
    module = importlib.import_module(module_name)
    validate = getattr(module, "validate_parsed_serve_args", None)
    if validate is None:
        return []
    # The chat template is a path inside the engine container (a bind mount), so it
    # cannot be checked from here; the stack checks the host file instead.
    checked = argparse.Namespace(**{**vars(ns), "chat_template": None})
    try:
        validate(checked)
    except Exception as exc:
        return [finding("error", "serve-rule", line) for line in pydantic_messages(exc)]
    return []


def check_engine_args(ns: argparse.Namespace) -> tuple[Any, list[dict[str, Any]]]:
    """Build AsyncEngineArgs from the namespace, as `vllm serve` does before loading a model."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    # The check runs with the hub switched off. In offline mode EngineArgs swaps the
    # model id for a local snapshot path, which needs the weights on this disk; that
    # is about where weights are, not about the argv, so that swap is skipped here.
    constants: Any = None
    offline = None
    with contextlib.suppress(ImportError):
        import huggingface_hub.constants as constants

        offline = constants.HF_HUB_OFFLINE
        constants.HF_HUB_OFFLINE = False
    try:
        return AsyncEngineArgs.from_cli_args(ns), []
    except Exception as exc:
        return None, [finding("error", "engine-args", line) for line in pydantic_messages(exc)]
    finally:
        if constants is not None and offline is not None:
            constants.HF_HUB_OFFLINE = offline


def engine_defaults(engine_args: Any) -> dict[str, Any]:
    """EngineArgs' declared defaults, read from the dataclass (building one needs a model)."""
    import dataclasses

    out: dict[str, Any] = {}
    for field in dataclasses.fields(engine_args):
        if field.default is not dataclasses.MISSING:
            out[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            with contextlib.suppress(Exception):
                out[field.name] = field.default_factory()
    return out


def user_set(engine_args: Any, defaults: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The engine-argument values that differ from vLLM's defaults (what the argv asked for)."""
    out: dict[str, Any] = {}
    missing = object()
    for name in names:
        if hasattr(engine_args, name):
            value = getattr(engine_args, name)
            if value != defaults.get(name, missing):
                out[name] = value
    return out


def check_cache_config(engine_args: Any) -> list[dict[str, Any]]:
    """The KV-cache settings through CacheConfig's validators (dtype names, memory ranges)."""
    import dataclasses

    from vllm.config import CacheConfig

    defaults = engine_defaults(engine_args)
    names = [f.name for f in dataclasses.fields(CacheConfig)]
    kwargs = user_set(engine_args, defaults, names)
    dtype = getattr(engine_args, "kv_cache_dtype", None)
    if dtype is not None and dtype != defaults.get("kv_cache_dtype"):
        kwargs["cache_dtype"] = dtype
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    try:
        CacheConfig(**kwargs)
    except Exception as exc:
        flags = {"cache_dtype": "--kv-cache-dtype"}
        return [finding("error", "cache-config", line,
                        flag=flags.get(line.split(":")[0], "--" + line.split(":")[0]
                                       .replace("_", "-")))
                for line in pydantic_messages(exc)]
    return []


def check_speculative_config(engine_args: Any) -> list[dict[str, Any]]:
    """--speculative-config through SpeculativeConfig's field and model validators.

    Its __post_init__ needs the target model's config (it reads the checkpoint), so it
    is skipped for this check; key names, types, ranges, method and backend names, and
    the cross-field rules of the model validator still run.
    """
    spec = getattr(engine_args, "speculative_config", None)
    if not spec:
        return []
    from vllm.config import SpeculativeConfig

    spec = {str(k).replace("-", "_"): v for k, v in dict(spec).items()}
    post_init = SpeculativeConfig.__dict__.get("__post_init__")
    try:
        if post_init is not None:
            SpeculativeConfig.__post_init__ = lambda self: None  # type: ignore[method-assign]
        SpeculativeConfig(**spec)
    except Exception as exc:
        return [finding("error", "speculative-config", line, flag="--speculative-config",
                        fix="see SpeculativeConfig in vLLM's docs for the keys and values")
                for line in pydantic_messages(exc)]
    finally:
        if post_init is not None:
            SpeculativeConfig.__post_init__ = post_init  # type: ignore[method-assign]
    return []


def check_attention_backend(engine_args: Any) -> list[dict[str, Any]]:
    """The backend name against vLLM's enum (argparse may pass the raw string through)."""
    backend = getattr(engine_args, "attention_backend", None)
    if backend is None or not isinstance(backend, str):
        return []
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:
        return []
    try:
        AttentionBackendEnum[backend.upper()]
    except (KeyError, ValueError) as exc:
        return [finding("error", "attention-backend", str(exc).strip("'\""),
                        flag="--attention-backend")]
    return []


def deep_checks(module_name: str, ns: argparse.Namespace) -> list[dict[str, Any]]:
    out = check_serve_rules(module_name, ns)
    out += check_parsers(ns)
    engine_args, problems = check_engine_args(ns)
    out += problems
    if engine_args is not None:
        for check in (check_cache_config, check_speculative_config, check_attention_backend):
            try:
                out += check(engine_args)
            except Exception as exc:  # a check this vLLM cannot run is a note, not a verdict
                out.append(finding("info", "check-skipped",
                                   f"{check.__name__} could not run here: "
                                   f"{type(exc).__name__}: {exc}"))
    return out


def check_argv(args: list[str]) -> dict[str, Any]:
    """Everything this script knows about one argv: {"accepted": bool, "findings": [...]}."""
    top, serve, where = build_parsers()
    namespace, error = run_real_parser(top, args)
    findings, bad = diagnose_words(serve, args)
    accepted = namespace is not None
    if namespace is None:
        # Keep vLLM's own words: they are what the user would see when the engine starts.
        if any(f["severity"] == "error" for f in findings):
            findings.append(finding("info", "verdict", error))
        else:
            findings.append(finding("error", "rejected", error))
        # Parse what is left without the rejected words, so one run reports the
        # later-stage problems too instead of one error per attempt.
        rest = [word for index, word in enumerate(args) if index not in bad]
        if bad and rest:
            namespace, _ = run_real_parser(*build_parsers()[:1], rest)
    if namespace is not None:
        findings += deep_checks(where, namespace)
    return {"accepted": accepted, "findings": findings}


def report(argvs: list[list[str]]) -> dict[str, Any]:
    import vllm

    result: dict[str, Any] = {"vllm_version": getattr(vllm, "__version__", "unknown"),
                              "python": sys.version.split()[0], "reports": []}
    try:
        result["parser_module"] = build_parsers()[2]
    except Exception as exc:
        problem = finding(
            "error", "parser-unavailable",
            f"cannot build vLLM's serve parser: {type(exc).__name__}: {exc}",
            fix="recreate the parser environment (delete it; `invoke check --deep` rebuilds it)")
        result["reports"] = [{"accepted": False, "findings": [problem]} for _ in argvs]
        return result
    for args in argvs:
        # A fresh parser per argv: vLLM's parser keeps a little state between calls.
        result["reports"].append(check_argv(args))
    return result


def main(argv: list[str]) -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if len(argv) != 1:
        print("usage: vllm-parse-argv.py '<JSON list of the words after vllm serve>'",
              file=sys.stderr)
        return 2
    try:
        args = json.loads(argv[0])
    except json.JSONDecodeError as exc:
        print(f"argument is not JSON: {exc}", file=sys.stderr)
        return 2
    if isinstance(args, list) and all(isinstance(a, str) for a in args):
        args = [args]
    if not (isinstance(args, list)
            and all(isinstance(a, list) and all(isinstance(w, str) for w in a) for a in args)):
        print("argument must be a JSON list of argvs (lists of strings)", file=sys.stderr)
        return 2
    print(MARKER + json.dumps(report(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
