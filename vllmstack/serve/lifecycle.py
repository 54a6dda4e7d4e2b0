"""Serving lifecycle: up (guards, prepare, start, watch, diagnose, warm up), down, status, logs, exec.

The runtime-specific part (how the engine is prepared, started, inspected, logged and stopped)
sits behind `EngineRuntime`; guards (serve.guards), the progress display and crash detection
(serve.watch), the diagnosis table (serve.diagnosis) and the state file (serve.state) are
shared by every runtime. This module strings them together.
"""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

import requests

from vllmstack.checks.registry import run_checks, with_engine_image
from vllmstack.config.engines.table import DEFAULT, display_name, engine_kind, engine_of
from vllmstack.config.profiles import Resolved
from vllmstack.config.vllm_args import ServeCommand
from vllmstack.core.errors import StackError
from vllmstack.core.files import FileWriteError, remove_file
from vllmstack.core.findings import Finding, sort_findings
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner, mask_argv
from vllmstack.observe import metrics
from vllmstack.observe.health import health_status, identify_server
from vllmstack.runtime.base import Beside
from vllmstack.runtime.gpu import GIB, total_used
from vllmstack.serve.boot_phases import Boot
from vllmstack.serve.engines import (
    answering_others,
    named_report,
    named_stack,
    recorded_engines,
    unload_through_router,
)
from vllmstack.serve.guards import (
    Guard,
    active_services,
    check_guards,
    print_guards,
    stop_services,
    wait_gpu_release,
    wait_gpu_settled,
)
from vllmstack.serve.inspection import clear_caches, exec_in_engine, logs
from vllmstack.serve.interruption import (
    UP_STOP_WAIT_S,
    UpInterruptedError,
    sigterm_interrupts,
    stop_booting_up,
)
from vllmstack.serve.running import recorded_overrides
from vllmstack.serve.stack import LifecycleError, Stack, open_stack
from vllmstack.serve.startup import boot_summary, measure_up_boot, summary_line
from vllmstack.serve.state import (
    StateError,
    foreign_state,
    read_state,
    set_aside_damaged,
    state_path,
    write_state,
)
from vllmstack.serve.watch import Progress, wait_until_healthy, warm_up
from vllmstack.tune.kv_copy import served_model

# The serving layer's commands, one per task (open_stack picks the runtime for all of them).
__all__ = ["LifecycleError", "UpResult", "clear_caches", "dashboard_down", "dashboard_up", "down",
           "exec_in_engine", "logs", "open_stack", "prepare_down", "render_status", "status", "up"]


# How long `--stop-other` waits for the stopped engine's GPU memory to drain.
DRAIN_TIMEOUT_S = 120.0


@dataclass
class UpResult:
    url: str
    served_name: str
    boot_seconds: float
    warmup_seconds: float | None
    notes: list[str] = field(default_factory=list)
    boot: Boot | None = None  # the boot's phases (serve.boot_phases); None: none was waited for


def preflight(project: Project, resolved: Resolved, environ: Mapping[str, str],
              runtime: str | None = None, runner: Runner | None = None,
              flavour: str | None = None) -> tuple[ServeCommand, list[Finding]]:
    """`invoke check`'s rules (with a runner: on the host's detected GPUs, and on a container
    runtime the image's build labels: its archs, its RCCL); errors stop `up` before anything
    starts. `flavour`: the concrete container runtime, whose image store is read."""
    findings, ctx = run_checks(project, resolved, environ, runtime=runtime, runner=runner)
    if runner is not None and engine_kind(resolved).vllm_cli and ctx.runtime != "native":
        # The same label rules as `check`: an image without the card's arch aborts silently at
        # the first kernel launch, so it must not get as far as the start.
        findings, _ = with_engine_image(findings, ctx, runner, flavour)
        findings = sort_findings(findings)
    errors = [f for f in findings if f.severity == "error"]
    if errors or ctx.command is None:
        raise LifecycleError(
            f"the profile has {len(errors)} error(s); nothing was started",
            "fix the findings above (`invoke check` shows them all)",
            details=[f.render() for f in errors])
    return ctx.command, findings


