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
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "vllmstack/engine-sim:latest"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_project(base: Path, name: str) -> Path:
    root = base / "stack"
    root.mkdir()
    for folder in ("env", "chat-templates", "fp8_configs", "fused_moe_configs", "patches"):
        if (ROOT / folder).is_dir():
            shutil.copytree(ROOT / folder, root / folder)
    for file in ("compose.yaml", "tasks.py"):
        shutil.copy(ROOT / file, root / file)
    lines = [line for line in (ROOT / ".env.example").read_text().splitlines()
             if not line.startswith("VLLM_PORT=")]
    (root / ".env").write_text("\n".join(lines) + f"\nCOMPOSE_PROJECT={name}\nVLLM_PORT={free_port()}\n"
                               "OTHER_ENGINE_PORTS=\n")
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
