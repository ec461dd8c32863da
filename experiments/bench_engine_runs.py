"""Whole runs of run.py on the GPU through the engine, against serial DSA in the same session.

Each case is `python run.py runtime=cuda ...` in its own process (its own run directory under
--runs), on the Llama-3.1-8B shape with random bf16 weights and a random prompt; the per-token
latency is the device time of each step's CUDA-graph replay (the run's own summary.json).

  --cases acceptance: serial DSA (predictor=none) and the README's main command
      (selector=quest predictor=ema budget=profiled), each with dense-reference metrics off
      (only the first step measured) and on every 16th step: the main command's median and
      mean per-token latency as a ratio to serial DSA's.
  --cases matrix: every selector x {none, last_step, ema} at budget=fixed (|P| = top-K).

Writes <out>.json (every summary's numbers, the commands, GPU, versions, date) and <out>.csv,
and prints a table last.
  usage (on the GPU): PYTHONPATH=$PWD python3 experiments/bench_engine_runs.py --cases acceptance --out $OUT/engine_acceptance
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

SELECTORS = ("dense", "exact", "quest", "infllm", "less")
OFF = "runtime.dense_metrics_every=1000000"  # the first step only
EVERY_16 = "runtime.dense_metrics_every=16"


def cases(kind: str) -> dict[str, list[str]]:
    if kind == "acceptance":
        main = ["selector=quest", "predictor=ema", "budget=profiled"]
        return {"serial": ["selector=quest", "predictor=none", OFF], "main": [*main, OFF],
                "serial_dense16": ["selector=quest", "predictor=none", EVERY_16], "main_dense16": [*main, EVERY_16]}
    if kind == "matrix":
        out = {}
        for selector in SELECTORS:
            for predictor in ("none", "last_step", "ema"):
                out[f"{selector}-{predictor}"] = [f"selector={selector}", f"predictor={predictor}", OFF]
        return out
    raise SystemExit(f"--cases {kind!r} is not one of ['acceptance', 'matrix']")


def serial_of(case: str) -> str:
    """The serial-DSA case a case is compared with (main -> serial, quest-ema -> quest-none)."""
    return case.rsplit("-", 1)[0] + "-none" if "-" in case else case.replace("main", "serial")


def run_case(name: str, overrides: list[str], args: argparse.Namespace) -> dict:
    run_dir = Path(args.runs) / name
    command = [sys.executable, "run.py", "runtime=cuda", "model=llama-3.1-8b-shape", "logger=none",
               f"task.prompt_tokens={args.prompt_tokens}", f"task.max_new_tokens={args.steps}", "task.stop_at_eos=false",
               *overrides, f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - start
    row = {"case": name, "command": " ".join(command[1:]), "rc": proc.returncode, "wall_s": round(wall, 1)}
    summary_path = run_dir / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        row["error"] = (proc.stderr or proc.stdout)[-2000:]
        print(f"{name}: FAILED rc={proc.returncode}\n{row['error']}", file=sys.stderr)
        return row
    summary = json.loads(summary_path.read_text())
    keep = ("engine", "variant", "device", "torch", "prompt_tokens", "topk_blocks", "predicted_blocks", "decode_steps",
            "token_latency_median_ms", "token_latency_mean_ms", "token_latency_p90_ms", "hit_rate", "precision",
            "last_step_overlap", "mean_mass_recall", "mean_output_relerr", "budget_setup")
    row.update({k: summary.get(k) for k in keep})
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="acceptance")
    p.add_argument("--prompt-tokens", type=int, default=32000)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--timeout", type=int, default=240, help="seconds per run")
    p.add_argument("--runs", default="/tmp/prr_engine_runs", help="parent of the runs' directories")
    p.add_argument("--out", required=True, help="results path without suffix (.json, .csv)")
    args = p.parse_args()
    rows = []
    for name, overrides in cases(args.cases).items():
        rows.append(run_case(name, overrides, args))
        write(rows, args)  # after every case: a cut session keeps what ran
    table = write(rows, args)
    shown = [c for c in ("case", "variant", "predicted_blocks", "token_latency_median_ms", "token_latency_mean_ms",
                         "median_over_serial", "mean_over_serial", "hit_rate", "mean_mass_recall") if c in table]
    print(table[shown].to_string(index=False, float_format=lambda x: f"{x:.3f}"))


def write(rows: list[dict], args: argparse.Namespace) -> pd.DataFrame:
    """The table with ratios to serial DSA -> <out>.json and <out>.csv."""
    import torch
    import triton

    table = pd.DataFrame(rows)
    by_case = table.set_index("case")
    for col in ("token_latency_median_ms", "token_latency_mean_ms"):
        if col in table:  # each case against serial DSA at the same setting, timed in this session
            base = table["case"].map(serial_of).map(by_case[col])
            table[col.replace("token_latency_", "").replace("_ms", "") + "_over_serial"] = table[col] / base
    meta = {"command": "python " + " ".join(sys.argv), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "driver": torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None,
            "torch": torch.__version__, "triton": triton.__version__, "rows": table.to_dict("records")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(meta, indent=1, default=str))
    table.drop(columns=["budget_setup", "error"], errors="ignore").to_csv(args.out + ".csv", index=False)
    return table


if __name__ == "__main__":
    main()