def up(stack: Stack, *, timeout: float | None = None, force: bool = False, dashboard: bool = True,
       dry_run: bool = False, stop_other: bool = False) -> UpResult:
    """Guards, render, start, wait for /health (diagnosing a death at once), warm up, dashboard.

    One engine resident: while another engine (this stack's, of another profile or engine; a
    system service in OTHER_ENGINE_SERVICE; a server on OTHER_ENGINE_PORTS) holds the GPU, `up`
    refuses and names it; `stop_other` stops the stack's own and the services first.
    Under the stack lock: a second `up` waits for this one or refuses, naming it; a `down`
    stops it (SIGTERM, see serve.interruption), and it stops the engine it started."""
    with sigterm_interrupts() as stoppable, stack.lock("up", dry_run=dry_run, stoppable=stoppable):
        return _up(stack, timeout=timeout, force=force, dashboard=dashboard, dry_run=dry_run,
                   stop_other=stop_other)


def _stop_others(stack: Stack, previous: Mapping[str, Any], *, own: bool, dry_run: bool) -> bool:
    """`--stop-other`: end the stack's running engine (`own`: it runs another command) and the
    other engines' system services, then wait for their GPU memory to drain. Returns whether the
    stack's own engine was stopped."""
    stopped_own = False
    if own:
        print(f"--stop-other: stopping this stack's engine (profile {previous.get('profile', '?')}, "
              f"{display_name(str(previous.get('engine') or DEFAULT.name))}) first", file=stack.out)
        _down(stack, timeout=DRAIN_TIMEOUT_S, dry_run=dry_run)
        stopped_own = True
    units = active_services(stack.resolved, stack.runner)
    stop_services(units, stack.runner, stack.out)
    if units and not dry_run:
        used = wait_gpu_settled(stack.probe, DRAIN_TIMEOUT_S)
        if used is not None:
            print(f"GPU memory in use after stopping {', '.join(units)}: {used / GIB:.1f} GiB",
                  file=stack.out)
    return stopped_own


def _serving(stack: Stack) -> Stack:
    """The stack of what `up` really serves: with an fp8 KV cache and calibrated scales
    (VLLM_KV_SCALES=calibrated, or VLLM_MODEL a calibrated copy), the copy, made or rebuilt first
    when it is missing or stale ("ensure": tune.kv_copy.served_model)."""
    def beside() -> Beside:
        # A container runtime renders its files for the engine command before it runs anything:
        # the source's, checked as `up` checks (an error stops here, before minutes of measuring).
        command, _ = preflight(stack.project, stack.resolved, stack.environ, stack.engine.name,
                               runner=stack.runner, flavour=stack.engine.flavour)
        return stack.engine.beside(command)

    served = served_model(stack.project, stack.resolved, stack.environ, beside=beside,
                          say=lambda line: print(line, file=stack.out))
    if served is stack.resolved:
        return stack
    # The concrete runtime (podman, compose-v1...), not its kind ("compose"): the same one again.
    return open_stack(stack.project, served, stack.environ, stack.runner, runtime=stack.engine.flavour,
                      probe=stack.probe, out=stack.out, slot=stack.slot, siblings=stack.siblings)


