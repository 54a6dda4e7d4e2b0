"""How long from the engine container's death to `invoke up` exiting with the diagnosis.

Runs the engine simulator image with an injected boot crash (and a crash loop) through the real
`invoke up` on the local Docker engine, several times, and prints the delay between Docker's `die`
event for the container and the moment `invoke up` exits. Target: under 5 s (the earlier stack
polled /health for up to 600 s).

    python benchmarks/bench_crash_detection.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from helpers import copy_project, docker_ready, free_port, write_dotenv  # noqa: E402

IMAGE = "vllmstack/engine-sim:latest"


def make_project(base: Path, name: str) -> Path:
    root = copy_project(base / "stack")
    write_dotenv(root, {"COMPOSE_PROJECT": name, "VLLM_PORT": str(free_port()),
                        "OTHER_ENGINE_PORTS": ""})
    return root


def one_run(root: Path, home: Path, name: str, fault: str) -> tuple[float, int]:
    """(seconds from the first `die` event to `invoke up` exiting, exit code of up)."""
    events = subprocess.Popen(
        ["docker", "events", "--filter", "event=die", "--filter",
         f"label=com.docker.compose.project={name}", "--format", "{{.TimeNano}}"],
        stdout=subprocess.PIPE, text=True)
    env = {**os.environ, "HOME": str(home)}
    try:
        up = subprocess.run(
            [sys.executable, "-m", "invoke", "up", "--platform", "cpu", "--model", "qwen3-0.6b",
             "--set", f"VLLM_IMAGE={IMAGE}", "--no-dashboard", "--set",
             f"ENGINE_ENV=SIM_FAULT={fault} SIM_BOOT_SECONDS=1"],
            cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False)
        exited = time.time_ns()
    finally:
        time.sleep(0.5)
        events.terminate()
        out, _ = events.communicate(timeout=10)
    deaths = sorted(int(t) for t in out.split() if t.strip().isdigit())
    subprocess.run([sys.executable, "-m", "invoke", "down", "--timeout", "5"], cwd=root, env=env,
                   capture_output=True, timeout=120, check=False)
    if not deaths:
        raise RuntimeError("no die event seen:\n" + up.stdout + up.stderr)
    return (exited - deaths[0]) / 1e9, up.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if not docker_ready(IMAGE):
        print(f"needs a running Docker engine and the {IMAGE} image (scripts/test-env.sh)",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        name = f"vstbench{os.getpid()}"
        root = make_project(base, name)
        home = base / "home"
        home.mkdir()
        print(f"{'fault':<14} {'runs':>4} {'median s':>9} {'max s':>7}  (death -> `invoke up` exit)")
        worst = 0.0
        for fault in ("crash-at-boot", "crash-loop"):
            delays = []
            for _ in range(args.runs):
                delay, code = one_run(root, home, name, fault)
                if code == 0:
                    raise RuntimeError(f"{fault}: invoke up succeeded?")
                delays.append(delay)
            worst = max(worst, max(delays))
            print(f"{fault:<14} {len(delays):>4} {statistics.median(delays):>9.2f} {max(delays):>7.2f}")
        print(f"target < 5 s: {'met' if worst < 5 else 'MISSED'} (worst {worst:.2f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
