"""How long `invoke check --deep` takes with vLLM's own parser. Prints numbers.

    python benchmarks/bench_vllm_parser.py [--runs 3] [--create]

  * warm single: one argv (the default profile), parser env already present — what
    `invoke check --deep` costs after the first time. Most of it is importing vLLM.
  * warm batch: every shipped model profile on each of its platforms in one run.
  * --create: also time creating a fresh parser env from PyPI in a throw-away folder
    (downloads the vLLM wheel, ~320 MB; pip's cache is bypassed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllmstack.checks import deep as vp  # noqa: E402
from vllmstack.config.profiles import list_profiles, resolve  # noqa: E402
from vllmstack.config.vllm_args import build_serve_argv  # noqa: E402
from vllmstack.core.paths import Project  # noqa: E402
from vllmstack.core.runner import SubprocessRunner  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--create", action="store_true", help="also time a fresh env")
    opts = parser.parse_args()
    project = Project(ROOT)
    environ = dict(os.environ)
    runner = SubprocessRunner()
    default = resolve(project, environ=environ)
    version = default.get("VLLM_VERSION") or ""

    if opts.create:
        with tempfile.TemporaryDirectory() as tmp:
            scratch = Project(Path(tmp))
            start = time.monotonic()
            vp.ensure_parser_env(scratch, runner, version,
                                 environ={**environ, "PIP_NO_CACHE_DIR": "1"})
            print(f"create env (vLLM {version}, no pip cache): "
                  f"{time.monotonic() - start:.1f} s")

    start = time.monotonic()
    vp.ensure_parser_env(project, runner, version, environ=environ)
    print(f"ensure env (present or created): {time.monotonic() - start:.1f} s")

    argv = build_serve_argv(default).argv
    single = []
    for _ in range(opts.runs):
        start = time.monotonic()
        findings = vp.parse_argv(project, runner, argv, version, resolved=default,
                                 environ=environ)
        single.append(time.monotonic() - start)
    errors = sum(f.severity == "error" for f in findings)
    print(f"warm single argv ({default.profile} on {default.platform}): median "
          f"{statistics.median(single):.1f} s over {opts.runs} (min {min(single):.1f}, "
          f"max {max(single):.1f}); {errors} error(s)")

    pairs = [(info.name, platform) for info in list_profiles(project)
             if info.kind == "model" for platform in info.platforms]
    resolved = [resolve(project, platform=p, model=m, environ=environ) for m, p in pairs]
    start = time.monotonic()
    results = vp.parse_argvs(project, runner, [build_serve_argv(r).argv for r in resolved],
                             version, resolved=resolved, environ=environ)
    took = time.monotonic() - start
    errors = sum(f.severity == "error" for found in results for f in found)
    print(f"warm batch of {len(pairs)} argvs (every shipped profile x platform): {took:.1f} s "
          f"({took / len(pairs):.2f} s per argv); {errors} error(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