def _up(stack: Stack, *, timeout: float | None, force: bool, dashboard: bool,
        dry_run: bool, stop_other: bool) -> UpResult:
    stack = _serving(stack)
    out = stack.out
    resolved = stack.resolved
    command, findings = preflight(stack.project, resolved, stack.environ, stack.engine.name,
                                  runner=stack.runner, flavour=stack.engine.flavour)
    for finding in findings:
        if finding.severity == "warning":
            print(finding.render(), file=out)
    current = stack.engine.state()
    previous = read_state(stack.project, stack.slot) or {}
    same = previous.get("argv") == command.argv
    if stop_other and _stop_others(stack, previous, own=current.running and not same,
                                   dry_run=dry_run):
        current, previous = stack.engine.state(), {}
    healthy = current.running and health_status(stack.url) == 200
    if current.running and same and healthy:
        print(f"already up and healthy: {stack.served_name} at {stack.url} (same command); "
              "nothing to do for the engine", file=out)
        notes = ["already running"]
        if dashboard and not dry_run:
            # Idempotent for real: a dashboard that failed to start last time starts now.
            start_dashboard(stack, notes)
        return UpResult(stack.url, stack.served_name, 0.0, None, notes)
    if current.running and same and not dry_run:
        # Started with this very command by an `up` that ended before it was healthy (killed,
        # Ctrl-C): we hold the lock, so no other `up` runs. Wait for it, not refuse it.
        print("the engine is already starting with this very command (an earlier `invoke up` "
              "ended before it was healthy); waiting for it instead of starting another",
              file=out)
        return _boot(stack, [], dashboard=dashboard, timeout=timeout,
                     launched=previous.get("launched", previous.get("started")))
    guards = check_guards(resolved, stack.probe, own_engine_running=current.running,
                          runtime=stack.engine.flavour, runner=stack.runner)
    if current.running:
        guards.insert(0, _already_running(previous))
    guards[:0] = [_checkout_engine(other) for other in
                  answering_others(stack.project, stack.slot, stack.siblings)]
    print_guards(guards, force, out)
    notes = stack.engine.prepare(command, dry_run=dry_run)
    if dry_run:
        stack.engine.start()  # the runner prints the command instead of running it
        print(f"(dry run) would wait up to {timeout or resolved.get('UP_TIMEOUT')} s for "
              f"{stack.url}/health, then warm up {stack.served_name!r}", file=out)
        return UpResult(stack.url, stack.served_name, 0.0, None, notes)
    baseline = total_used(stack.probe.memory())
    started, launched = False, time.time()
    try:
        stack.engine.start()  # a runtime's StackError carries its own cause and fix
        started = True
        write_state(stack.project, {
            "runtime": stack.engine.name, "flavour": stack.engine.flavour,
            "engine": engine_of(resolved),
            "compose_project": stack.compose_project,
            "profile": resolved.profile, "platform": resolved.platform,
            "sets": recorded_overrides(resolved),
            "argv": command.argv, "url": stack.url, "served_name": stack.served_name,
            "started": time.time(), "launched": launched, "gpu_used_before": baseline,
            "slot": stack.slot,
        }, stack.slot)
    except (FileWriteError, UpInterruptedError) as exc:
        # An engine `down` could not account for (no state file) must not keep running; one
        # interrupted while starting may be running already.
        stack.engine.stop()
        raise LifecycleError(f"{exc.cause}; the engine this `up` started was stopped"
                             if started and isinstance(exc, FileWriteError) else exc.cause,
                             exc.fix) from exc
    return _boot(stack, notes, dashboard=dashboard, timeout=timeout, launched=launched)


def _already_running(previous: Mapping[str, Any]) -> Guard:
    if "argv" not in previous:
        return Guard("already-running",
                     "an engine this checkout started is running, but generated/state.json does "
                     "not say with which command (an `invoke up` ended before it recorded it): "
                     "one engine is resident at a time",
                     "`invoke down` first, or `invoke up --stop-other` to stop it and start this one")
    running = display_name(str(previous.get("engine") or DEFAULT.name))
    return Guard(
        "already-running",
        f"the stack already runs {running} with profile {previous.get('profile', '?')} "
        f"({previous.get('platform', '?')}) and another command: one engine is resident at a time",
        "`invoke down` first, or `invoke up --stop-other` to stop it and start this one")


def _checkout_engine(other: Any) -> Guard:
    return Guard(
        "checkout-engine",
        f"{other.shown} runs beside this one: another engine of this checkout holds the GPU "
        "(the router's engines are started and stopped by the router)",
        "`invoke down` stops every engine of the checkout (stop the router first if it runs); "
        "or `invoke up --force` to start anyway")


def _boot(stack: Stack, notes: list[str], *, dashboard: bool, timeout: float | None,
          launched: float | None) -> UpResult:
    """Wait for the started engine's /health (stopping it when it dies, hangs or `up` is
    interrupted), warm it up, record the boot's phases (`launched`: when it was started), start
    the dashboard."""
    out, resolved = stack.out, stack.resolved
    limit = float(timeout or resolved.get_float("UP_TIMEOUT"))
    print(f"starting {stack.served_name} ({resolved.profile} on {resolved.platform}, "
          f"{stack.engine.name}); waiting up to {limit:.0f} s for {stack.url}/health", file=out)
    booting = True
    try:
        boot = wait_until_healthy(stack.engine, stack.url, limit, Progress(out, out.isatty()),
                                  vendor=resolved.get_str("GPU_VENDOR"),
                                  secrets=resolved.secrets(),
                                  loading_503=engine_kind(resolved).loading_503,
                                  tensor_parallel=resolved.get_int("VLLM_TP"),
                                  backend=resolved.get("ATTENTION_BACKEND"))
        booting, healthy_at = False, time.time()
        print(f"healthy after {boot:.1f} s", file=out)
        warm = warm_up(stack.url, stack.served_name)
        print(f"warm-up answered in {warm:.2f} s", file=out)
        phases = measure_up_boot(stack, launched, healthy_at, warm)
        if phases is not None:
            print(f"boot: {summary_line(phases)}", file=out)
        if dashboard:
            start_dashboard(stack, notes)
    except LifecycleError as exc:
        # Keep the container (its log is the evidence) but stop a crash loop from burning GPU
        # time; a failed warm-up leaves a healthy engine to look at, unless `up` was stopped.
        if booting or isinstance(exc, UpInterruptedError):
            stack.engine.stop()
        raise
    return UpResult(stack.url, stack.served_name, boot, warm, notes, phases)


