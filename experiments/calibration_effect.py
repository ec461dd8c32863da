"""What EMA's calibration on the prefill tail buys: the hit rate of the study's `ema`
(predictor.calibrate=true, opt-in since issue 53) against `ema_fixed` (predictor.calibrate=false,
the default since: α, β, γ = 0.8, 1, 1) on the same prompts,
from experiments/predictor_study.py's per-prompt results (no new decode).

    python experiments/calibration_effect.py \\
        --runs qwen-16K=experiments/results/cpu/issue34/predictor_study_qwen_16384_20prompts_per_prompt.csv \\
               smollm2-4K=experiments/results/cpu/predictor_study_smollm2_4096_calibration_store.csv.gz \\
        --out experiments/results/cpu/calibration_effect

Each input is a study's `_per_prompt.csv` (a hit rate per prompt) or its results store
(`_store.csv.gz`: hits and |A| per step and layer, pooled here within each prompt). Per run and
|P| / K: both predictors' mean hit rate over prompts with its 95% bootstrap interval over prompts,
the paired difference (mean of the per-prompt differences, 95% bootstrap over prompts) and on how
many prompts calibration was ahead. Writes <out>.csv, <out>.md and <out>.json (with the command).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import pandas as pd

from prr.bench_args import markdown
from prr.intervals import bootstrap_mean
from prr.paths import strict_json_dumps, write_text_atomic

ROOT = Path(__file__).resolve().parents[1]
PAIR = ("ema_fixed", "ema")  # (without calibration, with it)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, metavar="LABEL=PATH",
                   help="a predictor study's _per_prompt.csv or _store.csv.gz holding ema and ema_fixed")
    p.add_argument("--out", default=str(ROOT / "experiments" / "results" / "cpu" / "calibration_effect"))
    args = p.parse_args(argv)
    for run in args.runs:
        if "=" not in run:
            p.error(f"--runs {run!r}: expected LABEL=PATH")
    return args


def per_prompt(path: Path) -> pd.DataFrame:
    """-> one row per (task, sample, predictor, ratio) with its hit rate, for the two predictors."""
    frame = pd.read_csv(path)
    if "hits" in frame.columns:  # a results store: pool each prompt's steps and layers
        g = frame.groupby(["task", "sample", "predictor", "ratio"])
        frame = (g["hits"].sum() / g["selected"].sum()).rename("hit_rate").reset_index()
    missing = set(PAIR) - set(frame["predictor"])
    if missing:
        raise SystemExit(f"{path}: no rows of {sorted(missing)} (run the study with --predictors {' '.join(PAIR)})")
    return frame[frame["predictor"].isin(PAIR)]


def effect(label: str, frame: pd.DataFrame) -> list[dict]:
    rows = []
    for ratio, group in frame.groupby("ratio"):
        wide = group.pivot_table(index=["task", "sample"], columns="predictor", values="hit_rate").dropna()
        without, with_ = wide[PAIR[0]].tolist(), wide[PAIR[1]].tolist()
        diff = (wide[PAIR[1]] - wide[PAIR[0]]).tolist()
        rows.append({"run": label, "ratio": ratio, "prompts": len(wide),
                     **bootstrap_mean(without).as_dict("uncalibrated"), **bootstrap_mean(with_).as_dict("calibrated"),
                     **bootstrap_mean(diff).as_dict("gain"), "prompts_ahead": sum(d > 0 for d in diff),
                     "prompts_behind": sum(d < 0 for d in diff)})
    return rows


def cell(row: dict, name: str, points: bool = False) -> str:
    """name's estimate [95% interval]: a rate, or (points) a difference in percentage points."""
    if points:
        return f"{100 * row[name]:+.1f} [{100 * row[name + '_lo']:+.1f}, {100 * row[name + '_hi']:+.1f}]"
    return f"{row[name]:.3f} [{row[name + '_lo']:.3f}, {row[name + '_hi']:.3f}]"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = []
    for run in args.runs:
        label, path = run.split("=", 1)
        rows += effect(label, per_prompt(Path(path)))
    command = " ".join(["python experiments/calibration_effect.py", *(shlex.quote(a) for a in (argv or sys.argv[1:]))])
    table = markdown(["run", "|P| / K", "n", "uncalibrated (default)", "calibrated (calibrate=true)", "gain, points (paired)",
                      "prompts ahead / behind"],
                     [[r["run"], r["ratio"], r["prompts"], cell(r, "uncalibrated"), cell(r, "calibrated"),
                       cell(r, "gain", points=True), f"{r['prompts_ahead']} / {r['prompts_behind']}"] for r in rows])
    out = Path(args.out)
    write_text_atomic(Path(f"{out}.csv"), pd.DataFrame(rows).assign(command=command).to_csv(index=False))
    write_text_atomic(Path(f"{out}.md"), f"`{command}`\n\n{table}\n")
    write_text_atomic(Path(f"{out}.json"), strict_json_dumps(
        {"command": command, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": rows}, indent=2)
        + "\n")
    print(table)


if __name__ == "__main__":
    main()
