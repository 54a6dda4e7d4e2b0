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

from vllmstack.dashboard.app import DashboardError, DashboardSettings


def _int_or_none(raw: str | None) -> int | None:
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


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
    parser.add_argument("--history-dir", type=Path, required=True,
                        help="folder with the benchmark history files (normally benchmarks/)")
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
                        default=_int_or_none(environ.get("VLLM_MAX_NUM_SEQS")),
                        help="the engine's max_num_seqs: top of the concurrency ladder "
                             "(default: VLLM_MAX_NUM_SEQS)")
    parser.add_argument("--poll-interval", type=float, default=1.0,
                        help="seconds between /metrics polls while the engine answers")
    args = parser.parse_args(list(argv))
    return DashboardSettings(
        engine_url=args.engine_url,
        history_dir=args.history_dir,
        host=args.host,
        port=args.port,
        exposure=args.exposure,
        token=environ.get("DASHBOARD_TOKEN", ""),
        model=args.model,
        tokenizer=args.tokenizer,
        max_num_seqs=args.max_num_seqs,
        poll_interval=args.poll_interval,
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
    values: Mapping[str, str],
    history_dir: Path,
    *,
    host: str | None = None,
    port: int | None = None,
    engine_url: str | None = None,
    tokenizer: str | None = None,
) -> DashboardSettings:
    """Settings for `invoke dashboard`: the resolved profile's values, then the task's flags.

    Against the profile's own engine the tokenizer comes from VLLM_TOKENIZER; against another
    engine URL only --tokenizer counts (the profile's tokenizer may belong to another model).
    """
    if tokenizer is None and engine_url is None:
        tokenizer = values.get("VLLM_TOKENIZER") or None
    return DashboardSettings(
        engine_url=engine_url or f"http://127.0.0.1:{values.get('VLLM_PORT') or 8180}",
        history_dir=history_dir,
        host=host or values.get("DASHBOARD_BIND") or "127.0.0.1",
        port=port or int(values.get("DASHBOARD_PORT") or 8083),
        token=values.get("DASHBOARD_TOKEN") or "",
        tokenizer=tokenizer,
        max_num_seqs=_int_or_none(values.get("VLLM_MAX_NUM_SEQS")) if engine_url is None else None,
    )


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
