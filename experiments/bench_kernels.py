"""Benchmark of prr's Triton kernels on one GPU against their byte floors and torch baselines.

    python experiments/bench_kernels.py [--quick] [--only selection|decode_tuning|select_latency]
        [--out experiments/results/h200/bench_kernels]

For every shape (Llama-3.1-8B attention: 32 query / 8 KV heads, head_dim 128, bf16; batch
1 and 8; contexts 32K/64K/128K; block sizes 16 and 64; top-K budgets 1K/2K/4K/8K tokens):
checks each kernel against a float32 torch reference on the same inputs, then times it.

Method: every op is captured R times over R *different* input
sets in one CUDA graph (so launch overhead is excluded and inputs larger than L2 are not
served from cache), the graph is replayed, and the time per op is the median replay time
/ R. The floor is bytes moved / copy bandwidth measured in the same run (bytes read +
written by a device-to-device copy of 1 GiB). Baselines measured the same way in the same
run: torch gather + scaled_dot_product_attention over the selected tokens, dense
scaled_dot_product_attention over the whole context, torch Quest scoring, torch.topk.
Writes OUT.json (command, GPU, driver, versions, date, every row) and OUT.csv; prints a
short table last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from prr.benchmarking import (
    DTYPE,
    HKV,
    HQ,
    D,
    copy_bandwidth,
    decode_inputs,
    environment,
    graph_time_us,
    randn,
    rel_err,
)
from prr.paths import strict_json_dumps

ROOT = Path(__file__).resolve().parents[1]


def bench_sparse_decode(batch: int, context: int, block: int, budget: int, sets: int, gen: torch.Generator,
                        bw: float) -> dict:
    from prr.kernels.sparse_decode import sparse_decode

    k = budget // block
    caches, qs, ids, counts, lengths, scale = decode_inputs(batch, context, block, budget, sets, gen)
    tokens = [(i.long().unsqueeze(-1) * block + torch.arange(block, device="cuda")).flatten(2) for i in ids]  # [B,Hkv,budget]

    def gather(i):
        k_cache, v_cache = caches[i]
        index = tokens[i].unsqueeze(-1).expand(-1, -1, -1, D)
        return torch.gather(k_cache, 2, index), torch.gather(v_cache, 2, index)

    # Check against float32 on the first input set.
    k_sel, v_sel = gather(0)
    ref = F.scaled_dot_product_attention(qs[0].float().unsqueeze(2), k_sel.float(), v_sel.float(), scale=scale,
                                         enable_gqa=True).squeeze(2)
    out, _ = sparse_decode(qs[0], *caches[0], ids[0], counts, lengths, block, scale)
    err = rel_err(out, ref)
    out_pb, lse_pb = sparse_decode(qs[0], *caches[0], ids[0], counts, lengths, block, scale, per_block=True)
    merged = (torch.softmax(lse_pb, -1).unsqueeze(-1) * out_pb).sum(-2)
    err_pb = rel_err(merged, ref)

    t_kernel = graph_time_us(lambda i: (lambda: sparse_decode(qs[i], *caches[i], ids[i], counts, lengths, block, scale)), sets)
    t_per_block = graph_time_us(lambda i: (lambda: sparse_decode(qs[i], *caches[i], ids[i], counts, lengths, block, scale,
                                                                 per_block=True)), sets)

    def torch_sparse(i):
        def fn():
            k_s, v_s = gather(i)
            F.scaled_dot_product_attention(qs[i].unsqueeze(2), k_s, v_s, scale=scale, enable_gqa=True)
        return fn

    t_torch = graph_time_us(torch_sparse, sets)
    t_dense = graph_time_us(lambda i: (lambda: F.scaled_dot_product_attention(
        qs[i].unsqueeze(2), caches[i][0], caches[i][1], scale=scale, enable_gqa=True)), sets)
    kv_bytes = 2 * batch * HKV * budget * D * 2
    io_bytes = batch * HQ * D * 2 + batch * HQ * (D + 1) * 4 + batch * HKV * k * 4
    nbytes = kv_bytes + io_bytes
    floor_us = nbytes / bw * 1e6
    return {
        "op": "sparse_decode", "batch": batch, "context": context, "block_size": block, "budget_tokens": budget,
        "rel_err": err, "rel_err_per_block_merged": err_pb, "bytes": nbytes, "floor_us": floor_us,
        "kernel_us": t_kernel, "kernel_per_block_us": t_per_block, "torch_gather_sdpa_us": t_torch,
        "dense_sdpa_us": t_dense, "GBps": nbytes / (t_kernel * 1e-6) / 1e9, "x_floor": t_kernel / floor_us,
        "speedup_vs_torch_sparse": t_torch / t_kernel, "speedup_vs_dense": t_dense / t_kernel,
    }


def tune_sparse_decode(batch: int, context: int, block: int, budget: int, sets: int, gen: torch.Generator) -> dict:
    """Split-kernel launch shapes (tokens per K/V tile, warps, tokens per split) at one shape:
    each config's time and its output's distance from the default config's."""
    from prr.kernels.sparse_decode import sparse_decode

    caches, qs, ids, counts, lengths, scale = decode_inputs(batch, context, block, budget, sets, gen)
    ref, _ = sparse_decode(qs[0], *caches[0], ids[0], counts, lengths, block, scale)
    row = {"op": "sparse_decode tuning", "batch": batch, "context": context, "block_size": block,
           "budget_tokens": budget, "kernel_us": graph_time_us(lambda i: (lambda: sparse_decode(
               qs[i], *caches[i], ids[i], counts, lengths, block, scale)), sets)}
    worst = 0.0
    for tile in (16, 32, 64, 128):
        for warps in (4, 8):
            for tps in (None, 64, 256, 512):
                kw = dict(tile_tokens=tile, num_warps=warps, tokens_per_split=tps)
                out, _ = sparse_decode(qs[0], *caches[0], ids[0], counts, lengths, block, scale, **kw)
                worst = max(worst, rel_err(out, ref))
                row[f"us_tile{tile}_warps{warps}_split{tps or 'auto'}"] = graph_time_us(
                    lambda i, kw=kw: (lambda: sparse_decode(qs[i], *caches[i], ids[i], counts, lengths, block, scale,
                                                            **kw)), sets)
    # The split merge inside the split kernel (last split of a row merges; no merge launch).
    out, _ = sparse_decode(qs[0], *caches[0], ids[0], counts, lengths, block, scale, fuse_merge=True)
    worst = max(worst, rel_err(out, ref))
    arrivals = torch.zeros(batch * HKV, dtype=torch.int32, device="cuda")
    row["us_default_fused_merge"] = graph_time_us(lambda i: (lambda: sparse_decode(
        qs[i], *caches[i], ids[i], counts, lengths, block, scale, fuse_merge=True, arrivals=arrivals)), sets)
    configs = {c: v for c, v in row.items() if c.startswith("us_")}
    best = min(configs, key=configs.get)
    return {**row, "best_config": best, "best_us": configs[best], "rel_err": worst}


