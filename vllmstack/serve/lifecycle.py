"""Serving lifecycle: up (guards, render, start, watch, diagnose, warm up), down, status, logs, exec.

The runtime-specific part (how the engine is started, inspected, logged and stopped) sits
behind `EngineRuntime`; guards, the progress display, crash detection, the diagnosis table and
the warm-up are shared by every runtime.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import requests

from vllmstack.checks.registry import run_checks
from vllmstack.config.profiles import Resolved
from vllmstack.config.schema import as_bool, as_list
from vllmstack.config.vllm_args import ServeCommand
from vllmstack.core.findings import Finding
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.image import build
from vllmstack.runtime import compose
from vllmstack.runtime.base import EngineRuntime, EngineState
from vllmstack.runtime.gpu import GIB, GpuMemory, GpuProbe, total_used
from vllmstack.serve import diagnosis

POLL_S = 0.5
STATE_FILE = "state.json"
# After `down`, the GPUs count as released when used memory is back within this of the baseline.
RELEASE_SLACK = 1 * GIB


class LifecycleError(Exception):
    """A lifecycle step failed; `cause` and `fix` are the last lines the user sees."""

    def __init__(self, cause: str, fix: str | None = None, details: Sequence[str] = ()) -> None:
        super().__init__(cause)
        self.cause = cause
        self.fix = fix
        self.details = list(details)

    def render(self) -> str:
        lines = [*self.details, f"error: {self.cause}"]
        if self.fix:
            lines.append(f"fix:   {self.fix}")
        return "\n".join(lines)


# --- guards ------------------------------------------------------------------------------


@dataclass
class Guard:
    code: str
    message: str
    fix: str
    overridable: bool = True


def port_answers(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def identify_server(url: str, timeout: float = 1.5) -> str:
    """A short description of what answers at `url` (for the other-engine guard)."""
    for path in ("/v1/models", "/health", "/"):
        try:
            response = requests.get(url + path, timeout=timeout)
        except requests.RequestException:
            continue
        server = response.headers.get("server", "")
        if path == "/v1/models" and response.ok:
            try:
                ids = [m.get("id") for m in response.json().get("data", [])]
            except (ValueError, AttributeError):
                ids = []
            return f"an OpenAI-compatible server ({server or 'unknown'}) serving {ids or 'models'}"
        return f"a server ({server or 'unknown'}) answering HTTP {response.status_code}"
    return "a process listening (not HTTP)"


def required_bytes_per_gpu(resolved: Resolved, gpu: GpuMemory) -> int:
    """What vLLM itself demands free at start: ceil(total × gpu_memory_utilization)."""
    util = float(resolved.get("VLLM_GPU_MEM_UTIL") or 0.92)
    return int(gpu.total_bytes * util) + 1


def check_guards(
    resolved: Resolved,
    probe: GpuProbe,
    *,
    own_engine_running: bool,
    port_probe: Callable[[str, int], bool] = port_answers,
    identify: Callable[[str], str] = identify_server,
) -> list[Guard]:
    """Everything that must hold before starting: devices, no other engine, enough free memory."""
    guards: list[Guard] = []
    vendor = resolved.get("GPU_VENDOR") or "none"
    missing = probe.missing_devices()
    if missing:
        what = ", ".join(missing)
        fix = ("run on the GPU host with the amdgpu driver loaded (ls /dev/kfd), or use "
               "--platform cpu for a CPU engine" if vendor == "amd" else
               "install the NVIDIA driver and container toolkit, or use --platform cpu")
        guards.append(Guard("no-gpu-devices",
                            f"no {what} found: platform {resolved.platform} needs "
                            f"{'an AMD' if vendor == 'amd' else 'an NVIDIA'} GPU and this host does "
                            "not expose one", fix, overridable=False))
        return guards
    ports = [int(p) for p in as_list(resolved.get("OTHER_ENGINE_PORTS")) if p.isdigit()]
    own_port = int(resolved.get("VLLM_PORT") or 8180)
    if not own_engine_running:
        ports = [own_port, *[p for p in ports if p != own_port]]
    for port in ports:
        if port_probe("127.0.0.1", port):
            who = identify(f"http://127.0.0.1:{port}")
            clash = " (the port this stack publishes)" if port == own_port else ""
            guards.append(Guard(
                "other-engine", f"port {port}{clash} is taken by {who}: another engine may hold "
                "the GPU, and two resident engines overcommit memory",
                f"stop it first (e.g. systemctl stop the router / llama-server), or remove {port} from "
                "OTHER_ENGINE_PORTS if it is not an engine"))
    memory = probe.memory()
    tp = int(resolved.get("VLLM_TP") or 1)
    if memory and vendor != "none":
        for gpu in memory[:tp]:
            need = required_bytes_per_gpu(resolved, gpu)
            if gpu.free_bytes < need:
                guards.append(Guard(
                    "gpu-memory-busy",
                    f"GPU{gpu.index}: {gpu.free_bytes / GIB:.1f} GiB free of {gpu.total_bytes / GIB:.1f}"
                    f" GiB, but gpu_memory_utilization {resolved.get('VLLM_GPU_MEM_UTIL')} needs "
                    f"{need / GIB:.1f} GiB free at start ({gpu.used_bytes / GIB:.1f} GiB in use by "
                    "something else)",
                    "stop the other GPU user, or lower VLLM_GPU_MEM_UTIL (--set VLLM_GPU_MEM_UTIL=...)"))
    return guards


# --- waiting for health --------------------------------------------------------------------

PHASES: tuple[tuple[str, str], ...] = (
    ("Application startup complete", "serving"),
    ("Starting vLLM server", "starting API server"),
    ("Capturing CUDA graph", "capturing graphs"),
    ("Graph capturing finished", "starting API server"),
    ("torch.compile", "compiling"),
    ("Compiling", "compiling"),
    ("KV cache", "allocating KV cache"),
    ("profil", "profiling memory"),
    ("Loading weights took", "profiling memory"),
    ("Loading safetensors", "loading weights"),
    ("Loading model", "loading weights"),
    ("Starting to load model", "loading weights"),
    ("Initializing a V1 LLM engine", "initialising engine"),
    ("non-default args", "parsing arguments"),
)


def phase_of(lines: Sequence[str]) -> str:
    for line in reversed(lines[-60:]):
        for needle, phase in PHASES:
            if needle in line:
                return phase
    return "starting"


def health_status(url: str, timeout: float = 2.0) -> int | None:
    """HTTP status of /health, or None while nothing answers (vLLM does not listen while loading)."""
    try:
        return requests.get(url + "/health", timeout=timeout).status_code
    except requests.RequestException:
        return None


@dataclass
class Progress:
    """One live line (rewritten in place on a terminal, a line per change elsewhere)."""

    out: TextIO
    tty: bool
    last_text: str = ""
    last_print: float = 0.0

    def show(self, elapsed: float, phase: str, last_line: str) -> None:
        line = last_line.strip()
        text = f"[{elapsed:6.1f}s] {phase:<20} {line[-90:]}"
        if self.tty:
            self.out.write("\r" + text[:150].ljust(150))
            self.out.flush()
            return
        now = time.monotonic()
        if phase != self.last_text or now - self.last_print > 15:
            self.out.write(text[:200] + "\n")
            self.out.flush()
            self.last_text, self.last_print = phase, now

    def done(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()


def wait_until_healthy(
    engine: EngineRuntime,
    url: str,
    timeout: float,
    progress: Progress,
    *,
    health: Callable[[str], int | None] = health_status,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Return seconds until /health said 200. Raise LifecycleError with a diagnosis otherwise.

    Never waits blindly: every poll looks at the engine's state first, so an exit or a restart
    is caught within one poll interval, not at the timeout.
    """
    start = clock()
    first = engine.state()
    restarts = first.restart_count
    lines: list[str] = []
    try:
        while True:
            elapsed = clock() - start
            state = engine.state()
            lines = engine.log_lines(200)
            if not state.running or state.restart_count > restarts or state.status == "restarting":
                raise _engine_died(engine, state, elapsed)
            status = health(url)
            if status == 200:
                return elapsed
            if status == 503:
                raise _engine_died(engine, state, elapsed, health_503=True)
            progress.show(elapsed, phase_of(lines), lines[-1] if lines else "")
            if elapsed > timeout:
                tail = engine.log_lines(30)
                raise LifecycleError(
                    f"the engine did not become healthy within {timeout:.0f} s "
                    f"(last phase: {phase_of(lines)})",
                    "raise --timeout (first boots compile kernels for minutes), or read the log "
                    "tail above for a hang",
                    details=["--- last log lines ---", *tail])
            sleep(POLL_S)
    finally:
        progress.done()


