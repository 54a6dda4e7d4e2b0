"""`invoke check --deep`: the serve argv through the pinned vLLM's own argument parser.

The stack's checks know vLLM's flags from a facts sheet; this module asks vLLM itself.
`scripts/vllm-parse-argv.py` builds vLLM's real `vllm serve` parser, parses the argv
and runs the start-up validations that need no model (engine arguments, KV-cache
config, speculative config, attention backend, tool-call/reasoning parser names).

Where it runs:
  * inside the engine image when that image exists locally (`docker run --rm
    --network none --entrypoint python3 IMAGE -c SCRIPT ARGS`): the exact vLLM that
    will serve, patches included;
  * otherwise in a CPU-only virtual environment under `.cache/vllm-parser/VERSION`,
    created on first use from the pinned wheel on PyPI (`VLLM_TARGET_DEVICE=cpu`).

Offline by design: nothing here downloads at run time except that one-off environment,
and only when the user runs `invoke check --deep` (or the CI test). Parsing itself runs
with the Hugging Face hub switched off and, in Docker, without a network.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllmstack.checks.parser_pins import PINNED_REQUIREMENTS
from vllmstack.config.profiles import Resolved
from vllmstack.config.vllm_args import flag_origins, flag_table
from vllmstack.core.findings import Finding
from vllmstack.core.paths import Project
from vllmstack.core.runner import Result, Runner, format_command
from vllmstack.core.store import STORE_VAR, Key, Store, StoreError, link_entry, open_store

SCRIPT = Path("scripts") / "vllm-parse-argv.py"
MARKER = "VLLMSTACK-PARSE-RESULT "
ENV_MARKER = ".vllmstack-parser.json"
CREATE_TIMEOUT = 1800.0
PARSE_TIMEOUT = 900.0

# For a release without a pinned list: the distributions (of vLLM's own requirements)
# that the parser imports. They are installed with vLLM's version bounds and pip
# resolves the rest; slower and bigger (triton comes along), but it works.
PARSER_IMPORTS = (
    "torch", "regex", "cachetools", "psutil", "numpy", "requests", "tqdm", "transformers",
    "huggingface-hub", "tokenizers", "safetensors", "fastapi", "starlette", "aiohttp",
    "openai", "pydantic", "prometheus-client", "pillow", "llguidance", "xgrammar",
    "typing-extensions", "filelock", "partial-json-parser", "pyzmq", "msgspec", "pyyaml",
    "cloudpickle", "pybase64", "cbor2", "oss-harmony", "opentelemetry-api",
    "apache-tvm-ffi", "py-cpuinfo",
)
# uvloop is not among vLLM's own requirements (it arrives through fastapi[standard]).
PARSER_EXTRAS = ("uvloop",)
# The run never reaches a network service: no hub look-ups, no usage reports.
PARSE_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "PYTHONNOUSERSITE": "1",
}
PIP_ENV = {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


class ParserEnvError(RuntimeError):
    """The parser environment could not be created; the message says why and what to do."""


@dataclass(frozen=True)
class ParserEnv:
    path: Path

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def marker(self) -> Path:
        return self.path / ENV_MARKER


def script_path(project: Project) -> Path:
    """The parse script: the project's copy, else the one shipped beside this package."""
    mine = project.root / SCRIPT
    return mine if mine.is_file() else Path(__file__).resolve().parents[2] / SCRIPT


def parser_env_dir(project: Project, version: str) -> Path:
    return project.cache / "vllm-parser" / version


def requirements_for(version: str) -> tuple[str, ...] | None:
    """The pinned install list for this vLLM release, or None when none is pinned.

    The lists are in parser-requirements.txt (bump it together with VLLM_VERSION)."""
    return PINNED_REQUIREMENTS.get(version)


