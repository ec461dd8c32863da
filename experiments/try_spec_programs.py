"""Experiment: does speculation overlap selection better when it launches fewer programs?

At batch 1 select ∥ speculate took 28.4 µs against 14.8 (select) and 17.6 (speculate) alone at
128K, block 64, 8K budget (try_stream_priority.json): the per-block speculation launches about
4 programs per SM (512 at batch 1), so it holds every SM while selection's score (~128
programs) and top-k (8 programs) wait for room. With StaticPlan.speculation_tokens_per_program
the speculation covers more of P per program, so fewer programs leave SMs free for selection;
each program then walks more blocks one after another, so speculation alone gets slower. This
times, per layer over NL caches of the Llama-3.1-8B shape (random bf16, P = the true A, i.e.
100% hit): serial DSA, select alone, and for each program size speculate alone, select ∥
speculate (nothing after) and the PRR stage, on default streams and with selection's stream at
high priority; PRR's output is checked against serial DSA's (exact mode) every time.

    python experiments/try_spec_programs.py --out DIR
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
from try_stream_priority import LAYERS, fixed_prediction_engine, graph_us  # noqa: E402

TOKENS_PER_PROGRAM = (None, 256, 512, 1024, 2048)  # None: the kernel's default (~4 programs per SM)
CONFIGS = ((1, 131072, 64, 8192), (1, 32768, 64, 8192), (1, 131072, 16, 8192), (1, 131072, 64, 2048),
           (8, 131072, 64, 2048), (8, 32768, 64, 8192))  # (batch, cache tokens, block, top-K tokens)


def spec_programs(batch: int, block: int, topk_tokens: int, tokens: int | None) -> int:
    """Programs the per-block speculation launches."""
    from prr.kernels.sparse_decode import per_block_entries
    rows, capacity = batch * 8, topk_tokens // block
    return -(-capacity // per_block_entries(capacity, rows, block, "cuda", tokens)) * rows


def rows_for(batch: int, context: int, block: int, topk_tokens: int, model, streams) -> list[dict]:
    eng, plan, qs = fixed_prediction_engine(model, batch, context, block, topk_tokens)
    positions = eng.step_positions()
    lengths, nb_t = positions
    default_side = eng.side

    def stage(variant: str, tokens: int | None = None):
        view = eng.with_plan(variant=variant, speculation_tokens_per_program=tokens)

        def fn():
            return [view.attention(i, qs[i], None, None, positions, appended=True) for i in range(LAYERS)]
        return fn

    outs_serial = [o.clone() for o in stage("serial")()]
    for i in range(LAYERS):  # P = A: 100% hit
        eng.set_predictions(i, *eng.last_selection[i])

    def select_only():  # A of the engine's selector over `lengths` tokens per row
        for i in range(LAYERS):
            eng.select(i, qs[i], lengths)

    def spec_only(tokens):
        view = eng.with_plan(speculation_tokens_per_program=tokens)

        def fn():
            for i in range(LAYERS):
                view.attend(i, qs[i], eng.pred_idx[i], eng.pred_cnt[i], lengths, per_block=True)
        return fn

    def overlap_only(tokens):  # select ∥ speculate, joined; nothing after
        view = eng.with_plan(speculation_tokens_per_program=tokens)

        def fn():
            for i in range(LAYERS):
                view.speculate_beside_selection(i, qs[i], lengths, nb_t)
        return fn

    rows = []
    for name, (main, side) in streams.items():
        eng.side = side if side is not None else default_side
        serial = graph_us(stage("serial"), main) / LAYERS
        select = graph_us(select_only, main) / LAYERS
        for tokens in TOKENS_PER_PROGRAM:
            if tokens is not None and tokens % block:
                continue
            outs = stage("prr", tokens)()
            torch.cuda.synchronize()
            err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(outs, outs_serial, strict=True))
            row = dict(batch=batch, context=context, block=block, topk_tokens=topk_tokens, streams=name,
                       tokens_per_program=tokens or 0, programs=spec_programs(batch, block, topk_tokens, tokens),
                       serial=serial, select=select,
                       speculate=graph_us(spec_only(tokens), main) / LAYERS,
                       overlap=graph_us(overlap_only(tokens), main) / LAYERS,
                       prr=graph_us(stage("prr", tokens), main) / LAYERS,
                       max_abs_diff_prr_vs_serial=err)
            row["prr_speedup"] = row["serial"] / row["prr"]
            row["overlap_vs_longer"] = row["overlap"] / max(row["select"], row["speculate"])
            rows.append(row)
            print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    eng.side = default_side
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    streams = {  # lower is higher priority (0 is the default and the lowest)
        "default": (torch.cuda.Stream(), None),
        "prio": (torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=0)),
    }
    model = model_of(LAYERS)
    rows = []
    for batch, context, block, k in CONFIGS:
        rows.extend(rows_for(batch, context - HEADROOM, block, k, model, streams))
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "try_spec_programs.json").write_text(json.dumps(
        {"command": "python " + " ".join(sys.argv), "environment": environment(), "layers": LAYERS,
         "hit_rate": 1.0, "rows": rows}, indent=1))
    import pandas as pd
    df = pd.DataFrame(rows)
    cols = ["batch", "context", "block", "topk_tokens", "streams", "tokens_per_program", "programs", "serial",
            "select", "speculate", "overlap", "prr", "prr_speedup"]
    print(df[cols].round(2).to_string(index=False))


if __name__ == "__main__":
    main()