def _engine_died(engine: EngineRuntime, state: EngineState, elapsed: float,
                 health_503: bool = False) -> LifecycleError:
    lines = engine.log_lines(2000)
    found = diagnosis.diagnose(lines, state.exit_code)
    if health_503:
        what = "the engine died after its API server came up (/health answered 503)"
    elif state.status == "restarting" or state.restart_count:
        what = f"the engine died and is crash-looping (restarted {state.restart_count} time(s))"
    else:
        what = f"the engine exited with code {state.exit_code}"
    details = ["--- last log lines ---", *lines[-15:], "--- diagnosis ---"]
    if found.line:
        details.append(f"log line {found.line_number}: {found.line.strip()}")
    return LifecycleError(f"{what} after {elapsed:.1f} s: {found.cause}", found.fix, details)


# --- warm-up -------------------------------------------------------------------------------


def warm_up(url: str, served_name: str, timeout: float = 300.0) -> float:
    """One short chat completion, so the first real request does not pay for lazy init."""
    start = time.monotonic()
    try:
        response = requests.post(url + "/v1/chat/completions", timeout=timeout, json={
            "model": served_name,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16,
            "temperature": 0,
        })
    except requests.RequestException as exc:
        raise LifecycleError(f"the warm-up request failed: {exc}",
                             "the engine is up but does not answer; see `invoke logs`") from exc
    if not response.ok:
        raise LifecycleError(
            f"the warm-up request got HTTP {response.status_code}: {response.text[:300]}",
            "check VLLM_SERVED_NAME and the engine log (`invoke logs`)")
    return time.monotonic() - start