def _marker_content(version: str, python: str) -> dict[str, Any]:
    pinned = requirements_for(version)
    return {
        "vllm": version,
        "python": python,
        "requirements": list(pinned) if pinned is not None else "resolved by pip",
    }


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def env_is_ready(project: Project, version: str) -> bool:
    """True when the environment exists and was made for this version and pin list."""
    env = ParserEnv(parser_env_dir(project, version))
    marker = _read_marker(env.marker)
    # exists() follows the venv's interpreter symlink: a removed base Python means rebuild.
    if marker is None or not env.python.exists():
        return False
    wanted = _marker_content(version, "")
    return all(marker.get(k) == wanted[k] for k in ("vllm", "requirements"))


def ensure_parser_env(
    project: Project,
    runner: Runner,
    version: str,
    *,
    python: str | None = None,
    environ: Mapping[str, str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """The parser venv for `version`, created on demand; reused while its marker matches.

    It is built in a side folder and moved into place only when complete, so an
    interrupted install is never mistaken for a ready one. Raises ParserEnvError.
    """
    python = python or sys.executable
    final = parser_env_dir(project, version)
    if env_is_ready(project, version):
        return final
    say = progress or _say
    base_env = dict(environ if environ is not None else os.environ)
    pip_env = {**base_env, **PIP_ENV}
    partial = final.with_name(f"{final.name}.partial-{os.getpid()}")
    env = ParserEnv(partial)
    if runner.dry_run:
        _create(runner, ParserEnv(final), version, python, base_env, pip_env)
        return final
    store = open_store(base_env)
    if store is not None:
        return _ensure_stored(store, final, runner, version, python, base_env, pip_env, say)
    say(f"creating the vLLM {version} parser environment in {final} "
        "(one-off: downloads the wheel from PyPI, a few minutes)")
    try:
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
        _create(runner, env, version, python, base_env, pip_env)
        installed = _installed_version(runner, env, base_env)
        if installed != version:
            raise ParserEnvError(
                f"cannot create the vLLM parser environment: it holds vLLM "
                f"{installed or '(none)'} instead of {version}")
        env.marker.write_text(
            json.dumps(_marker_content(version, python), indent=2) + "\n", encoding="utf-8")
        if env_is_ready(project, version):
            # Another process finished first (two checks at once); keep its copy, which
            # may be in use, and drop ours.
            shutil.rmtree(partial)
            return final
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise ParserEnvError(
            f"cannot create the vLLM parser environment in {final}: {exc}\n"
            f"  fix: make {project.cache} writable, or delete it") from exc
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return final


def parser_key(version: str, python: str) -> Key:
    """What the parser environment depends on: the vLLM release, the pinned list, the interpreter
    (its real path: the environment's python links to it)."""
    pinned = requirements_for(version)
    return Key("vllm-parser", f"vllm-parser-{version}", {
        "vllm": version, "requirements": list(pinned) if pinned is not None else "resolved by pip",
        "python": os.path.realpath(shutil.which(python) or python),
        "extras": list(PARSER_EXTRAS)})


def _ensure_stored(store: Store, final: Path, runner: Runner, version: str, python: str,
                   base_env: Mapping[str, str], pip_env: Mapping[str, str],
                   say: Callable[[str], None]) -> Path:
    """The parser environment from the build store, made there once per machine; `final` (the
    checkout's .cache/vllm-parser/VERSION) links to it. The environment is used only through its
    interpreter, so it may be built under a temporary name and renamed into place."""
    def build(target: Path) -> None:
        say(f"creating the vLLM {version} parser environment in the build store ({target.parent}; "
            "one-off per machine: downloads the wheel from PyPI, a few minutes)")
        target.mkdir(parents=True)
        made = ParserEnv(target)
        _create(runner, made, version, python, base_env, pip_env)
        installed = _installed_version(runner, made, base_env)
        if installed != version:
            raise ParserEnvError(f"cannot create the vLLM parser environment: it holds vLLM "
                                 f"{installed or '(none)'} instead of {version}")
        made.marker.write_text(json.dumps(_marker_content(version, python), indent=2) + "\n",
                               encoding="utf-8")

    try:
        entry = store.ensure(parser_key(version, python), build, files=[ENV_MARKER], say=say)
        link_entry(final, entry.path)
    except StoreError as exc:
        raise ParserEnvError(f"{exc.cause}\n  fix: {exc.fix}") from exc
    except OSError as exc:
        raise ParserEnvError(f"cannot create the vLLM parser environment in {store.root}: {exc}\n"
                             f"  fix: make it writable, or set {STORE_VAR}=off") from exc
    return final


def _say(message: str) -> None:
    print(f"vllmstack: {message}", file=sys.stderr, flush=True)


def _create(runner: Runner, env: ParserEnv, version: str, python: str,
            base_env: Mapping[str, str], pip_env: Mapping[str, str]) -> None:
    _run_step(runner, [python, "-m", "venv", str(env.path)], "creating the venv", base_env)
    pip = [str(env.python), "-m", "pip", "install", "--no-deps"]
    pinned = requirements_for(version)
    if pinned is not None:
        _run_step(runner, [*pip, f"vllm=={version}", *pinned],
                  f"installing vLLM {version} and its parser dependencies", pip_env)
        return
    _run_step(runner, [*pip, f"vllm=={version}"], f"installing vLLM {version}", pip_env)
    if runner.dry_run:
        return  # the next step reads the installed wheel's metadata
    needed = _requirements_from_metadata(runner, env, base_env)
    _run_step(runner, [*pip[:-1], *needed, *PARSER_EXTRAS],
              f"installing the parser dependencies of vLLM {version}", pip_env)


def _run_step(runner: Runner, argv: list[str], what: str, env: Mapping[str, str]) -> Result:
    result = runner.run(argv, env=env, timeout=CREATE_TIMEOUT)
    if not result.ok:
        tail = (result.stderr or result.stdout).strip().splitlines()[-8:]
        raise ParserEnvError(
            f"cannot create the vLLM parser environment: {what} failed "
            f"(exit {result.returncode}): {format_command(argv)[:300]}"
            + ("\n  " + "\n  ".join(tail) if tail else "")
            + "\n  fix: it needs PyPI once (pip must reach it); or build the engine image "
              "(`invoke build`) so the check runs inside it instead"
        )
    return result


def _installed_version(runner: Runner, env: ParserEnv, environ: Mapping[str, str]) -> str:
    # importlib.metadata reads the wheel's record without importing vLLM (which takes ~15 s).
    code = "import importlib.metadata as m; print(m.version('vllm'))"
    result = runner.run([str(env.python), "-c", code], env=environ, mutates=False, timeout=120)
    return result.stdout.strip() if result.ok else ""


def _requirements_from_metadata(
    runner: Runner, env: ParserEnv, environ: Mapping[str, str]
) -> list[str]:
    """vLLM's own requirement lines for the packages the parser imports (with markers)."""
    code = "import importlib.metadata as m; print('\\n'.join(m.requires('vllm') or []))"
    result = runner.run([str(env.python), "-c", code], env=environ, mutates=False, timeout=120)
    if not result.ok:
        raise ParserEnvError(f"cannot read vLLM's requirements: {result.stderr.strip()[-300:]}")
    return select_requirements(result.stdout.splitlines())


def select_requirements(lines: Sequence[str]) -> list[str]:
    """Keep the requirement lines of PARSER_IMPORTS, drop extras-only lines."""
    wanted = {_normal_name(n) for n in PARSER_IMPORTS}
    out: list[str] = []
    for line in lines:
        line = line.strip()
        if not line or "extra ==" in line:
            continue
        name = line
        for stop in "[<>=!~; (":
            name = name.split(stop, 1)[0]
        if _normal_name(name) in wanted:
            out.append(line)
    return out


def _normal_name(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")


# --- running the parser ------------------------------------------------------------

def parse_argv(
    project: Project,
    runner: Runner,
    argv: list[str],
    version: str,
    *,
    image: str | None = None,
    docker: str = "docker",
    resolved: Resolved | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[Finding]:
    """Findings of vLLM's own parser about one `vllm serve ...` argv.

    With `image` (and that image present locally) the check runs inside it; else in
    the parser venv for `version`, created when missing. `resolved` lets findings name
    the setting and file behind a flag.
    """
    return parse_argvs(project, runner, [argv], version, image=image, docker=docker,
                       resolved=[resolved], environ=environ)[0]


def parse_argvs(
    project: Project,
    runner: Runner,
    argvs: Sequence[Sequence[str]],
    version: str,
    *,
    image: str | None = None,
    docker: str = "docker",
    resolved: Sequence[Resolved | None] | None = None,
    environ: Mapping[str, str] | None = None,
    python: Path | None = None,
) -> list[list[Finding]]:
    """Like parse_argv for many argvs in one run (importing vLLM dominates the time); `python`:
    an interpreter that already has this vLLM (a native engine's environment) instead of the
    parser venv, so nothing is installed."""
    origins = list(resolved) if resolved is not None else [None] * len(argvs)
    out: list[list[Finding]] = [[] for _ in argvs]
    words: list[list[str]] = []
    for i, argv in enumerate(argvs):
        if list(argv[:2]) != ["vllm", "serve"]:
            out[i].append(Finding("error", "vllm-not-serve",
                                  f"not a `vllm serve` argv: {format_command(list(argv))[:120]}",
                                  fix="pass the argv from build_serve_argv"))
        words.append([str(w) for w in argv[2:]])
    base_env = dict(environ if environ is not None else os.environ)
    notes: list[Finding] = []
    command: list[str]
    script = script_path(project)
    payload = json.dumps(words)
    run_env = {**base_env, **PARSE_ENV}
    if python is not None:
        command = [str(python), str(script), payload]
        where = f"vLLM {version} at {python}"
        run_env["PYTHONPATH"] = ""
    elif image and _image_exists(runner, docker, image):
        command = [docker, "run", "--rm", "--network", "none", "--entrypoint", "python3"]
        for name, value in PARSE_ENV.items():
            command += ["-e", f"{name}={value}"]
        command += [image, "-c", script.read_text(encoding="utf-8"), payload]
        where = f"image {image}"
    else:
        if image:
            notes.append(Finding("info", "vllm-parser-no-image",
                                 f"image {image} is not built here, so the pinned vLLM {version} "
                                 "wheel's parser (CPU venv) checked the argv instead",
                                 fix="build the image to check against the exact engine"))
        if runner.dry_run and not env_is_ready(project, version):
            ensure_parser_env(project, runner, version, environ=base_env)
            dry = Finding("info", "vllm-parser-dry-run",
                          "dry run: the parser environment would be created and the argv "
                          "parsed; nothing was checked")
            return [[*notes, dry] for _ in argvs]
        try:
            env_path = ensure_parser_env(project, runner, version, environ=base_env)
        except ParserEnvError as exc:
            return [[*notes, _env_error(exc)] for _ in argvs]
        command = [str(ParserEnv(env_path).python), str(script), payload]
        where = f"vLLM {version} parser env {env_path}"
        # Only the venv's own vLLM may answer, not a source tree on the caller's path.
        run_env["PYTHONPATH"] = ""
    result = runner.run(command, env=run_env, mutates=False, timeout=PARSE_TIMEOUT)
    reports = read_reports(result, len(words), where)
    for i, report in enumerate(reports):
        if isinstance(report, Finding):
            out[i] += [*notes, report]
            continue
        out[i] += notes + _version_note(report, version, where)
        out[i] += [to_finding(raw, origins[i]) for raw in report.get("findings", [])]
    return out


def check_with_vllm_parser(
    project: Project,
    runner: Runner,
    argv: list[str],
    resolved: Resolved,
    *,
    environ: Mapping[str, str] | None = None,
) -> list[Finding]:
    """`invoke check --deep`: the pinned version and image come from the resolved settings."""
    version = resolved.get_str("VLLM_VERSION").strip()
    if not version:
        return [Finding("error", "vllm-parser-no-version",
                        "VLLM_VERSION is not set, so there is no vLLM release to check against",
                        key="VLLM_VERSION", fix="set VLLM_VERSION in .env (see .env.example)")]
    return parse_argv(project, runner, argv, version,
                      image=(resolved.get("VLLM_IMAGE") or "").strip() or None,
                      docker=(resolved.get("DOCKER") or "").strip() or "docker",
                      resolved=resolved, environ=environ)


def _image_exists(runner: Runner, docker: str, image: str) -> bool:
    result = runner.run([docker, "image", "inspect", "--format", "{{.Id}}", image],
                        mutates=False, timeout=60)
    return result.ok


def _env_error(exc: ParserEnvError) -> Finding:
    return Finding("error", "vllm-parser-env", str(exc).split("\n  fix: ")[0],
                   fix=str(exc).split("\n  fix: ")[1] if "\n  fix: " in str(exc) else None)


def read_reports(result: Result, count: int, where: str) -> list[dict[str, Any] | Finding]:
    """The script's per-argv reports, or one error finding per argv when it did not answer."""
    line = next((ln for ln in reversed(result.stdout.splitlines()) if ln.startswith(MARKER)),
                None)
    data: Any = None
    if line is not None:
        try:
            data = json.loads(line[len(MARKER):])
        except ValueError:
            data = None
    reports = data.get("reports") if isinstance(data, dict) else None
    if not isinstance(reports, list) or len(reports) != count:
        tail = (result.stderr or result.stdout).strip().splitlines()[-6:]
        problem = Finding(
            "error", "vllm-parser-failed",
            f"vLLM's parser ({where}) gave no report (exit {result.returncode})"
            + (": " + " | ".join(tail) if tail else ""),
            fix="run it by hand: invoke check --deep, or delete .cache/vllm-parser to rebuild")
        return [problem] * count
    top = {k: v for k, v in data.items() if k != "reports"}
    return [{**top, **r} if isinstance(r, dict) else {} for r in reports]


def _version_note(report: dict[str, Any], version: str, where: str) -> list[Finding]:
    found = str(report.get("vllm_version") or "")
    if found.split("+")[0] == version:
        return []
    return [Finding("warning", "vllm-parser-version",
                    f"{where} has vLLM {found or '(unknown)'}, but VLLM_VERSION pins {version}; "
                    "its parser may accept or refuse other flags than the pinned release",
                    key="VLLM_VERSION",
                    fix="rebuild the image from the pinned VLLM_REF, or fix VLLM_VERSION")]


def to_finding(raw: Mapping[str, Any], resolved: Resolved | None) -> Finding:
    """One script finding as a stack Finding, naming the setting (and file) behind the flag."""
    severity = str(raw.get("severity") or "error")
    if severity not in ("error", "warning", "info"):
        severity = "error"
    flag = raw.get("flag")
    key = flag_origin(str(flag), resolved) if flag else None
    message = str(raw.get("message") or "")
    return Finding(
        severity,
        "vllm-" + str(raw.get("code") or "parser"),
        message,
        key=key,
        source=resolved.source(key) if resolved is not None and key else None,
        fix=str(raw["fix"]) if raw.get("fix") else None,
    )


def flag_origin(flag: str, resolved: Resolved | None) -> str | None:
    """The setting that put `flag` into the argv: a free-form args key first, else the
    setting the argv builder turns into that flag."""
    if resolved is not None:
        for key in flag_table().args:
            for word in resolved.get_str(key).split():
                name = word.split("=", 1)[0].replace("_", "-")
                # An abbreviation in the free-form args also counts (vLLM accepts those).
                if name == flag or (name.startswith("--") and len(name) > 3
                                    and flag.startswith(name)):
                    return key
    # The builder's own table (read from the schema on first use, never at import).
    return flag_origins().get(flag)