def start_dashboard(stack: Stack, notes: list[str]) -> bool:
    """Start the optional dashboard once the engine is healthy; a failure is a warning, never a
    failed `up` (the engine runs and serves either way)."""
    try:
        stack.engine.dashboard_up()
    except StackError as exc:
        print(f"warning: the engine is up, but the dashboard did not start: {exc.cause}",
              file=stack.out)
        if exc.fix:
            print(f"         fix: {exc.fix}", file=stack.out)
        print("         then `invoke dashboard-up` (or `invoke up` again) starts it; `invoke dashboard` "
              "serves it in the foreground now", file=stack.out)
        notes.append(f"dashboard not started: {exc.cause}")
        return False
    return True


def dashboard_up(stack: Stack) -> None:
    stack.engine.dashboard_up()


def dashboard_down(stack: Stack) -> None:
    stack.engine.dashboard_down()


def prepare_down(project: Project, *, dry_run: bool = False, out: TextIO | None = None) -> None:
    """Before `down` resolves anything: a damaged generated/state.json is set aside (renamed,
    not deleted), so `down` still stops the engine instead of refusing (serve.state)."""
    if dry_run:
        return
    warning = set_aside_damaged(project)
    if warning:
        print(warning, file=out or sys.stdout)


def down(stack: Stack, *, timeout: float = 120.0, dry_run: bool = False) -> bool:
    """Stop everything the stack started, then wait for GPU memory to be released. An `up` of
    this checkout that is still booting is stopped first (serve.interruption)."""
    stopping_up = not dry_run and stop_booting_up(stack.project, stack.out)
    with stack.lock("down", dry_run=dry_run, wait=UP_STOP_WAIT_S if stopping_up else None):
        return _down(stack, timeout=timeout, dry_run=dry_run)


def _down(stack: Stack, *, timeout: float, dry_run: bool) -> bool:
    """Stop the stack's engine; the default engine's `down` stops the checkout's named engines
    too (the router's, one per profile): `invoke down` leaves no engine of the checkout."""
    note = foreign_state(stack.project) if not stack.slot else None
    if note:
        print(f"note: {note}", file=stack.out)
    if not stack.slot and not dry_run:
        unload_through_router(stack)  # a router's engines go through it (or `down` refuses)
    stopped = [(stack, _stop_one(stack, stack.url, dry_run))]
    if not stack.slot:
        for other in recorded_engines(stack.project):
            if other.slot:
                named = named_stack(stack, other.slot)
                with named.lock("down", dry_run=dry_run):
                    stopped.append((named, _stop_one(named, other.url or named.url, dry_run)))
    if dry_run:
        return True
    baselines = [b for _, previous in stopped
                 if isinstance(b := previous.get("gpu_used_before"), int)]
    if answering_others(stack.project, stack.slot, frozenset()):
        # Other engines of the checkout still run (the router stops one of its several): the
        # memory in use before this one started says nothing now; wait until it stops falling
        # (its processes have ended: the driver frees their memory within a moment).
        used = wait_gpu_settled(stack.probe, timeout, interval=0.5, steady_for=2)
        released = True
    else:
        baseline = min(baselines) if baselines else None
        released, used = wait_gpu_release(stack.probe, baseline, timeout)
    if not released:
        raise LifecycleError(
            f"the engine is stopped but GPU memory is still in use after {timeout:.0f} s "
            f"({(used or 0) / GIB:.1f} GiB, was {(min(baselines) if baselines else 0) / GIB:.1f} "
            "GiB before `up`)",
            "look for a leftover engine process (amd-smi / nvidia-smi, ps aux | grep vllm) and end it")
    for each, _ in stopped:
        remove_file(state_path(each.project, each.slot))
    print("stopped" + (f" {len(stopped)} engines" if len(stopped) > 1 else "")
          + (f"; GPU memory back to {used / GIB:.1f} GiB in use" if used is not None else ""),
          file=stack.out)
    return True


