"""Where one decode token's GPU time goes: a kernel-by-kernel profile of the graph engine.

    python experiments/profile_decode.py [--variant serial] [--context 131072] [--batch 1] [--pdl]
        [--projections torch|fused] [--fuse-merge off|on|one_wave] [--out DIR]

Llama-3.1-8B shape, random bf16 weights and KV (as bench_decode). Runs a few eager steps under
torch.profiler and sums each kernel's device time per step (device durations do not include
launch gaps, so the sum is below the step's wall time; the gap is printed too). Writes
DIR/profile_decode_{variant}_{selector}_{batch}x{context}_bs{block}_k{topk}[_pdl][_fused][_fusemerge].csv and
prints the table. --pdl launches prr's kernels with programmatic dependent launch (kernels/pdl.py);
--projections fused uses prr.kernels.dense_gemv for the projections (StaticPlan.projections).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from prr.benchmarking import HEADROOM, configured, model_of, time_graph_us
from prr.runtime.graph_decode import GraphDecoder, StaticPlan

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="serial", choices=("dense", "serial", "prr"))
    parser.add_argument("--selector", default="quest", choices=("quest", "infllm"))
    parser.add_argument("--context", type=int, default=131072, help="cache capacity (context = this - 256)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--topk-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--pdl", action="store_true", help="programmatic dependent launch (sets PRR_PDL=1)")
    parser.add_argument("--projections", default="torch", choices=("torch", "fused"))
    parser.add_argument("--fuse-merge", default="one_wave", choices=("off", "on", "one_wave"),
                        help="splits merged inside the split kernel (StaticPlan.fuse_merge: False, True, 'one_wave' "
                             "the engine's default); the file name says which (off: no suffix, as before one_wave existed)")
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/h200")
    args = parser.parse_args()
    if args.pdl:
        os.environ["PRR_PDL"] = "1"  # read at each launch (kernels/pdl.py)
    args.pdl = os.environ.get("PRR_PDL", "0") == "1"  # PRR_PDL=1 from outside counts too (file name)
    import pandas as pd
    from torch.profiler import ProfilerActivity, profile

    model = model_of(32)
    k = args.topk_tokens // args.block
    # conf/selector's, layers 0 and 1 dense, the sink block and the newest forced (infllm: no local window)
    selector = configured("selector", args.selector, topk_blocks=k, dense_layers=[0, 1], local_blocks=0)
    plan = StaticPlan(variant=args.variant, predicted_blocks=k, block_size=args.block,
                      fuse_merge={"off": False, "on": True, "one_wave": "one_wave"}[args.fuse_merge],
                      projections=args.projections)
    eng = GraphDecoder(model, plan, batch=args.batch, max_tokens=args.context, compile=True, selector=selector,
                       predictor=None)  # prr: P set from outside, below
    eng.fill_random_context(args.context - HEADROOM, seed=1)
    if args.variant == "prr":  # P = last step's A: a 100% hit rate at a fixed position
        eng.with_plan(variant="serial").step(advance=False)
        for i, s in enumerate(eng.last_selection):
            if s is not None:
                eng.set_predictions(i, *s)
    for _ in range(3):
        eng.step(advance=False)
    graph_us = time_graph_us(lambda: eng.step(advance=False), repeats=20)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            eng.step(advance=False)
        torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        if e.device_type.name != "CUDA" or e.self_device_time_total <= 0:
            continue
        rows[e.key] = {"kernel": e.key[:90], "calls_per_step": e.count / args.steps,
                       "us_per_step": e.self_device_time_total / args.steps}
    frame = pd.DataFrame(rows.values()).sort_values("us_per_step", ascending=False)
    frame["share"] = frame["us_per_step"] / frame["us_per_step"].sum()
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"profile_decode_{args.variant}_{args.selector}_{args.batch}x{args.context}_bs{args.block}_k{args.topk_tokens}" + ("_pdl" if args.pdl else "") \
        + ("_fused" if args.projections == "fused" else "") + {"off": "", "on": "_fusemerge", "one_wave": "_fusemerge_one_wave"}[args.fuse_merge]
    frame.insert(0, "command", "python " + " ".join(sys.argv))
    frame["graph_replay_us_per_step"] = graph_us  # the whole step replayed as a CUDA graph (gaps included)
    frame.to_csv(args.out / f"{name}.csv", index=False)
    total = frame["us_per_step"].sum()
    print(frame.drop(columns="command").head(25).to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    print(f"{name}: kernels {total:.0f} µs/step (device time), graph replay {graph_us:.0f} µs/step, "
          f"{int(frame['calls_per_step'].sum())} launches/step")


if __name__ == "__main__":
    main()
