"""A compact LESS state, chosen by measured output error (issue 33, item 3).

    python experiments/less_compact_state.py [--out experiments/results/cpu/less_compact_state]
        [--runs-dir multirun/less_compact_state] [--steps 16] [--features 64,32,16] [--feature-map trained]

On the default model (SmolLM2-135M, CPU) in shadow mode (attention stays dense, so every variant
is measured on identical inputs), Quest and LESS at top-K 512 tokens (32 blocks of 16), LESS with
m random features in {64, 32, 16} and block summaries in float32 or bfloat16: each run's output
relative error against dense attention and mass recall on every decode step. Beside each, the
memory its state takes at the Llama-3.1-8B shape (32 layers, dense layers 0-1, 8 KV heads, head
128, bf16 KV cache, batch 1) at 32K and 128K, blocks 16 and 64, as a multiple of the KV cache's.

Writes OUT.csv (one row per variant) and OUT.json (command, device, versions, date, rows); prints
the table last. Re-running skips finished runs (prr's resume rule).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import pandas as pd
import torch
from hydra import compose, initialize_config_dir

from prr.paths import strict_json_dumps
from prr.runner import run
from prr.selectors import LessSelector

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("mean_output_relerr", "mean_mass_recall", "decode_steps", "prompt_tokens")
SHAPES = [(c, bs) for c in (32768, 131072) for bs in (16, 64)]  # (context, block) of the 8B-shape memory columns


def memory_ratio(num_features: int, summary_dtype: str, context: int, block: int) -> float:
    """LESS's state over 30 sparse layers / the KV cache of 32 layers, 8B shape, bf16 cache, batch 1."""
    sel = LessSelector(topk_blocks=1, num_features=num_features, summary_dtype=summary_dtype, force_newest=False,
                       sink_blocks=0)
    state = 30 * sel.state_bytes(1, 8, 128, -(-context // block), torch.bfloat16)
    return state / (2 * 32 * 8 * context * 128 * 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/cpu/less_compact_state")
    parser.add_argument("--runs-dir", type=Path, default=Path("multirun/less_compact_state"))
    parser.add_argument("--steps", type=int, default=16, help="decode steps per run (dense metrics on each)")
    parser.add_argument("--features", default="64,32,16", help="LESS random-feature counts m")
    parser.add_argument("--extra", default="", help="comma-separated overrides for every run (e.g. task.prompt_tokens=2048)")
    parser.add_argument("--feature-map", default="random", choices=["random", "trained"],
                        help="LESS's selector.feature_map (trained: `make train-less`'s map at each m, an error if missing)")
    args = parser.parse_args()
    variants = [("quest", None, None)] + [("less", int(m), dtype) for m in args.features.split(",")
                                          for dtype in ("float32", "bfloat16")]
    common = ["selector.topk_blocks=32", "runtime.block_size=16", "runtime.mode=shadow", "predictor=none",
              "logger=none", f"task.max_new_tokens={args.steps}", "task.stop_at_eos=false",
              "runtime.dense_metrics_every=1", *[x for x in args.extra.split(",") if x]]
    rows = []
    for selector, m, dtype in variants:
        overrides = [f"selector={selector}", *common]
        name = selector
        if m is not None:
            overrides += [f"selector.num_features={m}", f"selector.summary_dtype={dtype}",
                          f"selector.feature_map={args.feature_map}"]
            name = f"less-m{m}-{dtype}" + ("-trained" if args.feature_map == "trained" else "")
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        summary = run(cfg, args.runs_dir / name)
        row = {"variant": name, "num_features": m, "summary_dtype": dtype,
               "feature_map": args.feature_map if m is not None else None, **{c: summary.get(c) for c in COLUMNS}}
        for context, block in SHAPES:
            row[f"state_over_kv_{context // 1024}k_b{block}"] = (memory_ratio(m, dtype, context, block)
                                                                  if m is not None else 0.0)
        rows.append(row)
        print(f"{name}: output relerr {row['mean_output_relerr']:.6g}", flush=True)
    frame = pd.DataFrame(rows)
    quest = frame.loc[frame.variant == "quest", "mean_output_relerr"].iloc[0]
    frame["relerr_over_quest"] = frame.mean_output_relerr / quest
    command = "python " + " ".join(sys.argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    frame.assign(command=command).to_csv(args.out.with_suffix(".csv"), index=False)
    record = {"command": command, "device": f"cpu {platform.machine()}, {torch.get_num_threads()} threads",
              "torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "model": "smollm2-135m", "mode": "shadow", "topk_tokens": 512,
              "rows": frame.astype(object).where(frame.notna(), None).to_dict("records")}  # (Quest's m: null, not NaN)
    args.out.with_suffix(".json").write_text(strict_json_dumps(record, indent=1) + "\n")
    print(frame.to_string(index=False, float_format=lambda x: f"{x:.6g}"))


if __name__ == "__main__":
    main()
