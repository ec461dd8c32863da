"""Experiment: how many splits should PRR's one-launch repair + merge use?

prr_repair.repair_and_merge splits A like serial DSA's attention (S splits per row); each split
also folds ceil(|P| / S) speculative states into its state, and the row's last split merges
the S states. More splits parallelise the repair at low hit rates; fewer make the last merge
shorter and, at batch 1, fit the launch in one wave. The first run (bench_decode_stage.csv at
e31f0d3) had the fused tail 0.83-0.96x the three launches' speed only at batch 8, 8K budget,
block 16 (32 states per split), faster everywhere else. This times, per layer over NL caches
of the Llama-3.1-8B shape (random bf16): serial DSA, PRR with the three launches, and PRR with
the fused tail at several split counts (StaticPlan.repair_tokens_per_split), at 100% and 68%
hit rates; every PRR output is checked against serial DSA's.

    python experiments/try_repair_splits.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from bench_decode import HEADROOM, model_of  # noqa: E402
from bench_kernels import environment  # noqa: E402
from prr.kernels.sparse_decode import _split_plan  # noqa: E402
from try_stream_priority import LAYERS, fixed_prediction_engine, graph_us  # noqa: E402

from prr.runtime.graph_budget import controlled_predictions  # noqa: E402

SPLITS = (None, 64, 32, 16, 8, 4)  # None: serial DSA's split plan
CONFIGS = ((1, 131072, 64, 8192), (1, 32768, 64, 8192), (1, 131072, 16, 8192), (1, 131072, 64, 2048),
           (8, 32768, 16, 8192), (8, 131072, 64, 2048), (8, 131072, 64, 8192))  # (batch, cache, block, top-K)


def rows_for(batch: int, context: int, block: int, topk_tokens: int, model, stream) -> list[dict]:
    eng, plan, qs = fixed_prediction_engine(model, batch, context, block, topk_tokens)
    k_blocks = topk_tokens // block
    positions = eng.step_positions()

    def stage(**changes):
        view = eng.with_plan(**changes)

        def fn():
            return [view.attention(i, qs[i], None, None, positions, appended=True) for i in range(LAYERS)]
        return fn

    outs_serial = [o.clone() for o in stage(variant="serial")()]
    selections = [eng.last_selection[i] for i in range(LAYERS)]
    serial = graph_us(stage(variant="serial"), stream) / LAYERS
    serial_splits = _split_plan(k_blocks, batch * eng.hkv, block, eng.d, 2, None, None, torch.device("cuda"))[2]
    rows = []
    for hit in (1.0, 0.68):
        hgen = torch.Generator().manual_seed(int(hit * 1000))
        for i in range(LAYERS):
            eng.set_predictions(i, *controlled_predictions(selections[i], hit, context // block + 1, hgen))
        # the three-launch tail (repair plan, repair over A \ P, merge), whatever the engine's default
        three = graph_us(stage(fused_repair=False), stream) / LAYERS
        for splits in SPLITS:
            if splits is not None and splits >= serial_splits:
                continue  # the serial plan is timed as None
            tokens = None if splits is None else block * -(-k_blocks // splits)
            outs = stage(fused_repair=True, repair_tokens_per_split=tokens)()
            torch.cuda.synchronize()
            err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(outs, outs_serial, strict=True))
            fused = graph_us(stage(fused_repair=True, repair_tokens_per_split=tokens), stream) / LAYERS
            launched = _split_plan(k_blocks, batch * eng.hkv, block, eng.d, 2, None, tokens, torch.device("cuda"))[2]
            row = dict(batch=batch, context=context, block=block, topk_tokens=topk_tokens, hit_rate=hit,
                       splits=launched, serial_plan=splits is None, states_per_split=-(-k_blocks // launched),
                       serial=serial, prr_three_launches=three, prr_fused=fused,
                       fused_speedup_vs_serial=serial / fused, fused_vs_three=three / fused,
                       max_abs_diff_vs_serial=err)
            rows.append(row)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    stream = torch.cuda.Stream()
    model = model_of(LAYERS)
    rows = []
    for batch, context, block, k in CONFIGS:
        rows.extend(rows_for(batch, context - HEADROOM, block, k, model, stream))
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "try_repair_splits.json").write_text(json.dumps(
        {"command": "python " + " ".join(sys.argv), "environment": environment(), "layers": LAYERS, "rows": rows},
        indent=1))
    import pandas as pd
    cols = ["batch", "context", "block", "topk_tokens", "hit_rate", "splits", "states_per_split", "serial",
            "prr_three_launches", "prr_fused", "fused_speedup_vs_serial"]
    print(pd.DataFrame(rows)[cols].round(2).to_string(index=False))


if __name__ == "__main__":
    main()