def _stop_one(stack: Stack, url: str, dry_run: bool) -> dict[str, Any]:
    """End one engine (and what its runtime started beside it); its recorded state. Raises
    while its URL still answers: "stopped" over a live engine would be a lie."""
    try:
        previous = read_state(stack.project, stack.slot) or {}
    except StateError:
        if not stack.slot:
            raise
        previous = {}  # a named engine's damaged state: its runtime's own record still finds it
    left = stack.engine.remove() or []
    for line in left:
        print(line, file=stack.out)
    if dry_run or health_status(url) is None:
        return previous
    port = url.rsplit(":", 1)[-1]
    raise LifecycleError(
        f"{url} still answers after the {stack.engine.name} runtime stopped what it "
        f"knows of: {identify_server(url)}",
        (f"it is served by a process this checkout did not start ({len(left)} left alone, "
         "named above): stop it where it was started, or give this checkout its own "
         "VLLM_PORT" if left else
         f"find the process listening on port {port} (ss -ltnp 'sport = :{port}') "
         "and end it; if it is this stack's engine, report how it escaped `down`"))


def status(stack: Stack) -> dict[str, Any]:
    """`invoke status --json`: containers/processes, health, served model, KV usage."""
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
    recorded = read_state(stack.project, stack.slot) or {}
    report: dict[str, Any] = {
        "runtime": stack.engine.name,
        "running": state.running,
        "healthy": code == 200,
        "model": model,
        "max_model_len": max_len,
        "url": stack.url,
        # What `up` started, as generated/state.json records it: after `down` nothing is, and
        # the profile .env selects must not read as if it ran.
        "profile": recorded.get("profile"),
        "platform": recorded.get("platform"),
        # The argv it runs (the one `check` built for the runtime's placement), tokens masked.
        "argv": mask_argv([str(a) for a in recorded["argv"]]) if recorded.get("argv") else None,
        "selected": {"profile": stack.resolved.profile, "platform": stack.resolved.platform},
        "state": state.status,
        "restarts": state.restart_count,
        "containers": stack.engine.members(),
        "kv_cache_usage": None,
        "requests_running": None,
        "requests_waiting": None,
        "boot": recorded.get("boot"),  # its phases, as `up` measured them (`invoke startup`)
        # The checkout's named engines (the router's, one per profile), each in its own place.
        "engines": named_report(stack.project) if not stack.slot else [],
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
    if report["profile"]:
        what = f"{report['runtime']}, profile {report['profile']} on {report['platform']}"
    else:
        chosen = report.get("selected") or {}
        what = (f"{report['runtime']}; nothing started by `invoke up` here; `invoke up` would "
                f"start {chosen.get('profile')} on {chosen.get('platform')}")
    lines = [f"engine: {health} ({what})", f"url:    {report['url']}"]
    if report.get("argv"):
        lines.append(f"argv:   {shlex.join(report['argv'])}")
    if report.get("boot"):
        lines.append(f"boot:   {boot_summary(report['boot'])}")
    if report["model"]:
        lines.append(f"model:  {report['model']} (max_model_len {report['max_model_len']})")
    if report["kv_cache_usage"] is not None:
        lines.append(f"kv:     {report['kv_cache_usage'] * 100:.1f} % used, "
                     f"{report['requests_running']:g} running, {report['requests_waiting']:g} waiting")
    for member in report["containers"]:
        lines.append(f"  {member.get('name')}: {member.get('state')} ({member.get('status')})")
    for named in report.get("engines") or []:
        tier = named.get("tier")
        swap = named.get("swap_s")
        lines.append(f"engine {named['name']}: {named['state']} (profile {named['profile']}, "
                     f"{named['url']}" + (f"; router tier {tier}" if tier else "")
                     + (f", swap back ~{swap:.2f} s" if tier and swap else "") + ")"
                     + (f"; boot {boot_summary(named['boot'])}" if named.get("boot") else ""))
    return "\n".join(lines)
