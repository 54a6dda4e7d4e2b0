"""`python -m vllmstack.router [--host H] [--port P] [--platform P] [--ttl S] [--profiles a,b]
[--load-timeout S] [--drain-timeout S] [--token-file FILE] [--swap auto|sleep|restart] [--plan]
[--peers name=URL,...] [--peer-token-dir DIR]`.

`invoke router` and this entry point both end in `run_router`; this one serves a checkout
without invoke (a systemd unit, the tests, the benchmark). Values arrive as text and are checked
by run_router (error: / fix:, exit 1). The token is read from the environment (ROUTER_TOKEN) or
a file, never from the command line, where `ps` would show it; it is then taken out of this
process's environment, so nothing the router starts inherits it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import vllmstack.router.options as options
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.router.options import TOKEN_VAR
from vllmstack.router.service import DEFAULT_HOST, DEFAULT_PORT, run_router, show_plan


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllmstack.router",
                                     description="One OpenAI endpoint for every model profile of "
                                                 "the platform, loaded on demand.")
    parser.add_argument("--project", type=Path, default=None,
                        help="the checkout (default: found from the working folder)")
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address (default {DEFAULT_HOST})")
    parser.add_argument("--port", default=str(DEFAULT_PORT), help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--platform", default=None, help="platform (default: PLATFORM of .env)")
    parser.add_argument("--ttl", default=None,
                        help="idle seconds before the resident model is unloaded, for every "
                             "profile (default: each profile's IDLE_TTL; 0 = never)")
    parser.add_argument("--profiles", default="",
                        help="comma-separated model profiles (default: every one made for the platform)")
    parser.add_argument("--runtime", default=None, help="compose or native (default: RUNTIME)")
    parser.add_argument("--load-timeout", default=None,
                        help="seconds a request waits for its model (default: UP_TIMEOUT + 120)")
    parser.add_argument("--drain-timeout", default=None,
                        help="seconds a swap waits for the old model's requests before it cuts "
                             "them (0: for ever; default 600)")
    parser.add_argument("--swap", default=None,
                        help="auto, sleep or restart: how a swap is done (default: ROUTER_SWAP)")
    parser.add_argument("--plan", action="store_true",
                        help="print the memory plan for the platform's profiles; start nothing")
    parser.add_argument("--token-file", default=None,
                        help=f"a file holding the token clients must send (default: {TOKEN_VAR})")
    parser.add_argument("--peers", default=None,
                        help="other boxes' routers whose models this one also serves: "
                             "name=URL,... (default: ROUTER_PEERS)")
    parser.add_argument("--peer-token-dir", default=None,
                        help="the folder of the peers' token files, NAME.token each "
                             "(default: ROUTER_PEER_TOKEN_DIR)")
    args = parser.parse_args(list(argv))
    environ = dict(os.environ)
    os.environ.pop(TOKEN_VAR, None)
    try:
        project = Project(args.project.resolve()) if args.project else Project.find()
        profiles = [p.strip() for p in args.profiles.split(",") if p.strip()]
        if args.plan:
            return show_plan(project, environ, out=sys.stdout, platform=args.platform,
                             profiles=profiles, router_port=options.port(args.port),
                             runtime=args.runtime, swap=options.swap(args.swap))
        return run_router(project, environ, host=args.host, port=args.port,
                          platform=args.platform, ttl=args.ttl,
                          profiles=[p.strip() for p in args.profiles.split(",") if p.strip()],
                          runtime=args.runtime, load_timeout=args.load_timeout,
                          drain_timeout=args.drain_timeout, token_file=args.token_file,
                          swap=args.swap, peers=args.peers,
                          peer_token_dir=args.peer_token_dir)
    except StackError as exc:
        print(exc.render(), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
