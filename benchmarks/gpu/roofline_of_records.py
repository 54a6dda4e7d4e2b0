"""% of the roofline for bench records measured before the column existed.

Usage: python benchmarks/gpu/roofline_of_records.py MODELS_DIR DEVICE RUN_DIR [RUN_DIR ...]

Each RUN_DIR holds a run's bench_c1.json and the dotenv.txt it ran with (as the H200 run scripts
pack them). The profile is resolved from that dotenv with /tmp/models replaced by MODELS_DIR (the
same dummy-model config.json files, made by shared/gpu/make_dummy_models.py, so the weight size is
the dummy's own) and GPU_DEVICE_NAME=DEVICE, and every row is set against vllmstack.bench.report.roofline
exactly as `invoke bench` does it now.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from vllmstack.bench.client.row import rows_of
from vllmstack.bench.report import roofline
from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project


def main(models: str, device: str, runs: list[str]) -> None:
    project = Project.find(Path(__file__).resolve().parent)
    print("| run | profile | platform | pp | tg | tg t/s | decode limit t/s | % | pp t/s "
          "| prefill limit t/s | % |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for run in map(Path, runs):
        settings = dict(line.split("=", 1) for line in (run / "dotenv.txt").read_text().splitlines()
                        if "=" in line and not line.startswith("#"))
        overrides = [f"{k}={v.replace('/tmp/models', models)}" for k, v in settings.items()
                     if k not in ("PLATFORM", "MODEL_PROFILE")] + [f"GPU_DEVICE_NAME={device}"]
        resolved = resolve(project, platform=settings["PLATFORM"], model=settings["MODEL_PROFILE"],
                           overrides=overrides, environ={"HOME": os.environ.get("HOME", "/")})
        inputs = roofline.inputs_from_profile(resolved, {"HOME": "/nonexistent"})
        record = json.loads((run / "bench_c1.json").read_text())
        for row, typed in zip(record["results"], rows_of(record, str(run)), strict=True):
            shares = roofline.row_roofline(typed, inputs)
            roof = shares.to_json() if shares else {}
            tg = row.get("tg_tps", {}).get("mean")
            pp = (row.get("pp_tps") or {}).get("mean")
            print(f"| {run.name} | {settings['MODEL_PROFILE']} | {settings['PLATFORM']} | {row['pp']} | "
                  f"{row['tg']} | {tg:.1f} | {roof.get('decode_limit_tps', '-')} | "
                  f"{roof.get('decode_pct', '-')} | {f'{pp:.0f}' if pp else row.get('pp_note', '-')} | "
                  f"{roof.get('prefill_limit_tps', '-')} | {roof.get('prefill_pct', '-')} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
