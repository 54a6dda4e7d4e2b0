"""`python -m vllmstack.router [--host H] [--port P] [--platform P] [--ttl S] [--profiles a,b]`.

`invoke router` and this entry point both end in `run_router`; this one serves a checkout
without invoke (a systemd unit, the tests, the benchmark). The token is read from the
environment (ROUTER_TOKEN), never from the command line, where `ps` would show it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.router.service import DEFAULT_HOST, DEFAULT_PORT, run_router


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllmstack.router",
                                     description="One OpenAI endpoint for every model profile of "
                                                 "the platform, loaded on demand.")
    parser.add_argument("--project", type=Path, default=None,
                        help="the checkout (default: found from the working folder)")
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address (default {DEFAULT_HOST})")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--platform", default=None, help="platform (default: PLATFORM of .env)")
    parser.add_argument("--ttl", type=float, default=None,
                        help="idle seconds before the resident model is unloaded, for every "
                             "profile (default: each profile's IDLE_TTL; 0 = never)")
    parser.add_argument("--profiles", default="",
                        help="comma-separated model profiles (default: every one made for the platform)")
    parser.add_argument("--runtime", default=None, help="compose or native (default: RUNTIME)")
    parser.add_argument("--load-timeout", type=float, default=None,
                        help="seconds a request waits for its model (default: UP_TIMEOUT + 120)")
    args = parser.parse_args(list(argv))
    project = Project(args.project.resolve()) if args.project else Project.find()
    try:
        return run_router(project, os.environ, host=args.host, port=args.port,
                          platform=args.platform, ttl=args.ttl,
                          profiles=[p.strip() for p in args.profiles.split(",") if p.strip()],
                          runtime=args.runtime, load_timeout=args.load_timeout)
    except StackError as exc:
        print(exc.render(), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