def bench_merge(sets: int, gen: torch.Generator) -> dict:
    from prr.kernels.sparse_decode import merge_partials

    n = 512  # partial states per (batch, head): an 8K budget in blocks of 16
    outs = [randn(1, HQ, n, D, dtype=torch.float32) for _ in range(sets)]
    lses = [randn(1, HQ, n, dtype=torch.float32) for _ in range(sets)]
    keeps = [(torch.rand(1, HQ, n, generator=gen) < 0.9).cuda() for _ in range(sets)]
    out, lse = merge_partials(outs[0], lses[0], keeps[0])
    masked = lses[0].masked_fill(~keeps[0], float("-inf"))
    ref = (torch.softmax(masked, -1).unsqueeze(-1) * outs[0]).sum(-2)
    t = graph_time_us(lambda i: (lambda: merge_partials(outs[i], lses[i], keeps[i])), sets)
    nbytes = HQ * n * (D + 1) * 4 + HQ * n + HQ * (D + 1) * 4
    return {"op": "merge", "partials": n, "rel_err": rel_err(out, ref), "bytes": nbytes, "kernel_us": t}


def bench_selection(batch: int, context: int, block: int, sets: int, gen: torch.Generator, bw: float) -> list[dict]:
    from prr.kernels.quest import quest_score
    from prr.kernels.topk import topk_select

    nb = context // block
    k = max(1, 2048 // block)  # a 2K-token budget
    metas = []
    for _ in range(sets):
        a, b = randn(batch, HKV, nb, D, dtype=torch.float32), randn(batch, HKV, nb, D, dtype=torch.float32)
        metas.append((torch.maximum(a, b), torch.minimum(a, b)))
    qs = [randn(batch, HQ, D) for _ in range(sets)]
    num_blocks = torch.full((batch,), nb, dtype=torch.int32, device="cuda")

    def torch_score(i):
        key_max, key_min = metas[i]
        q = qs[i].float().view(batch, HKV, HQ // HKV, 1, D)
        return torch.maximum(q * key_max.unsqueeze(2), q * key_min.unsqueeze(2)).sum(-1).amax(2)

    ref = torch_score(0)
    scores = quest_score(qs[0], *metas[0], num_blocks, gqa_reduce="max")
    score_err = rel_err(scores, ref)
    t_score = graph_time_us(lambda i: (lambda: quest_score(qs[i], *metas[i], num_blocks, gqa_reduce="max")), sets)
    t_torch_score = graph_time_us(lambda i: (lambda: torch_score(i)), sets)
    score_bytes = 2 * batch * HKV * nb * D * 4 + batch * HQ * D * 2 + batch * HKV * nb * 4
    score_floor = score_bytes / bw * 1e6

    score_sets = [randn(batch, HKV, nb, dtype=torch.float32) for _ in range(sets)]
    idx, cnt = topk_select(score_sets[0], k, num_blocks, sink_blocks=1, recent_blocks=1)
    forced = score_sets[0].clone()
    forced[..., 0] = float("inf")
    forced[..., nb - 1] = float("inf")
    ref_sets = torch.topk(forced, k, dim=-1).indices.sort(-1).values
    got = idx[..., :k].long().sort(-1).values
    topk_ok = bool(torch.equal(got, ref_sets)) and bool((cnt == k).all())
    t_topk = graph_time_us(lambda i: (lambda: topk_select(score_sets[i], k, num_blocks, sink_blocks=1, recent_blocks=1)), sets)
    t_torch_topk = graph_time_us(lambda i: (lambda: torch.topk(score_sets[i], k, dim=-1)), sets)
    t_select = graph_time_us(lambda i: (lambda: topk_select(quest_score(qs[i], *metas[i], num_blocks), k, num_blocks,
                                                            sink_blocks=1, recent_blocks=1)), sets)
    t_torch_select = graph_time_us(lambda i: (lambda: torch.topk(torch_score(i), k, dim=-1)), sets)
    from prr.kernels.quest import quest_select

    arrivals = torch.zeros(batch * HKV, dtype=torch.int32, device="cuda")
    t_fused = graph_time_us(lambda i: (lambda: quest_select(qs[i], *metas[i], num_blocks, k, sink_blocks=1,
                                                            recent_blocks=1, arrivals=arrivals)), sets)
    _, fused_idx, fused_cnt = quest_select(qs[0], *metas[0], num_blocks, k, sink_blocks=1, recent_blocks=1,
                                           arrivals=arrivals)
    ref_idx, _ = topk_select(quest_score(qs[0], *metas[0], num_blocks), k, num_blocks, sink_blocks=1, recent_blocks=1)
    fused_ok = bool(torch.equal(fused_idx.long().sort(-1).values, ref_idx.long().sort(-1).values))
    # Metadata in the cache dtype (bf16: exact for bf16 keys, half the bytes; tensor-core
    # scores): what the graph engine runs.
    metas16 = [(a.to(DTYPE), b.to(DTYPE)) for a, b in metas]
    score16_bytes = score_bytes // 2 + batch * HQ * D + batch * HKV * nb * 2
    t_score16 = graph_time_us(lambda i: (lambda: quest_score(qs[i], *metas16[i], num_blocks, gqa_reduce="max")), sets)
    t_fused16 = graph_time_us(lambda i: (lambda: quest_select(qs[i], *metas16[i], num_blocks, k, sink_blocks=1,
                                                              recent_blocks=1, arrivals=arrivals)), sets)
    t_select16 = graph_time_us(lambda i: (lambda: topk_select(quest_score(qs[i], *metas16[i], num_blocks), k, num_blocks,
                                                              sink_blocks=1, recent_blocks=1)), sets)
    _, idx16, cnt16 = quest_select(qs[0], *metas16[0], num_blocks, k, sink_blocks=1, recent_blocks=1,
                                   arrivals=arrivals)
    ref16, _ = topk_select(quest_score(qs[0], *metas16[0], num_blocks), k, num_blocks, sink_blocks=1, recent_blocks=1,
                           radix_bits=1)
    fused16_ok = bool(torch.equal(idx16, ref16))
    variants = {}
    for radix_bits in (1, 2):
        for warps in (4, 8, 16):
            variants[f"topk_us_radix{radix_bits}_warps{warps}"] = graph_time_us(
                lambda i, rb=radix_bits, w=warps: (lambda: topk_select(score_sets[i], k, num_blocks, sink_blocks=1,
                                                                      recent_blocks=1, radix_bits=rb, num_warps=w)), sets)
    variants["topk_us_radix2_warps8_no_candidate_filter"] = graph_time_us(
        lambda i: (lambda: topk_select(score_sets[i], k, num_blocks, sink_blocks=1, recent_blocks=1, radix_bits=2,
                                       num_warps=8, candidate_filter=False)), sets)
    best_topk = min(variants.values())
    base = {"batch": batch, "context": context, "block_size": block}
    return [
        {"op": "quest_score (bf16 metadata)", **base, "bytes": score16_bytes, "floor_us": score16_bytes / bw * 1e6,
         "kernel_us": t_score16, "GBps": score16_bytes / (t_score16 * 1e-6) / 1e9,
         "x_floor": t_score16 * 1e-6 * bw / score16_bytes},
        {"op": "quest_select (bf16 metadata, fused)", **base, "k": k, "sets_equal": fused16_ok,
         "kernel_us": t_fused16, "floor_us": score16_bytes / bw * 1e6, "x_floor": t_fused16 * 1e-6 * bw / score16_bytes},
        {"op": "select (bf16 metadata, score then topk)", **base, "k": k, "kernel_us": t_select16,
         "floor_us": score16_bytes / bw * 1e6, "x_floor": t_select16 * 1e-6 * bw / score16_bytes},
        {"op": "quest_select (fused score+topk)", **base, "k": k, "sets_equal": fused_ok, "kernel_us": t_fused,
         "torch_us": t_torch_select, "speedup_vs_torch": t_torch_select / t_fused},
        {"op": "topk_select (best variant)", **base, "k": k, "kernel_us": best_topk, "torch_topk_us": t_torch_topk,
         "speedup_vs_torch": t_torch_topk / best_topk, **variants},
        {"op": "quest_score", **base, "rel_err": score_err, "bytes": score_bytes, "floor_us": score_floor,
         "kernel_us": t_score, "torch_us": t_torch_score, "GBps": score_bytes / (t_score * 1e-6) / 1e9,
         "x_floor": t_score / score_floor, "speedup_vs_torch": t_torch_score / t_score},
        {"op": "topk_select", **base, "k": k, "sets_equal": topk_ok, "kernel_us": t_topk, "torch_topk_us": t_torch_topk,
         "speedup_vs_torch": t_torch_topk / t_topk},
        {"op": "select (score+topk)", **base, "k": k, "kernel_us": t_select, "torch_us": t_torch_select,
         "speedup_vs_torch": t_torch_select / t_select},
    ]


def select_latency(sets: int) -> list[dict]:
    """Launch shapes of the selection kernels at 128K, batch 1 and 8, blocks of 16 and 64: top-k
    rows with 1..16 warps and Quest scoring with other tile / warp counts, each checked against
    the default's output (`--only select_latency`; the top-k's warp rule in kernels/topk.py)."""
    from prr.kernels.quest import quest_score
    from prr.kernels.topk import topk_select

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict] = []
    for batch in (1, 8):
        for block in (16, 64):
            nb = 131072 // block
            k = 2048 // block
            num_blocks = torch.full((batch,), nb - 4, dtype=torch.int32, device="cuda")
            scores = [torch.randn(batch, HKV, nb, device="cuda", generator=gen) for _ in range(sets)]
            want = topk_select(scores[0], k, num_blocks, 1, 1)
            for warps in (1, 2, 4, 8, 16):
                got = topk_select(scores[0], k, num_blocks, 1, 1, num_warps=warps)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (batch, block, warps)
                us = graph_time_us(lambda i, w=warps, s=scores, kb=k, n=num_blocks: (
                    lambda: topk_select(s[i], kb, n, 1, 1, num_warps=w)), sets)
                rows.append(dict(op="topk", batch=batch, block=block, blocks=nb, k=k, warps=warps, us=us))
            kmax = [torch.randn(batch, HKV, nb, D, device="cuda", generator=gen).to(torch.bfloat16)
                    for _ in range(sets)]
            kmin = [(m.float() - 1).to(torch.bfloat16) for m in kmax]
            q = torch.randn(batch, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
            ref = quest_score(q, kmax[0], kmin[0], num_blocks, "max")
            for block_n in (16, 32, 64, 128):
                for warps in (2, 4, 8):
                    got = quest_score(q, kmax[0], kmin[0], num_blocks, "max", block_n=block_n, num_warps=warps)
                    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-3), (batch, block, block_n, warps)
                    us = graph_time_us(lambda i, bn=block_n, w=warps, qq=q, hi=kmax, lo=kmin, n=num_blocks: (
                        lambda: quest_score(qq, hi[i], lo[i], n, "max", block_n=bn, num_warps=w)), sets)
                    rows.append(dict(op="quest_score", batch=batch, block=block, blocks=nb, block_n=block_n,
                                     warps=warps, us=us))
            del kmax, kmin
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes only (smoke run)")
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/h200/bench_kernels")
    parser.add_argument("--sets", type=int, default=4, help="distinct input sets per graph (L2 rotation)")
    parser.add_argument("--only", choices=("all", "selection", "decode_tuning", "select_latency"), default="all",
                        help="selection: only the selection kernels (score, top-k, fused select); "
                             "decode_tuning: only the split kernel's launch shapes; "
                             "select_latency: only the selection kernels' warp and tile counts at 128K")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA GPU")
    gen = torch.Generator().manual_seed(0)
    copies = copy_bandwidth()
    bw = max(copies.values())
    rows: list[dict] = []
    batches, contexts, blocks, budgets = ([1], [32768, 131072], [16], [2048, 8192]) if args.quick else \
        ([1, 8], [32768, 65536, 131072], [16, 64], [1024, 2048, 4096, 8192])
    def attempt(name: str, shape: dict, fn, *fn_args) -> None:
        """Run one case; a failure becomes an error row, so later cases and earlier rows survive."""
        try:
            result = fn(*fn_args)
        except Exception as err:  # noqa: BLE001 - recorded in the results, not swallowed
            result = [{"op": name, **shape, "error": f"{type(err).__name__}: {err}"[:500]}]
        for row in result if isinstance(result, list) else [result]:
            rows.append(row)
            print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()

    if args.only == "select_latency":
        batches, contexts = [], []
        attempt("select_latency", {}, select_latency, 8)
    if args.only == "decode_tuning":
        batches, contexts = [], []
        for batch in (1, 8):
            for block in (16, 64):
                for budget in (2048, 8192):
                    shape = {"batch": batch, "context": 131072, "block_size": block, "budget_tokens": budget}
                    attempt("sparse_decode tuning", shape, tune_sparse_decode, batch, 131072, block, budget,
                            args.sets if batch == 1 else 2, gen)
    for batch in batches:
        for context in contexts:
            for block in blocks:
                sets = args.sets if batch == 1 else 2
                shape = {"batch": batch, "context": context, "block_size": block}
                for budget in budgets if args.only == "all" else ():
                    attempt("sparse_decode", {**shape, "budget_tokens": budget},
                            bench_sparse_decode, batch, context, block, budget, sets, gen, bw)
                attempt("selection", shape, bench_selection, batch, context, block, sets, gen, bw)
    if args.only == "all":
        attempt("merge", {}, bench_merge, args.sets, gen)
    if not rows:
        sys.exit("no rows measured")
    record = {"command": "python " + " ".join(sys.argv), **environment(), "copy_bandwidth_GBps": bw / 1e9,
              "copy_bandwidths_GBps": {k: v / 1e9 for k, v in copies.items()}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(strict_json_dumps(record, indent=1) + "\n")
    import pandas as pd

    frame = pd.DataFrame(rows)
    frame.insert(0, "command", record["command"])
    frame.to_csv(args.out.with_suffix(".csv"), index=False)
    print(f"\n{record['gpu']} | torch {record['torch']} | triton {record['triton']} | copy {bw / 1e9:.0f} GB/s")
    cols = ["op", "batch", "context", "block_size", "budget_tokens", "rel_err", "kernel_us", "kernel_per_block_us",
            "floor_us", "x_floor", "GBps", "speedup_vs_torch_sparse", "speedup_vs_dense", "speedup_vs_torch",
            "block", "blocks", "k", "warps", "block_n", "us", "error"]
    print(frame[[c for c in cols if c in frame]].to_string(index=False, float_format=lambda x: f"{x:.3g}"))


if __name__ == "__main__":
    main()
