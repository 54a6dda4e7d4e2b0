"""Tasks over several profiles, one engine resident at a time: bench-vs, burn, router."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from invoke.context import Context

from vllmstack.cli.common import JSON_HELP, Opt, Sets, print_json, project_here
from vllmstack.cli.task import exit_with, stack_task
from vllmstack.cli.values import ENGINE_PROFILE, PATH, choice, text
from vllmstack.core.errors import StackError


@contextlib.contextmanager
def stopped_cleanly(command: str) -> Iterator[None]:
    """SIGTERM, SIGHUP or Ctrl-C: the profile in progress is taken down (resident.take_down runs
    on the way out), then the command ends with error/fix instead of leaving its engine behind."""
    from vllmstack.bench.fleet.resident import Interrupted, stop_on_signals

    try:
        with stop_on_signals():
            yield
    except Interrupted as stop:
        raise StackError(f"{command} stopped by {stop}: the profile it had up was taken down and "
                         "nothing was recorded", f"run `invoke {command}` again") from None


FLEET_HELP = {"platform": "platform layer (default: PLATFORM in .env)",
              "runtime": "native, compose, compose-v1 or podman (default: RUNTIME)"}


@stack_task(iterable=["target"], values={"target": ENGINE_PROFILE}, help={
    **JSON_HELP, **FLEET_HELP,
    "target": "ENGINE:PROFILE, repeatable (e.g. -t vllm:qwen3-0.6b -t llamacpp:qwen3-0.6b-gguf)",
    "ctx": "prompt tokens of the long-context decode column",
    "concurrency": "streams of the aggregate column",
    "think": "leave thinking on (default: chat_template_kwargs.enable_thinking=false)",
    "platform": "platform layer (default: PLATFORM in .env when every target is made for it, "
                "else the one platform they all are made for)"})
def bench_vs(c: Context, target: Sets = None, ctx: int = 8000, concurrency: int = 4,
             think: bool = False, platform: Opt = None, runtime: Opt = None,
             json: bool = False) -> None:
    """Bring each target up in turn, measure it with one client and one definition, take it down."""
    from vllmstack.bench.fleet import vs, vs_report

    with stopped_cleanly("bench-vs"):
        result = vs.run_bench_vs(project_here(), os.environ, list(target or []), think=think,
                                 ctx=ctx, concurrency=concurrency,
                                 platform=platform, runtime=runtime,
                                 out=sys.stderr if json else sys.stdout)
    print_json(result.record) if json else print(vs_report.render(result.record))
    exit_with(1 if result.failed else 0)


@stack_task(help={**JSON_HELP, **FLEET_HELP,
                  "profiles": "comma-separated profiles (default: every profile made for the platform)",
                  "runs": "measured runs per profile (default 5)",
                  "warmup": "runs discarded first (default 2)",
                  "max_tokens": "tokens per run (default 200)"})
def burn(c: Context, profiles: Opt = None, runs: int = 5, warmup: int = 2, max_tokens: int = 200,
         platform: Opt = None, runtime: Opt = None, json: bool = False) -> None:
    """Load every profile that fits this platform, measure it, unload it; a PASS/FAIL table."""
    from vllmstack.bench.fleet import burn as burn_test

    chosen = [p.strip() for p in (profiles or "").split(",") if p.strip()] or None
    with stopped_cleanly("burn"):
        result = burn_test.run_burn(project_here(), os.environ, profiles=chosen, runs=runs,
                                    warmup=warmup, max_tokens=max_tokens, platform=platform,
                                    runtime=runtime, out=sys.stderr if json else sys.stdout)
    print_json(result.record) if json else print(burn_test.render(result.record))
    exit_with(1 if result.failed else 0)


@stack_task(values={"token_file": PATH, "peer_token_dir": PATH,
                    # its names and URLs are checked with the peers' tokens (router.peers)
                    "peers": text("peers: NAME=URL, comma-separated", "box2=http://10.0.0.2:8080"),
                    "swap": choice(("auto", "sleep", "restart"))}, help={
    **FLEET_HELP,
    "host": "address to listen on (default 127.0.0.1; beyond loopback a token is required)",
    "port": "port to listen on (default 8080)",
    "ttl": "unload a model after this many idle seconds (0: never; default: IDLE_TTL)",
    "profiles": "comma-separated profiles to offer (default: every one made for the platform)",
    "token_file": "a file holding the bearer token clients must send (default: ROUTER_TOKEN "
                  "from the environment or .env; never on the command line, where ps shows it)",
    "load_timeout": "seconds a request waits for its model to load",
    "drain_timeout": "seconds a swap waits for the old model's requests before it "
                     "cuts them (0: for ever; default 600)",
    "swap": "auto, sleep (keep loaded vLLM engines asleep, wake in about a second) or restart "
            "(default: ROUTER_SWAP)",
    "plan": "print the memory plan for the platform's profiles and start nothing",
    "peers": "other boxes' routers whose models this one also serves: name=URL,... (default: "
             "ROUTER_PEERS)",
    "peer_token_dir": "the folder of the peers' token files, NAME.token each (default: "
                      "ROUTER_PEER_TOKEN_DIR, else ~/.config/vllmstack/peer-tokens)"})
def router(c: Context, host: str = "127.0.0.1", port: int = 8080, platform: Opt = None,
           ttl: float | None = None, profiles: Opt = None, token_file: Opt = None,
           runtime: Opt = None, load_timeout: float | None = None,
           drain_timeout: float | None = None, swap: Opt = None, plan: bool = False,
           peers: Opt = None, peer_token_dir: Opt = None) -> None:
    """One OpenAI endpoint for every profile: loads the model a request names, swaps by sleep or restart."""
    from vllmstack.router.options import TOKEN_VAR
    from vllmstack.router.service import run_router, show_plan

    chosen = [p.strip() for p in (profiles or "").split(",") if p.strip()]
    if plan:
        exit_with(show_plan(project_here(), os.environ, out=sys.stdout, platform=platform,
                            profiles=chosen, router_port=port, runtime=runtime, swap=swap))
        return
    environ = dict(os.environ)
    # Read once, then out of this process's environment: nothing the router starts inherits it.
    os.environ.pop(TOKEN_VAR, None)
    exit_with(run_router(project_here(), environ, host=host, port=port, platform=platform,
                         ttl=ttl, profiles=chosen, token_file=token_file, runtime=runtime,
                         load_timeout=load_timeout, drain_timeout=drain_timeout, swap=swap,
                         peers=peers, peer_token_dir=peer_token_dir))
