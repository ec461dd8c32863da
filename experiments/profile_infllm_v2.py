"""Where InfLLM-v2's selection spends a decode step's time on a GPU, beside Quest's, per sparse layer.

    python experiments/profile_infllm_v2.py --out experiments/results/h100/profile_infllm_v2
    python experiments/profile_infllm_v2.py --contexts 32768 --batches 1 --layers 4,32 --out /tmp/p

The 8B attention shape (32 query / 8 KV heads, D 128), a bf16 cache of random keys, block 64,
top-K 8 blocks, every layer sparse, each selector as conf/selector/*.yaml builds it, runtime
backend triton. Per (batch, context, layers):
- `select_us`: a CUDA graph of every layer's metadata append + `select` (as the graph engine's
  layer calls them; the graph engine's device lengths and block counts given), median replay,
  divided by the layers. Walking 4 or 32 layers' caches tells whether the stage map's 4-layer
  walk (`bench_decode.py --stage-layers`) profits from L2 residency that a whole run does not get;
- per kernel: the device time of each kernel of that work (torch.profiler over eager calls, so
  the sum is below `select_us` by the launch gaps the graph removes), µs per layer;
- floors: InfLLM-v2's lse pass reads every complete window's compressed key (Hkv·W·D bf16,
  W = (n - 32) / 16 + 1) and writes each query head's logit of it (Hq·W fp32), its pool pass reads
  those logits, its top-K the [Hkv, NB_max] fp32 scores;
  Quest reads its key max and min (2·Hkv·NB·D bf16). Bytes / the run's best bandwidth.
With --sweep, InfLLM-v2's scores alone (`infllm_v2_score`, both passes, no append or top-K) per
lse tiling (tl.dot or FMA chunks x windows per tile x window ranges x warps), over the same
layers' caches (walking them keeps each layer's keys out of L2 as a decode step does), into the
JSON's "sweep" and a second table.
Writes <out>.{md,csv,json}; prints the tables last.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from prr.bench_args import OneLineParser, bench_command, int_list, markdown, write_bench_outputs
from prr.benchmarking import (
    BF16,
    DTYPE,
    HEADROOM,
    HKV,
    HQ,
    D,
    announce_gpu,
    configured,
    graph_bench_record,
    time_graph_us,
)
from prr.cache import PagedKVCache

BLOCK = 64  # InfLLM-v2's selection block (its paper's; the selector refuses any other)
TOPK_BLOCKS = 8
PROFILED_CALLS = 20


def floor_bytes(selector: str, batch: int, context: int, capacity_blocks: int) -> dict[str, int]:
    """Bytes each part must read at least, per layer (module docstring)."""
    if selector == "quest":
        return {"scores": 2 * batch * HKV * (context // BLOCK + 1) * D * BF16,
                "topk": batch * HKV * capacity_blocks * 4}
    windows = (context - 32) // 16 + 1
    logits = batch * HQ * windows * 4  # fp32, one per query head and window: written once, read once
    return {"lse": batch * HKV * windows * D * BF16 + logits, "pool": logits, "topk": batch * HKV * capacity_blocks * 4}


def build(selector_name: str, batch: int, context: int, layers: int):
    """(selector, cache, queries, positions, lengths, num_blocks): a cache of `layers` layers holding
    `context` random tokens per row, the selector's metadata built over them."""
    cache = PagedKVCache(layers, batch, HKV, D, BLOCK, context + HEADROOM, DTYPE, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    for layer in range(layers):
        cache.keys[layer][:, :, :context].normal_(generator=gen)
        cache.values[layer][:, :, :context].normal_(generator=gen)
    selector = configured("selector", selector_name, topk_blocks=TOPK_BLOCKS, dense_layers=[])
    if selector.set_backend("triton") != "triton":
        raise SystemExit(f"selector {selector_name} has no Triton path: {selector.triton_problems()}")
    for layer in range(layers):
        selector.update_metadata(cache, layer, 0, context)
    queries = [torch.randn(batch, HKV, HQ // HKV, D, generator=gen, device="cuda").to(DTYPE) for _ in range(layers)]
    positions = torch.full((batch,), context, dtype=torch.int64, device="cuda")  # the decode token's slot
    lengths = positions + 1
    num_blocks = ((lengths + BLOCK - 1) // BLOCK).to(torch.int32)
    return selector, cache, queries, positions, lengths, num_blocks


def layer_walk(selector, cache, queries, positions, lengths, num_blocks):
    """One decode step's selection work over every layer: the token's metadata append, then A."""
    def walk():
        for layer, q in enumerate(queries):
            selector.append_metadata(cache, layer, positions)
            selector.select(q, cache, layer, lengths, num_blocks)
    return walk


def kernel_times(walk, layers: int) -> dict[str, float]:
    """Device µs per layer of each kernel `walk` launches (averaged over PROFILED_CALLS walks)."""
    walk()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_CALLS):
            walk()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", 0.0)
        if total > 0:
            out[event.key] = total / (PROFILED_CALLS * layers)
    return out


def profile_cell(selector_name: str, batch: int, context: int, layers: int, bandwidth: float) -> dict:
    selector, cache, queries, positions, lengths, num_blocks = build(selector_name, batch, context, layers)
    walk = layer_walk(selector, cache, queries, positions, lengths, num_blocks)
    select_us = time_graph_us(walk) / layers
    kernels = kernel_times(walk, layers)
    floors = floor_bytes(selector_name, batch, context, cache.max_blocks)
    floor_us = sum(floors.values()) / bandwidth * 1e6
    row = {"selector": selector_name, "batch": batch, "context": context, "layers": layers, "select_us": select_us,
           "floor_us": floor_us, "select_over_floor": select_us / floor_us,
           "kernels_us": {name: round(us, 3) for name, us in sorted(kernels.items(), key=lambda kv: -kv[1])},
           **{f"floor_{part}_us": b / bandwidth * 1e6 for part, b in floors.items()}}
    del selector, cache, queries
    torch.cuda.empty_cache()
    return row


SWEEP = [{"dot": dot, "block_w": block_w, "max_splits": splits, "num_warps": warps}
         for dot in (True, False) for block_w in (32, 64) for splits in (64, 256, 1024) for warps in (4, 8)]


def sweep_cell(batch: int, context: int, layers: int) -> list[dict]:
    """InfLLM-v2's scores per lse tiling, µs per layer (module docstring), best first."""
    from prr.kernels.infllm_v2 import infllm_v2_score

    selector, cache, queries, _, lengths, _ = build("infllm_v2", batch, context, layers)
    flat = [q.reshape(batch, HQ, D) for q in queries]
    rows = lengths.to(torch.int32)
    compressed = [selector.compressed(cache, layer) for layer in range(layers)]
    want = infllm_v2_score(flat[0], compressed[0], rows, cache.max_blocks)
    out = []
    for tiling in SWEEP:
        got = infllm_v2_score(flat[0], compressed[0], rows, cache.max_blocks, **tiling)
        same = bool(torch.allclose(got, want, rtol=1e-4, atol=1e-7))

        def scores(tiling=tiling):
            for layer in range(layers):
                infllm_v2_score(flat[layer], compressed[layer], rows, cache.max_blocks, **tiling)
        out.append({"batch": batch, "context": context, "layers": layers, **tiling,
                    "scores_us": time_graph_us(scores) / layers, "equal_default": same})
    torch.cuda.empty_cache()
    return sorted(out, key=lambda r: r["scores_us"])


def report(record: dict) -> str:
    header = ["selector", "batch", "context", "layers", "select µs/layer", "floor µs", "x floor", "kernels (µs/layer)"]
    body = [[r["selector"], r["batch"], r["context"], r["layers"], r["select_us"], r["floor_us"], r["select_over_floor"],
             "; ".join(f"{name[:40]} {us:.1f}" for name, us in list(r["kernels_us"].items())[:5])]
            for r in record["rows"]]
    text = markdown(header, body)
    if record.get("sweep"):
        keys = ["batch", "context", "layers", "dot", "block_w", "max_splits", "num_warps", "scores_us", "equal_default"]
        text += "\n\nInfLLM-v2's scores per lse tiling, µs per layer, best first per cell:\n\n"
        text += markdown(keys, [[r[k] for k in keys] for r in record["sweep"]])
    return text


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int_list, default=[32768 - HEADROOM, 131072 - HEADROOM])
    parser.add_argument("--batches", type=int_list, default=[1, 8])
    parser.add_argument("--layers", type=int_list, default=[4, 32], help="layers' caches the step walks through")
    parser.add_argument("--selectors", default="quest,infllm_v2")
    parser.add_argument("--sweep", action="store_true", help="also time InfLLM-v2's scores per lse tiling")
    parser.add_argument("--out", type=Path, required=True, help="results path without suffix")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the profile times GPU kernels)")
    env, bandwidths, bandwidth = announce_gpu()
    record = graph_bench_record(bench_command("experiments/profile_infllm_v2.py", argv), env, bandwidths,
                                block=BLOCK, topk_blocks=TOPK_BLOCKS)
    for batch in args.batches:
        for context in args.contexts:
            for layers in args.layers:
                for name in args.selectors.split(","):
                    row = profile_cell(name, batch, context, layers, bandwidth)
                    record["rows"].append(row)
                    print(f"{name} b{batch} n{context} L{layers}: {row['select_us']:.1f} µs/layer "
                          f"({row['select_over_floor']:.2f}x floor) {list(row['kernels_us'].items())[:4]}", flush=True)
                    write_bench_outputs(record, args.out, report)
            if args.sweep:
                record.setdefault("sweep", []).extend(sweep_cell(batch, context, max(args.layers)))
                print(f"sweep b{batch} n{context}: best {record['sweep'][-len(SWEEP)]}", flush=True)
                write_bench_outputs(record, args.out, report)
    print(write_bench_outputs(record, args.out, report))


if __name__ == "__main__":
    main()
