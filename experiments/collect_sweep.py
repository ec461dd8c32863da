"""Collect the summary.json files of a Hydra multirun into one CSV plus a provenance JSON.

    python experiments/collect_sweep.py MULTIRUN_DIR OUT_STEM --command "python run.py -m ..."

writes OUT_STEM.csv (one row per finished run: its overrides and headline numbers) and
OUT_STEM.json (the command, device, versions, date, and the same rows). Runs whose
summary is not `complete` are listed as such, never dropped silently.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import pandas as pd

COLUMNS = ("hit_rate", "hit_rate_at_k", "precision", "last_step_overlap", "mean_mass_recall", "mean_output_relerr",
           "mean_selected_blocks", "mean_predicted_blocks", "t_select_us", "t_speculate_us", "t_repair_us",
           "token_latency_median_ms", "decode_steps", "prompt_tokens")


def collect(multirun: Path) -> pd.DataFrame:
    rows = []
    for summary_path in sorted(multirun.glob("*/summary.json"), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0):
        summary = json.loads(summary_path.read_text())
        overrides_file = summary_path.parent / ".hydra" / "overrides.yaml"
        overrides = overrides_file.read_text().strip().replace("\n- ", " ").lstrip("- ") if overrides_file.exists() else ""
        row = {"run": summary_path.parent.name, "overrides": overrides, "status": summary.get("status")}
        row.update({c: summary.get(c) for c in COLUMNS})
        calibration = summary.get("calibration") or {}
        row.update({f"ema_{k}": calibration.get(k) for k in ("alpha", "stickiness", "recency")})
        rows.append(row)
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("multirun", type=Path)
    parser.add_argument("out_stem", type=Path)
    parser.add_argument("--command", required=True, help="the exact command that produced the sweep")
    args = parser.parse_args()
    frame = collect(args.multirun)
    if frame.empty:
        sys.exit(f"no summary.json under {args.multirun}")
    frame["command"] = args.command  # every results file says how it was produced
    import torch

    args.out_stem.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out_stem.with_suffix(".csv"), index=False)
    provenance = {
        "command": args.command,
        "collected_with": " ".join(["python", *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"cpu {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "rows": frame.to_dict(orient="records"),
    }
    args.out_stem.with_suffix(".json").write_text(json.dumps(provenance, indent=1, default=str) + "\n")
    print(frame.drop(columns=["overrides"]).to_string(index=False))


if __name__ == "__main__":
    main()
