"""Selector fidelity on the default model: every selector at top-K budgets of 256, 512,
1024 and 2048 tokens, in shadow mode (attention stays dense, so all selectors are measured
on identical inputs), with the EMA predictor at |P| = K.

    python experiments/selector_fidelity.py [--out experiments/results/cpu/selector_fidelity]
                                            [--steps 32] [--runs-dir multirun/selector_fidelity]
                                            [--selectors quest,less-trained] [--budgets 512,1024]

`less-trained` is LESS with the map of `make train-less` (run it first). A retrained map does
not change the run's config, so a finished less-trained run would be skipped: after
retraining, use a fresh --runs-dir.

Writes OUT.csv (one row per selector x budget: attention-mass recall, output relative
error against dense, last-step overlap, EMA hit rate), OUT_per_layer.csv (the same per
layer) and OUT.json (command, device, versions, date, rows). Each run is an ordinary run
directory under --runs-dir; re-running skips finished ones (prr's resume rule).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import pandas as pd
import torch
from hydra import compose, initialize_config_dir

from prr.paths import strict_json_dumps
from prr.runner import run

ROOT = Path(__file__).resolve().parents[1]

# Row name -> selector overrides. less-trained needs `make train-less` first (else a clear error).
SELECTORS = {"quest": ["selector=quest"], "infllm": ["selector=infllm"], "infllm_prr": ["selector=infllm_prr"],
             "less": ["selector=less"],
             "less-trained": ["selector=less", "selector.feature_map=trained"], "exact": ["selector=exact"]}
BUDGET_TOKENS = (256, 512, 1024, 2048)
COLUMNS = ("mean_mass_recall", "mean_output_relerr", "last_step_overlap", "hit_rate", "hit_rate_at_k",
           "mean_selected_blocks")


def trained_map_record() -> dict:
    """The default model's trained LESS map: file, sha256 and the training's own record."""
    import hashlib

    from safetensors import safe_open

    from prr.selectors.less_training import feature_map_file

    path = feature_map_file("smollm2-135m", 64)
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("meta", "{}"))
    return {"file": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "meta": meta}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/cpu/selector_fidelity")
    parser.add_argument("--runs-dir", type=Path, default=Path("multirun/selector_fidelity"))
    parser.add_argument("--steps", type=int, default=32, help="decode steps per run")
    parser.add_argument("--selectors", default=",".join(SELECTORS), help=f"comma-separated subset of {list(SELECTORS)}")
    parser.add_argument("--budgets", default=",".join(map(str, BUDGET_TOKENS)), help="top-K budgets in tokens")
    args = parser.parse_args()
    selectors = [x for x in args.selectors.split(",") if x]
    unknown = [x for x in selectors if x not in SELECTORS]
    if unknown:
        parser.error(f"--selectors: {unknown} not among {list(SELECTORS)}")
    budgets = [int(x) for x in args.budgets.split(",") if x]
    rows, layer_rows = [], []
    for selector in selectors:
        for budget in budgets:
            overrides = [*SELECTORS[selector], f"selector.topk_blocks={budget // 16}", "runtime.block_size=16",
                         "runtime.mode=shadow", "predictor=ema", "budget=fixed", "budget.ratio=1.0", "logger=none",
                         f"task.max_new_tokens={args.steps}", "task.stop_at_eos=false"]
            with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
                cfg = compose(config_name="config", overrides=overrides)
            run_dir = args.runs_dir / f"{selector}-{budget}"
            summary = run(cfg, run_dir)
            rows.append({"selector": selector, "budget_tokens": budget, **{c: summary.get(c) for c in COLUMNS},
                         "prompt_tokens": summary["prompt_tokens"], "decode_steps": summary["decode_steps"]})
            layers = pd.read_csv(run_dir / "layers.csv")
            layers.insert(0, "budget_tokens", budget)
            layers.insert(0, "selector", selector)
            layer_rows.append(layers)
    command = "python " + " ".join(sys.argv)
    frame = pd.DataFrame(rows)
    frame.insert(0, "command", command)
    per_layer = pd.concat(layer_rows, ignore_index=True)
    per_layer.insert(0, "command", command)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out.with_suffix(".csv"), index=False)
    per_layer.to_csv(args.out.parent / f"{args.out.name}_per_layer.csv", index=False)
    record = {"command": command, "device": f"cpu {platform.machine()}, {torch.get_num_threads()} threads",
              "torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "model": "smollm2-135m", "mode": "shadow", "rows": rows}
    if "less-trained" in selectors:  # which trained map the less-trained rows used (make train-less)
        record["less_trained_map"] = trained_map_record()
    args.out.with_suffix(".json").write_text(strict_json_dumps(record, indent=1) + "\n")
    print(frame.drop(columns=["command"]).to_string(index=False, float_format=lambda x: f"{x:.3f}"))


if __name__ == "__main__":
    main()
