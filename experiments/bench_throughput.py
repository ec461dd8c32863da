"""Batched decode throughput: dense attention, serial DSA and PRR, uniform and ragged batches.

    python experiments/bench_throughput.py [--quick] [--repeats 20] [--out experiments/results/h200/bench_throughput]

Model: the Llama-3.1-8B shape (32 layers, 32 query / 8 KV heads, head_dim 128) with random bf16
weights and random KV contexts, through the graph engine (prr.runtime.graph_decode), Quest with a
top-K of 2048 tokens in blocks of 16, layers 0 and 1 dense, cuBLAS projections. Every row has its
own context length (`GraphDecoder.fill_random_context` with one length per row; each row's Quest
metadata is built from its own tokens only), so a batch may be ragged.

Cells: 32K tokens per row at batch 1, 8, 16, 32, 64; 128K at batch 1, 2, 4, 8; mixed rows, half
8K and half 64K, at batch 2, 8, 16. A cell whose KV cache (allocated at the longest row for every
row) does not fit in free memory gets a row saying so.

Per cell, variant: one decode step of every row, replayed in a CUDA graph at fixed positions
(median of `--repeats` replays): dense (every block), serial DSA (select, then attend A) and PRR
with P set from outside to hold 90% of serial DSA's A (|P| = |A|). Tokens/s = batch / step time.
Floor: the bytes a step must read — the weights once (less the embedding rows it does not read),
and per row: in dense layers its whole KV, in sparse layers its Quest metadata and K blocks of KV
(dense attention: every layer's whole KV) — over the best bandwidth measured in the same run.

Writes OUT.json (command, GPU, driver, versions, date, rows) and OUT.csv; prints a table last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from prr.benchmarking import (
    BF16,
    HEADROOM,
    configured,
    copy_bandwidth,
    decode_step_bytes,
    environment,
    model_of,
    read_bandwidth,
    time_graph_us,
)
from prr.blocks import controlled_predictions
from prr.model.decoder import Decoder
from prr.paths import strict_json_dumps
from prr.runtime.graph_decode import GraphDecoder, StaticPlan

ROOT = Path(__file__).resolve().parents[1]
BLOCK, TOPK_TOKENS, DENSE_LAYERS, HIT_RATE = 16, 2048, (0, 1), 0.9
K32, K128, K8, K64 = 32768, 131072, 8192, 65536


def cells(quick: bool) -> list[tuple[str, list[int]]]:
    """(kind, cache tokens per row) of every cell; a row's context is its cache less HEADROOM."""
    out = [("uniform", [K32] * b) for b in (1, 8, 16, 32, 64)]
    out += [("uniform", [K128] * b) for b in (1, 2, 4, 8)]
    out += [("mixed", [K8] * (b // 2) + [K64] * (b // 2)) for b in (2, 8, 16)]
    return [out[0], out[-1]] if quick else out


def cache_bytes(model: Decoder, batch: int, tokens: int) -> int:
    """The engine's KV cache: K and V of every layer, [B, Hkv, tokens, D] bf16."""
    c = model.config
    return 2 * c.num_layers * batch * c.num_kv_heads * tokens * c.head_dim * BF16


def set_controlled_predictions(eng: GraphDecoder, contexts: list[int], gen: torch.Generator) -> None:
    """P of every sparse layer = HIT_RATE of serial DSA's A at this step, the rest drawn from
    blocks of each row's own context."""
    eng.with_plan(variant="serial").step(advance=False)
    torch.cuda.synchronize()
    for layer, selection in enumerate(list(eng.last_selection)):
        if selection is None:
            continue
        idx, cnt = selection
        rows = [controlled_predictions((idx[b : b + 1], cnt[b : b + 1]), HIT_RATE, n // BLOCK + 1, gen)
                for b, n in enumerate(contexts)]
        eng.set_predictions(layer, torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows]))


def cell_rows(model: Decoder, kind: str, tokens: list[int], bandwidth: float, repeats: int) -> list[dict]:
    """Every variant of one cell (or one row saying why it was skipped)."""
    batch, capacity = len(tokens), max(tokens)
    contexts = [n - HEADROOM for n in tokens]
    common = dict(kind=kind, batch=batch, contexts="/".join(sorted({str(n) for n in contexts})),
                  mean_context=sum(contexts) / batch, block=BLOCK, topk_tokens=TOPK_TOKENS)
    need = cache_bytes(model, batch, capacity)
    free = torch.cuda.mem_get_info()[0]
    if need * 1.05 + (4 << 30) > free:
        return [dict(common, variant="skipped", note=f"KV cache {need / 2**30:.0f} GiB does not fit "
                                                     f"({free / 2**30:.0f} GiB free)")]
    k_blocks = TOPK_TOKENS // BLOCK
    quest = configured("selector", "quest", topk_blocks=k_blocks, dense_layers=list(DENSE_LAYERS))
    plan = StaticPlan(variant="prr", predicted_blocks=k_blocks, block_size=BLOCK)
    eng = GraphDecoder(model, plan, batch=batch, max_tokens=capacity, selector=quest, predictor=None)  # P set below
    eng.fill_random_context(contexts if kind == "mixed" else contexts[0], seed=1)
    set_controlled_predictions(eng, contexts, torch.Generator().manual_seed(900))
    rows = []
    for variant in ("dense", "serial", "prr"):
        view = eng.with_plan(variant=variant)
        start = eng.pos.clone()
        us = time_graph_us(lambda v=view: v.step(advance=False), repeats=repeats)
        eng.pos.copy_(start)
        floor_us = decode_step_bytes(model.config, contexts, variant != "dense", block=BLOCK, topk_tokens=TOPK_TOKENS,
                                     dense_layers=len(DENSE_LAYERS)) / bandwidth * 1e6
        rows.append(dict(common, variant=variant, hit_rate=HIT_RATE if variant == "prr" else None,
                         step_us=us, token_latency_ms=us / 1e3, tokens_per_s=batch / (us * 1e-6),
                         floor_us=floor_us, over_floor=us / floor_us))
    serial = next(r["step_us"] for r in rows if r["variant"] == "serial")
    for r in rows:
        r["over_serial"] = r["step_us"] / serial
    del eng, view
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two cells only (smoke run)")
    parser.add_argument("--repeats", type=int, default=20, help="CUDA-graph replays timed per variant")
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/h200/bench_throughput")
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error(f"--repeats={args.repeats}: at least 3 (the median of the replays is reported)")
    if not torch.cuda.is_available():
        sys.exit("bench_throughput.py times CUDA graphs: it needs a CUDA GPU (none is visible)")
    env = environment()
    bw = copy_bandwidth() | read_bandwidth()
    bandwidth = max(bw.values())
    results = {"command": "python " + " ".join(sys.argv), "environment": env, "bandwidth": bw, "rows": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    model = model_of(32)
    for kind, tokens in cells(args.quick):
        rows = cell_rows(model, kind, tokens, bandwidth, args.repeats)
        results["rows"].extend(rows)
        args.out.with_suffix(".json").write_text(strict_json_dumps(results, indent=1))  # kept if a later cell fails
        print(f"{kind} B={len(tokens)} tokens={sorted(set(tokens))}: " + ", ".join(
            f"{r['variant']} {r.get('token_latency_ms', float('nan')):.2f} ms" for r in rows), flush=True)
    import pandas as pd

    df = pd.DataFrame(results["rows"]).assign(command=results["command"])
    df.to_csv(args.out.with_suffix(".csv"), index=False)
    cols = [c for c in ("kind", "batch", "contexts", "variant", "token_latency_ms", "tokens_per_s", "over_floor",
                        "over_serial", "note") if c in df]
    print(df[cols].round(3).to_string(index=False))


if __name__ == "__main__":
    main()
