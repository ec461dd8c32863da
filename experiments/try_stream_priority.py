"""Experiment: does speculation overlap selection better when the streams have priorities?

PRR's attention stage forks speculation over P onto a side stream while the main stream
selects A. At batch 1 the speculation kernel (per-block states, up to a thousand programs)
can fill every SM before selection's few programs are scheduled, so selection waits behind
it instead of beside it. CUDA graphs keep each captured kernel's stream priority (PyTorch
instantiates with cudaGraphInstantiateFlagUseNodePriority), so capturing on a high-priority
stream with the speculation on a low-priority one lets the block scheduler hand free SMs to
selection first. This times, per layer, over NL caches of the Llama-3.1-8B shape (random bf16):
serial DSA, select alone, speculate alone, select ∥ speculate alone (no repair / merge), and
the PRR stage, with default and with prioritised streams; PRR's output is checked against
serial DSA's (exact mode) in both.

    python experiments/try_stream_priority.py --out DIR
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

from prr.runtime.graph_budget import controlled_predictions, graph_median_us  # noqa: E402
from prr.runtime.graph_decode import GraphDecoder, StaticPlan  # noqa: E402

LAYERS = 4


def graph_us(fn, stream: torch.cuda.Stream, repeats: int = 20) -> float:
    """Median µs of one replay of fn() captured on `stream` (its priority goes into the graph)."""
    return graph_median_us([fn], repeats, stream=stream)


def fixed_prediction_engine(model, batch: int, context: int, block: int,
                            topk_tokens: int) -> tuple[GraphDecoder, StaticPlan, list[torch.Tensor]]:
    """A Quest PRR engine with P set from outside (predictor="fixed", |P| = |A|, no dense
    layers) over `context` random tokens, and LAYERS random post-RoPE queries [B, Hq, D]."""
    k_blocks = topk_tokens // block
    plan = StaticPlan(variant="prr", selector="quest", topk_blocks=k_blocks, predicted_blocks=k_blocks,
                      predictor="fixed", block_size=block, dense_layers=(), sink_blocks=1, recent_blocks=1)
    eng = GraphDecoder(model, plan, batch=batch, max_tokens=context + HEADROOM)
    eng.fill_random_context(context, seed=1)
    gen = torch.Generator(device="cuda").manual_seed(2)
    qs = [torch.randn(batch, eng.hq, eng.d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
    return eng, plan, qs


def rows_for(batch: int, context: int, block: int, topk_tokens: int, model, streams) -> list[dict]:
    eng, plan, qs = fixed_prediction_engine(model, batch, context, block, topk_tokens)
    positions = eng.step_positions()
    lengths, nb_t = positions
    num_blocks = context // block + 1
    default_side = eng.side

    def stage(variant: str):
        view = eng.with_plan(variant=variant)  # (a view takes the engine's side stream as it is now)

        def fn():
            return [view.attention(i, qs[i], None, None, positions, appended=True) for i in range(LAYERS)]
        return fn

    outs_serial = [o.clone() for o in stage("serial")()]
    selections = [eng.last_selection[i] for i in range(LAYERS)]

    def select_only():  # A of the engine's selector over `lengths` tokens per row
        for i in range(LAYERS):
            eng.select(i, qs[i], lengths)

    def spec_only():
        for i in range(LAYERS):
            eng.attend(i, qs[i], eng.pred_idx[i], eng.pred_cnt[i], lengths, per_block=True)

    def overlap_only():  # select ∥ speculate, joined; nothing after
        for i in range(LAYERS):
            eng.speculate_beside_selection(i, qs[i], lengths, nb_t)

    rows = []
    for hit in (1.0, 0.9):
        hgen = torch.Generator().manual_seed(int(hit * 1000))
        for i in range(LAYERS):
            eng.set_predictions(i, *controlled_predictions(selections[i], hit, num_blocks, hgen))
        row = dict(batch=batch, context=context, block=block, topk_tokens=topk_tokens, hit_rate=hit)
        for name, (main, side) in streams.items():
            eng.side = side if side is not None else default_side
            outs = stage("prr")()
            torch.cuda.synchronize()
            err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(outs, outs_serial, strict=True))
            row[f"max_abs_diff_prr_vs_serial_{name}"] = err
            row[f"serial_{name}"] = graph_us(stage("serial"), main) / LAYERS
            row[f"select_{name}"] = graph_us(select_only, main) / LAYERS
            row[f"speculate_{name}"] = graph_us(spec_only, main) / LAYERS
            row[f"overlap_{name}"] = graph_us(overlap_only, main) / LAYERS
            row[f"prr_{name}"] = graph_us(stage("prr"), main) / LAYERS
        eng.side = default_side
        rows.append(row)
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    # Lower is higher priority (0 is the default and the lowest).
    streams = {
        "default": (torch.cuda.Stream(), None),  # as GraphDecoder and graph_median_us do now
        "prio": (torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=0)),
    }
    model = model_of(LAYERS)
    rows = []
    for batch, context, block, k in ((1, 131072, 64, 8192), (1, 32768, 64, 8192), (1, 131072, 64, 2048),
                                     (1, 131072, 16, 8192), (8, 32768, 64, 8192), (8, 131072, 64, 8192)):
        rows.extend(rows_for(batch, context - HEADROOM, block, k, model, streams))
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "try_stream_priority.json").write_text(json.dumps(
        {"command": "python " + " ".join(sys.argv), "environment": environment(),
         "priorities": {n: [m.priority, s.priority if s is not None else None] for n, (m, s) in streams.items()},
         "rows": rows}, indent=1))
    import pandas as pd
    df = pd.DataFrame(rows)
    cols = ["batch", "context", "block", "topk_tokens", "hit_rate"] + [
        f"{v}_{n}" for n in streams for v in ("serial", "select", "speculate", "overlap", "prr")]
    print(df[cols].round(1).to_string(index=False))


if __name__ == "__main__":
    main()
