"""Collect one or more Hydra sweeps (or run dirs) into committed results files, through the
results store (prr/results_store.py).

    python experiments/collect_sweep.py SWEEP_DIR [SWEEP_DIR ...] OUT_STEM [--command "python run.py -m ..."]
                                        [--per-layer] [--steps COLUMN ...]

writes
  OUT_STEM.csv            one row per run: run, status, the config options (selector, predictor, ...),
                          the config values that differ between runs, the headline numbers
  OUT_STEM_per_layer.csv  (--per-layer) one row per run x layer: layers.csv with the same keys
  OUT_STEM_steps.csv      (--steps) one row per run x step x layer x KV head: the named columns
  OUT_STEM.json           the command, what it swept, device, versions, date, and the rows of OUT_STEM.csv
                          (strict JSON: a NaN is written as null)
Runs whose summary is not `complete` are listed with their status, never dropped silently.
The command defaults to the one the runs ran (each job's .hydra/overrides.yaml; multirun.yaml,
which a later relaunch rewrites, only where no job left one); OUT_STEM.json also lists the runs'
git commits, package versions, machines and inputs (weights' and prompt file's sha256: their
provenance.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import pandas as pd
import yaml

from prr.paths import strict_json_dumps
from prr.results_store import GROUPS, load_layers, load_runs, load_steps

ROOT = Path(__file__).resolve().parents[1]

HEADLINE = ("hit_rate", "hit_rate_at_k", "precision", "last_step_overlap", "mean_mass_recall", "mean_output_relerr",
            "mean_selected_blocks", "mean_predicted_blocks", "mean_misses", "mean_waste", "t_predict_us",
            "t_select_us", "t_speculate_us", "t_repair_us", "t_merge_us", "t_attention_measured_us",
            "t_attention_overlapped_us", "token_latency_median_ms", "tokens_per_s", "decode_steps", "prompt_tokens",
            "topk_blocks", "block_size", "device", "calibration.alpha", "calibration.stickiness", "calibration.recency")


def varying_config(runs: pd.DataFrame) -> list[str]:
    """Config columns (<group>.<key>) whose value differs between runs: what the sweep swept."""
    config_cols = [c for c in runs.columns if c.split(".")[0] in GROUPS and "." in c and not c.endswith("._target_")]
    return [c for c in config_cols if runs[c].astype(str).nunique() > 1]


def job_overrides(sweep: Path) -> dict[str, list[str]] | None:
    """Each override key of the runs in `sweep` (a sweep or a run dir) with the values its jobs
    had, in job order, from each job's `.hydra/overrides.yaml` (prr writes it only for a job that
    ran; never rewritten by a relaunch that was refused or skipped). None where no job left one."""
    jobs = sorted((d for d in sweep.iterdir() if (d / ".hydra" / "overrides.yaml").is_file()),
                  key=lambda d: (not d.name.isdigit(), int(d.name) if d.name.isdigit() else 0, d.name)) \
        if sweep.is_dir() else []
    if (sweep / ".hydra" / "overrides.yaml").is_file():  # a single run's dir
        jobs = [sweep]
    if not jobs:
        return None
    values: dict[str, list[str]] = {}
    for job in jobs:
        for line in yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()) or []:
            key, _, value = str(line).partition("=")
            if value not in values.setdefault(key, []):
                values[key].append(value)
    return values


def recorded_command(sweeps: list[Path]) -> str | None:
    """`python run.py -m <overrides>` as the runs ran (job_overrides). A sweep dir's multirun.yaml
    is the last relaunch's command, which may not be what its runs used (issue 36), so it is
    read only where no job left its overrides. None where neither exists."""
    commands = []
    for sweep in sweeps:
        values = job_overrides(sweep)
        if values is not None:
            flag = "-m " if any(len(v) > 1 for v in values.values()) else ""
            commands.append(f"python run.py {flag}" + " ".join(f"{k}={','.join(v)}" for k, v in values.items()))
            continue
        saved = sweep / "multirun.yaml"
        if not saved.is_file():
            return None
        overrides = (yaml.safe_load(saved.read_text()).get("hydra", {}).get("overrides", {}) or {}).get("task", [])
        commands.append(" ".join(["python run.py -m", *overrides]))
    return " && ".join(commands)


def swept_keys(sweeps: list[Path], runs: pd.DataFrame) -> list[str]:
    """What the sweep swept: each override that took more than one value in the runs' records
    (a group, `predictor`, or a key, `budget.ratio`); where a sweep left no records, the groups
    whose option differs between runs and the config values that differ within one option."""
    recorded = [job_overrides(sweep) for sweep in sweeps]
    if all(r is not None for r in recorded):
        merged: dict[str, set[str]] = {}
        for values in recorded:
            for key, options in (values or {}).items():
                merged.setdefault(key.lstrip("+~"), set()).update(options)
        return [key for key, options in merged.items() if len(options) > 1]
    groups = [g for g in GROUPS if g in runs.columns and runs[g].astype(str).nunique() > 1]
    return groups + [c for c in varying_config(runs) if c.split(".")[0] not in groups]


def run_commits(sweeps: list[Path]) -> list[dict]:
    """Each run's provenance.json (git commit, dirty flag, versions, machine, inputs), distinct, in job order."""
    seen: list[dict] = []
    for sweep in sweeps:
        for record in sorted(sweep.rglob("provenance.json")):
            found = json.loads(record.read_text())
            entry = {k: found.get(k) for k in ("git", "versions", "machine", "inputs")}
            if entry not in seen:
                seen.append(entry)
    return seen