# --- state between invocations ------------------------------------------------------------------


def write_state(project: Project, state: dict[str, Any]) -> None:
    project.generated.mkdir(parents=True, exist_ok=True)
    path = project.generated / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(path)


def read_state(project: Project) -> dict[str, Any] | None:
    path = project.generated / STATE_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def engine_url(resolved: Resolved) -> str:
    return f"http://127.0.0.1:{resolved.get('VLLM_PORT') or 8180}"


def wait_gpu_release(probe: GpuProbe, baseline: int | None, timeout: float,
                     sleep: Callable[[float], None] = time.sleep,
                     clock: Callable[[], float] = time.monotonic) -> tuple[bool, int | None]:
    """Wait until used GPU memory is back near `baseline`. Returns (released, used_now)."""
    start = clock()
    while True:
        used = total_used(probe.memory())
        if used is None:
            return True, None
        limit = (baseline or 0) + RELEASE_SLACK
        if used <= limit:
            return True, used
        if clock() - start > timeout:
            return False, used
        sleep(1.0)


# --- orchestration -------------------------------------------------------------------------------


@dataclass
class UpResult:
    url: str
    served_name: str
    boot_seconds: float
    warmup_seconds: float | None
    notes: list[str] = field(default_factory=list)


def preflight(project: Project, resolved: Resolved, environ: Mapping[str, str],
              runtime: str | None = None) -> tuple[ServeCommand, list[Finding]]:
    """`invoke check`'s rules; errors stop `up` before anything starts."""
    findings, ctx = run_checks(project, resolved, environ, runtime=runtime)
    errors = [f for f in findings if f.severity == "error"]
    if errors or ctx.command is None:
        raise LifecycleError(
            f"the profile has {len(errors)} error(s); nothing was started",
            "fix the findings above (`invoke check` shows them all)",
            details=[f.render() for f in errors])
    return ctx.command, findings


def print_guards(guards: list[Guard], force: bool, out: TextIO) -> None:
    blocking = [g for g in guards if not g.overridable or not force]
    for guard in guards:
        if guard.overridable and force:
            print(f"WARNING --force: ignoring guard {guard.code}: {guard.message}", file=out)
    if blocking:
        first = blocking[0]
        raise LifecycleError(first.message, first.fix + ("" if not first.overridable else
                                                          " (or --force to start anyway)"),
                             details=[f"guard {g.code}: {g.message}" for g in blocking[1:]])


def stdout() -> TextIO:
    return sys.stdout


def log_tail_of(runner: Runner, argv: list[str]) -> list[str]:
    result = runner.run(argv, mutates=False, timeout=30)
    return (result.stdout + result.stderr).splitlines()


