"""`python -m vllmstack.dashboard --host H --port P --engine-url URL --history-dir DIR`.

The compose service and `invoke dashboard` both end here. The token is read from
the environment (DASHBOARD_TOKEN), never from the command line, where `ps` would
show it to every user of the machine.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from vllmstack.bench.target import TargetError, dashboard_target, int_or_none
from vllmstack.config.profiles import ProfileError, Resolved, resolve
from vllmstack.core.paths import Project, results_folder
from vllmstack.dashboard.app import DashboardError, DashboardSettings
from vllmstack.serve.running import resolve_following


def _env_int(environ: Mapping[str, str], key: str) -> int | None:
    try:
        return int_or_none(environ.get(key), key)
    except TargetError:
        return None  # a default only: the flag can still set it, and the page works without it


def parse_settings(argv: Sequence[str], environ: Mapping[str, str]) -> DashboardSettings:
    parser = argparse.ArgumentParser(
        prog="python -m vllmstack.dashboard",
        description="Serve the vllmstack dashboard: live engine metrics and benchmark history.",
    )
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8083, help="port (default 8083)")
    parser.add_argument("--engine-url", required=True,
                        help="the engine's base URL, e.g. http://127.0.0.1:8180")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="folder for the record of the running benchmark, so a dashboard "
                             "started after a killed one finds it (default: --history-dir)")
    parser.add_argument("--history-dir", type=Path, required=True,
                        help="folder with the benchmark history files (normally results/)")
    parser.add_argument("--exposure", default=environ.get("DASHBOARD_BIND") or None,
                        help="address users reach the dashboard on when it differs from --host "
                             "(a container binds 0.0.0.0 behind a 127.0.0.1 port); decides "
                             "whether DASHBOARD_TOKEN is required (default: DASHBOARD_BIND, "
                             "else --host)")
    parser.add_argument("--model", default=None,
                        help="served model name for runs (default: ask the engine's /v1/models)")
    parser.add_argument("--tokenizer", default=environ.get("VLLM_TOKENIZER") or None,
                        help="tokenizer path or id for runs (default: VLLM_TOKENIZER)")
    parser.add_argument("--max-num-seqs", type=int,
                        default=_env_int(environ, "VLLM_MAX_NUM_SEQS"),
                        help="the engine's max_num_seqs: top of the concurrency ladder "
                             "(default: VLLM_MAX_NUM_SEQS)")
    parser.add_argument("--poll-interval", type=float, default=1.0,
                        help="seconds between /metrics polls while the engine answers")
    parser.add_argument("--router-url", default=environ.get("ROUTER_URL") or "http://127.0.0.1:8080",
                        help="`invoke router`'s URL, whose state the page shows (default: ROUTER_URL, "
                             "else http://127.0.0.1:8080)")
    args = parser.parse_args(list(argv))
    return DashboardSettings(
        engine_url=args.engine_url,
        history_dir=args.history_dir,
        state_dir=args.state_dir,
        host=args.host,
        port=args.port,
        exposure=args.exposure,
        token=environ.get("DASHBOARD_TOKEN", ""),
        model=args.model,
        tokenizer=args.tokenizer,
        max_num_seqs=args.max_num_seqs,
        poll_interval=args.poll_interval,
        router_url=args.router_url,
        router_token=environ.get("ROUTER_TOKEN", ""),
    )


def serve(settings: DashboardSettings, environ: Mapping[str, str]) -> None:
    """Run the dashboard in the foreground until interrupted."""
    import uvicorn

    from vllmstack.dashboard.app import create_app

    app = create_app(settings, environ=environ)
    where = f"http://{settings.host}:{settings.port}/"
    mode = "token required for changes" if settings.auth_required else "loopback only, no token"
    print(f"dashboard: {where} (engine {settings.engine_url}; {mode})", flush=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning",
                access_log=False)


def settings_from_profile(
    resolved: Resolved,
    history_dir: Path,
    *,
    host: str | None = None,
    port: int | None = None,
    engine_url: str | None = None,
    tokenizer: str | None = None,
) -> DashboardSettings:
    """Settings for `invoke dashboard`: the resolved profile's values, then the task's flags."""
    target = dashboard_target(resolved, host=host, port=port, engine_url=engine_url,
                              tokenizer=tokenizer)
    return DashboardSettings(engine_url=target.engine_url, history_dir=history_dir,
                             host=target.host, port=target.port, token=target.token,
                             tokenizer=target.tokenizer, max_num_seqs=target.max_num_seqs)


def settings_for_stack(
    project: Project,
    environ: Mapping[str, str],
    *,
    model: str | None = None,
    platform: str | None = None,
    sets: Sequence[str] = (),
    host: str | None = None,
    port: str | None = None,
    engine_url: str | None = None,
    tokenizer: str | None = None,
) -> DashboardSettings:
    """`invoke dashboard`'s flags resolved against the profile.

    With --engine-url the dashboard can serve any engine, so a profile that does not resolve is
    only a note: every setting then takes its schema default.
    """
    try:
        # Against the stack's own engine: the profile that runs (serve.running), not .env's.
        resolved = (resolve(project, platform=platform, model=model, overrides=list(sets),
                            environ=environ) if engine_url is not None else
                    resolve_following(project, model=model, platform=platform, overrides=sets,
                                      environ=environ, say=lambda s: print(s, file=sys.stderr)))
    except ProfileError as exc:
        if engine_url is None:
            raise
        print(f"note: no profile ({exc}); using defaults", file=sys.stderr)
        resolved = Resolved(platform="", profile="", values={}, layers=[])
    try:
        port_number = int(port) if port else None  # invoke hands over the flag's text
    except ValueError as exc:
        raise DashboardError(f"--port must be a number, got {port!r}") from exc
    return settings_from_profile(resolved, results_folder(project), host=host, port=port_number,
                                 engine_url=engine_url, tokenizer=tokenizer)


def run(settings: DashboardSettings, environ: Mapping[str, str]) -> int:
    """Validate, then serve in the foreground; 2 with a clear message for unusable settings."""
    try:
        settings.validate()
    except DashboardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings.history_dir.mkdir(parents=True, exist_ok=True)
    serve(settings, environ)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    environ = dict(os.environ)
    return run(parse_settings(sys.argv[1:] if argv is None else argv, environ), environ)


if __name__ == "__main__":
    sys.exit(main())