def keys(frame: pd.DataFrame, swept: list[str], varying_only: bool = False) -> list[str]:
    """Identifying columns; varying_only keeps only options that differ between runs (long tables)."""
    groups = [g for g in GROUPS if not varying_only or frame[g].astype(str).nunique() > 1]
    return ["run", *([] if varying_only else ["status"]), *groups, *[c for c in swept if c in frame.columns]]


def with_run_name(frame: pd.DataFrame, sweeps: list[Path]) -> pd.DataFrame:
    """A short `run` column instead of absolute paths: the job dir within its sweep ("3"), prefixed
    with the sweep's name when several sweeps are collected ("locality/3")."""
    def name(run_dir: str) -> str:
        for sweep in sweeps:
            base = sweep.resolve()
            if Path(run_dir) == base or base in Path(run_dir).parents:
                rel = str(Path(run_dir).relative_to(base.parent if len(sweeps) > 1 or Path(run_dir) == base else base))
                return rel
        return run_dir
    return frame.assign(run=[name(d) for d in frame["run_dir"]]).drop(columns=["run_dir", "sweep"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", type=Path, nargs="+", help="sweep or run directories, then OUT_STEM")
    parser.add_argument("--command", help="the command that produced the runs (default: from the runs' records)")
    parser.add_argument("--per-layer", action="store_true", help="also write OUT_STEM_per_layer.csv")
    parser.add_argument("--steps", nargs="+", metavar="COLUMN", help="also write OUT_STEM_steps.csv with these columns")
    args = parser.parse_args()
    if len(args.paths) < 2:
        parser.error("give at least one sweep directory and OUT_STEM")
    *sweeps, out_stem = args.paths
    command = args.command or recorded_command(sweeps)
    if command is None:
        parser.error(f"no job overrides or multirun.yaml in {[str(s) for s in sweeps]} to read the command from; "
                     "pass --command")

    runs = load_runs(*sweeps)
    swept = varying_config(runs)  # the table's key columns: every config value that differs
    runs = with_run_name(runs, sweeps)
    headline = [c for c in HEADLINE if c in runs.columns]
    table = runs[keys(runs, swept) + [c for c in headline if c not in swept]].assign(command=command)

    out_stem.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(out_stem.with_suffix(".csv"), index=False)
    written = [out_stem.with_suffix(".csv")]
    if args.per_layer:
        layers = with_run_name(load_layers(*sweeps), sweeps)
        config_cols = {c for c in layers.columns if "." in c and c.split(".")[0] in GROUPS}
        layer_keys = keys(layers, swept, varying_only=True)
        layer_cols = [c for c in layers.columns if c not in config_cols and c not in keys(layers, swept)]
        path = out_stem.parent / f"{out_stem.name}_per_layer.csv"
        layers[layer_keys + layer_cols].assign(command=command).to_csv(path, index=False)  # provenance in every row
        written.append(path)
    if args.steps:
        steps = with_run_name(load_steps(*sweeps, columns=args.steps), sweeps)
        index = [c for c in ("step", "layer", "batch", "kv_head") if c in steps.columns]
        path = out_stem.parent / f"{out_stem.name}_steps.csv"
        steps[keys(steps, swept, varying_only=True) + index + args.steps].assign(command=command).to_csv(
            path, index=False, float_format="%.4g")
        written.append(path)

    import torch

    provenance = {
        "command": command,
        "collected_with": " ".join(["python", *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "swept": swept_keys(sweeps, runs),
        "runs_provenance": run_commits(sweeps),
        "rows": table.drop(columns=["command"]).to_dict(orient="records"),
    }
    out_stem.with_suffix(".json").write_text(strict_json_dumps(provenance, indent=1, default=str) + "\n")
    written.append(out_stem.with_suffix(".json"))
    shown = table.drop(columns=["command", *[g for g in GROUPS if table[g].nunique() <= 1]])
    print(shown.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    print("wrote " + ", ".join(map(str, written)))


if __name__ == "__main__":
    main()