def relative(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


@dataclass
class Stack:
    """Everything `up`/`down`/`status` need about one resolved profile on one runtime."""

    project: Project
    resolved: Resolved
    environ: Mapping[str, str]
    runner: Runner
    engine: EngineRuntime
    probe: GpuProbe
    out: TextIO

    @property
    def url(self) -> str:
        return engine_url(self.resolved)

    @property
    def served_name(self) -> str:
        return self.resolved.get("VLLM_SERVED_NAME") or ""


def open_stack(
    project: Project,
    resolved: Resolved,
    environ: Mapping[str, str],
    runner: Runner,
    *,
    runtime: str | None = None,
    probe: GpuProbe | None = None,
    out: TextIO | None = None,
) -> Stack:
    """Pick the runtime (--runtime, else RUNTIME, else what a previous `up` used, else detect)."""
    from vllmstack.runtime.gpu import probe_for

    previous = read_state(project) or {}
    requested = runtime or resolved.get("RUNTIME") or "auto"
    if requested == "auto" and previous.get("runtime"):
        # Reuse what `up` used: the compose flavour it detected, or the native runtime.
        requested = str(previous.get("flavour") or
                        ("native" if previous["runtime"] == "native" else "auto"))
    probe = probe or probe_for(resolved.get("GPU_VENDOR") or "none", runner,
                               unified_memory=as_bool(resolved.get("UNIFIED_MEMORY")))
    if requested == "native":
        from vllmstack.runtime.native import engine as native

        engine: EngineRuntime = native.NativeEngine.for_stack(project, resolved, environ, runner)
    else:
        try:
            cli = compose.detect_compose(runner, resolved.get("DOCKER") or "docker", requested)
        except compose.ComposeError as exc:
            raise LifecycleError(str(exc)) from exc
        engine = compose.ComposeEngine(cli, runner, resolved.get("COMPOSE_PROJECT") or "vllmstack",
                                       compose.compose_files(project),
                                       project.generated / "compose.env")
    return Stack(project, resolved, environ, runner, engine, probe, out or sys.stdout)


def up(stack: Stack, *, timeout: float | None = None, force: bool = False, dashboard: bool = True,
       dry_run: bool = False) -> UpResult:
    """Guards, render, start, wait for /health (diagnosing a death at once), warm up, dashboard."""
    out = stack.out
    resolved = stack.resolved
    command, findings = preflight(stack.project, resolved, stack.environ, stack.engine.name)
    for finding in findings:
        if finding.severity == "warning":
            print(finding.render(), file=out)
    current = stack.engine.state()
    previous = read_state(stack.project) or {}
    if current.running and previous.get("argv") == command.argv and health_status(stack.url) == 200:
        print(f"already up and healthy: {stack.served_name} at {stack.url} (same command); "
              "nothing to do", file=out)
        return UpResult(stack.url, stack.served_name, 0.0, None, ["already running"])
    guards = check_guards(resolved, stack.probe, own_engine_running=current.running)
    if current.running:
        guards.insert(0, Guard(
            "already-running",
            f"the stack already runs profile {previous.get('profile', '?')} "
            f"({previous.get('platform', '?')}) with another command",
            "run `invoke down` first"))
    print_guards(guards, force, out)
    notes = _prepare_runtime(stack, command, dry_run=dry_run)
    if dry_run:
        stack.engine.start()  # the runner prints the command instead of running it
        print(f"(dry run) would wait up to {timeout or resolved.get('UP_TIMEOUT')} s for "
              f"{stack.url}/health, then warm up {stack.served_name!r}", file=out)
        return UpResult(stack.url, stack.served_name, 0.0, None, notes)
    baseline = total_used(stack.probe.memory())
    try:
        stack.engine.start()
    except Exception as exc:  # the runtime's own error type carries compose's message
        # A runtime error may carry its own fix (the native runtime's do).
        raise LifecycleError(str(exc), getattr(exc, "fix", None) or _start_fix(stack)) from exc
    write_state(stack.project, {
        "runtime": stack.engine.name, "flavour": stack.engine.flavour,
        "profile": resolved.profile, "platform": resolved.platform,
        "argv": command.argv, "url": stack.url, "served_name": stack.served_name,
        "started": time.time(), "gpu_used_before": baseline,
    })
    limit = float(timeout or resolved.get("UP_TIMEOUT") or 1800)
    print(f"starting {stack.served_name} ({resolved.profile} on {resolved.platform}, "
          f"{stack.engine.name}); waiting up to {limit:.0f} s for {stack.url}/health", file=out)
    try:
        boot = wait_until_healthy(stack.engine, stack.url, limit, Progress(out, out.isatty()))
    except LifecycleError:
        # Keep the container (its log is the evidence) but stop a crash loop from burning GPU time.
        stack.engine.stop()
        raise
    print(f"healthy after {boot:.1f} s", file=out)
    warm = warm_up(stack.url, stack.served_name)
    print(f"warm-up answered in {warm:.2f} s", file=out)
    if dashboard:
        dashboard_up(stack)
    return UpResult(stack.url, stack.served_name, boot, warm, notes)


def _start_fix(stack: Stack) -> str:
    image = stack.resolved.get("VLLM_IMAGE")
    return (f"check that the image {image} exists (`invoke build` makes the full-build image) and "
            "that the compose files render: generated/compose.override.yaml")


def _prepare_runtime(stack: Stack, command: ServeCommand, *, dry_run: bool) -> list[str]:
    """Runtime-specific preparation: for Compose, image, caches and the rendered files."""
    engine = stack.engine
    if not isinstance(engine, compose.ComposeEngine):
        return []
    resolved = stack.resolved
    image = resolved.get("VLLM_IMAGE") or ""
    if not dry_run and not engine.image_exists(image):
        hint = ("build it with `invoke build` (a from-source ROCm build: hours)"
                if image.startswith("localhost/vllm-fullbuild") else
                f"pull it ({engine.cli.engine} pull {image}) or set VLLM_IMAGE")
        raise LifecycleError(f"the engine image {image} does not exist on this host", hint)
    labels = build.read_image_labels(stack.runner, engine.cli.engine, image)
    for finding in build.image_label_findings(stack.project, resolved, labels):
        if finding.severity != "info":
            print(finding.render(), file=stack.out)
    ids = compose.detect_host_ids(resolved)
    paths = compose.stack_paths(resolved, stack.environ)
    try:
        for line in compose.ensure_cache_dirs(paths, ids, dry_run=dry_run):
            print(("(dry run) " if dry_run else "") + line, file=stack.out)
    except compose.ComposeError as exc:
        raise LifecycleError(str(exc)) from exc
    override, notes = compose.build_override(
        stack.project, resolved, command, runtime=engine.cli.runtime, ids=ids, paths=paths,
        package_dir=(labels or {}).get(compose.PACKAGE_LABEL))
    env = compose.interpolation_env(resolved, ids, paths)
    rendered = compose.write_rendered(stack.project, resolved, command, override, env, notes)
    for note in notes:
        print(f"note: {note}", file=stack.out)
    print(f"rendered {relative(rendered.override, stack.project.root)} and "
          f"{relative(rendered.env_file, stack.project.root)}", file=stack.out)
    if as_bool(resolved.get("VLLM_ROCM_USE_AITER")):
        prewarm_aiter(stack, engine, paths, image, dry_run=dry_run)
    return notes


# Builds AITER's JIT core and the unified-attention kernels once, in a throwaway container, so
# the tensor-parallel workers do not race to build them at boot (ModuleNotFoundError, or a
# deadlock on a stale build lock).
AITER_PREWARM = ("import aiter; "
                 "from aiter.ops.triton.unified_attention import unified_attention")


def prewarm_aiter(stack: Stack, engine: compose.ComposeEngine, paths: compose.StackPaths,
                  image: str, *, dry_run: bool) -> None:
    """Once per image: clear stale AITER build locks, then build the JIT kernels."""
    jit = paths.engine_cache / "aiter" / "jit"
    image_id = engine.image_id(image) if not dry_run else None
    marker = jit / f".prewarmed-{(image_id or 'unknown').replace(':', '-')}"
    if image_id and marker.is_file():
        return
    # No engine runs now (the guards made sure), so any build lock left is stale.
    for lock in sorted((jit / "build").glob("lock_*")) if (jit / "build").is_dir() else []:
        print(f"{'(dry run) ' if dry_run else ''}removing stale AITER build lock {lock}",
              file=stack.out)
        if not dry_run:
            lock.unlink(missing_ok=True)
    print("prewarming AITER JIT kernels (once per image, cached under "
          f"{paths.engine_cache})", file=stack.out)
    result = stack.runner.run(engine.compose("run", "--rm", "--no-deps", "-T", "--entrypoint",
                                             "python3", compose.ENGINE_SERVICE, "-c", AITER_PREWARM),
                              capture=False, timeout=3600)
    if not result.ok:
        raise LifecycleError(
            "building AITER's JIT kernels failed (see the output above)",
            "check that the image has AITER for this GPU_ARCH (invoke build), or set "
            "VLLM_ROCM_USE_AITER=0 and ATTENTION_BACKEND=TRITON_ATTN")
    if not dry_run:
        jit.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{image}\n")


def dashboard_up(stack: Stack) -> None:
    engine = stack.engine
    if not isinstance(engine, compose.ComposeEngine):
        print("dashboard: run `invoke dashboard` (the native runtime has no compose service)",
              file=stack.out)
        return
    if not engine.env_file.is_file():
        raise LifecycleError("the stack was never rendered here", "run `invoke up` first")
    image = stack.resolved.get("DASHBOARD_IMAGE") or ""
    if not engine.image_exists(image):
        build_dashboard_image(stack, image)
    result = stack.runner.run(engine.compose("--profile", "dashboard", "up", "-d", "--no-deps",
                                             "dashboard"), timeout=300)
    if not result.ok:
        raise LifecycleError(f"the dashboard did not start: {result.stderr.strip()[-500:]}")
    bind = stack.resolved.get("DASHBOARD_BIND") or "127.0.0.1"
    host = "localhost" if bind in ("127.0.0.1", "0.0.0.0") else bind
    print(f"dashboard at http://{host}:{stack.resolved.get('DASHBOARD_PORT')}", file=stack.out)


# A system CA bundle handed to pip inside the build as a secret (never baked into the image), for
# hosts behind a TLS-re-signing proxy; harmless elsewhere.
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def build_dashboard_image(stack: Stack, image: str) -> None:
    """BuildKit build of Dockerfile.dashboard (compose v1's classic builder cannot do secrets)."""
    docker = stack.resolved.get("DOCKER") or "docker"
    argv = ["env", "DOCKER_BUILDKIT=1", docker, "build", "-f", "Dockerfile.dashboard", "-t", image,
            "--build-arg", f"BASE_IMAGE={stack.resolved.get('DASHBOARD_BASE_IMAGE')}"]
    if CA_BUNDLE.is_file():
        argv += ["--secret", f"id=pip_cert,src={CA_BUNDLE}"]
    result = stack.runner.run([*argv, "."], cwd=stack.project.root, capture=False, timeout=1800)
    if not result.ok:
        raise LifecycleError(
            f"building the dashboard image {image} failed (see the build output above)",
            "BuildKit is needed: set DOCKER=/usr/bin/docker in .env if your docker client lacks "
            "buildx, or start the engine alone with --no-dashboard")


def dashboard_down(stack: Stack) -> None:
    engine = stack.engine
    if isinstance(engine, compose.ComposeEngine) and engine.env_file.is_file():
        stack.runner.run(engine.compose("--profile", "dashboard", "stop", "dashboard"), timeout=120)
        stack.runner.run(engine.compose("--profile", "dashboard", "rm", "-f", "dashboard"),
                         timeout=120)


def down(stack: Stack, *, timeout: float = 120.0, dry_run: bool = False) -> bool:
    """Stop everything the stack started, then wait for GPU memory to be released."""
    previous = read_state(stack.project) or {}
    stack.engine.remove()
    if dry_run:
        return True
    baseline = previous.get("gpu_used_before")
    released, used = wait_gpu_release(stack.probe, baseline if isinstance(baseline, int) else None,
                                      timeout)
    if not released:
        raise LifecycleError(
            f"the engine is stopped but GPU memory is still in use after {timeout:.0f} s "
            f"({(used or 0) / GIB:.1f} GiB, was {(baseline or 0) / GIB:.1f} GiB before `up`)",
            "look for a leftover engine process (amd-smi / nvidia-smi, ps aux | grep vllm) and end it")
    path = stack.project.generated / STATE_FILE
    path.unlink(missing_ok=True)
    print("stopped" + (f"; GPU memory back to {used / GIB:.1f} GiB in use" if used is not None
                       else ""), file=stack.out)
    return True


def status(stack: Stack) -> dict[str, Any]:
    """`invoke status --json`: containers/processes, health, served model, KV usage."""
    from vllmstack.observe import metrics

    state = stack.engine.state()
    code = health_status(stack.url) if state.running else None
    model: str | None = None
    max_len: int | None = None
    if code == 200:
        try:
            data = requests.get(stack.url + "/v1/models", timeout=3).json().get("data", [])
            if data:
                model, max_len = data[0].get("id"), data[0].get("max_model_len")
        except (requests.RequestException, ValueError, AttributeError):
            pass
    recorded = read_state(stack.project) or {}
    report: dict[str, Any] = {
        "runtime": stack.engine.name,
        "running": state.running,
        "healthy": code == 200,
        "model": model,
        "max_model_len": max_len,
        "url": stack.url,
        "profile": recorded.get("profile", stack.resolved.profile),
        "platform": recorded.get("platform", stack.resolved.platform),
        "state": state.status,
        "restarts": state.restart_count,
        "containers": stack.engine.members(),
        "kv_cache_usage": None,
        "requests_running": None,
        "requests_waiting": None,
    }
    if code == 200:
        try:
            snap = metrics.fetch_metrics(stack.url, timeout=3)
        except Exception:  # /metrics is informative here, never fatal
            snap = None
        if snap is not None:
            report["kv_cache_usage"] = snap.kv_cache_usage
            report["requests_running"] = snap.requests_running
            report["requests_waiting"] = snap.requests_waiting
    return report


def render_status(report: dict[str, Any]) -> str:
    health = "healthy" if report["healthy"] else ("running, not healthy" if report["running"]
                                                  else report["state"])
    lines = [f"engine: {health} ({report['runtime']}, profile {report['profile']} on "
             f"{report['platform']})", f"url:    {report['url']}"]
    if report["model"]:
        lines.append(f"model:  {report['model']} (max_model_len {report['max_model_len']})")
    if report["kv_cache_usage"] is not None:
        lines.append(f"kv:     {report['kv_cache_usage'] * 100:.1f} % used, "
                     f"{report['requests_running']:g} running, {report['requests_waiting']:g} waiting")
    for member in report["containers"]:
        lines.append(f"  {member.get('name')}: {member.get('state')} ({member.get('status')})")
    return "\n".join(lines)


def logs(stack: Stack, *, follow: bool = True, tail: int = 200, service: str = "vllm") -> int:
    """Stream the engine log (follow) to the terminal."""
    engine = stack.engine
    if isinstance(engine, compose.ComposeEngine):
        argv = engine.compose("--profile", "dashboard", "logs", "--tail", str(tail),
                              *(["-f"] if follow else []), service)
        return stack.runner.run(argv, capture=False, mutates=False).returncode
    from vllmstack.runtime.native import engine as native

    if isinstance(engine, native.NativeEngine) and service == "vllm":
        return stack.runner.run(engine.log_command(tail=tail, follow=follow), capture=False,
                                mutates=False).returncode
    for line in engine.log_lines(tail):
        print(line, file=stack.out)
    return 0


# The image's Python (the venv that has vLLM) first on PATH: a bare `python3` in the
# container is otherwise the system interpreter without vLLM.
EXEC_PREFIX = ('for d in /opt/venv/bin "$(dirname "$(readlink -f /opt/vllm-package 2>/dev/null)" '
               '2>/dev/null)/../../../bin"; do [ -x "$d/python3" ] && PATH="$d:$PATH" && break; '
               'done; exec "$@"')


def exec_in_engine(stack: Stack, command: Sequence[str], *, tty: bool) -> int:
    engine = stack.engine
    if not command:
        raise LifecycleError("nothing to run", "give a command after --, e.g. invoke exec -- python3 -V")
    if not isinstance(engine, compose.ComposeEngine):
        raise LifecycleError("exec runs inside the engine container; the native runtime has none",
                             "run the command directly (the engine venv is under .cache/engines/)")
    argv = engine.compose("exec", *([] if tty else ["-T"]), "vllm", "sh", "-c", EXEC_PREFIX, "sh",
                          *command)
    return stack.runner.run(argv, capture=False).returncode


def clear_caches(stack: Stack, *, dry_run: bool = False) -> list[str]:
    """Delete compile/JIT caches (after an image or driver change); the HF cache stays."""
    if stack.engine.state().running:
        raise LifecycleError("the engine is running and uses these caches", "invoke down first")
    try:
        done = compose.clear_engine_caches(compose.stack_paths(stack.resolved, stack.environ),
                                           dry_run=dry_run)
    except compose.ComposeError as exc:
        raise LifecycleError(str(exc)) from exc
    for line in done or ["nothing to delete"]:
        print(("(dry run) " if dry_run else "") + line, file=stack.out)
    return done
