"""Token-list decode attention (issue 52, item 2) beside the block kernel, torch gather + SDPA and the byte floor.

    python experiments/bench_token_attention.py [--quick] [--tokens 256,1024,2048,4096] [--batches 1,8,32] \
        [--contexts 32768,131072] [--tiles 64,128] [--sets 4] [--repeats 20] \
        [--out experiments/results/h200/bench_token_attention]

The 8B shape (Hq 32, Hkv 8, D 128), bf16, one KV cache [B, 8, context, 128] per (batch, context). For
every cell (batch B, context T, C listed tokens per (batch row, KV head)):
- token: `prr.kernels.token_sparse_decode.token_sparse_decode` over C distinct random tokens of [0, T)
  per (row, KV head), ascending (as a top-k sorted by position), out in bf16 (what the model's output
  projection reads); also with fuse_merge=True (the row's last split merges: no merge launch), with
  one list shared by all KV heads ([B, 1, C], DeepSeek's indexer), and at each `--tiles` tile size
  (tile_tokens, the K/V rows a program gathers per step; the default plan's tile is in `tile`).
- block16: `prr.kernels.sparse_decode.sparse_decode` over C / 16 random blocks of 16 tokens (the
  same bytes read as whole 4 KiB blocks per head: its natural best case), out in bf16.
- gather+SDPA: torch.gather of the listed K/V rows into [B, 8, C, 128], then
  torch.nn.functional.scaled_dot_product_attention (enable_gqa) on them: what a torch runtime does.
- floor: the bytes that must move, the gathered K/V rows (B * 8 * C * 2 * 128 * 2) + q and out
  (bf16, B * 32 * 128 * 2 each), over the best copy or read bandwidth measured in the same run
  (`prr.benchmarking.copy_bandwidth`, `read_bandwidth`). The lists (4 bytes a token and head) are left
  out of the floor: under 1% of the K/V rows.

Checks first, per cell, on set 0: the token kernel against its reference
(`prr.kernels.reference_token_sparse_decode`, fp32 compute) and against gather+SDPA; the shared list
against its reference; the token kernel over the block list's tokens against the block kernel. A cell
whose errors pass 1e-2 (out) or 1e-3 (lse) is kept, marked `checks: NO`.

Timing: `--sets` input sets at least (more where needed so that one graph reads 128 MiB of K/V rows,
2.5x the H200's L2; the sets share the cache and differ in their lists, so their rows differ) captured
in one CUDA graph (`prr.benchmarking.graph_time_us`), median of `--repeats` replays, / sets.

Needs a CUDA GPU with compiled kernels: on a CPU, or with TRITON_INTERPRET=1, it refuses in one line
(exit 2). Writes OUT.json (command, GPU, driver, versions, date, bandwidths, every row), OUT.csv and
OUT.md; prints the table last.
"""

from __future__ import annotations

from pathlib import Path

from prr.bench_args import (
    OneLineParser,
    bench_command,
    fill_grid_defaults,
    guarded,
    int_list,
    markdown,
    ratio,
    record_cell,
    rotation_sets,
    timing_count_problems,
    write_bench_outputs,
)

HQ, HKV, D, BF16 = 32, 8, 128, 2
BLOCK = 16  # the block kernel's column: blocks of 16 tokens
MAX_SETS = 128
OUT_BOUND, LSE_BOUND = 1e-2, 1e-3
FULL_GRID = dict(tokens=[256, 1024, 2048, 4096], batches=[1, 8, 32], contexts=[32768, 131072], tiles=[64, 128])
QUICK_GRID = dict(tokens=[2048], batches=[1, 8], contexts=[32768], tiles=[64])


# --- arguments, floors and tables: pure python (tests/test_bench_token_attention.py) ---------------------


def parse_args(argv: list[str] | None = None):
    parser = OneLineParser(prog="bench_token_attention", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"a small grid: {QUICK_GRID}")
    parser.add_argument("--tokens", type=int_list, default=None, help="listed tokens per (batch row, KV head)")
    parser.add_argument("--batches", type=int_list, default=None, help="batch sizes")
    parser.add_argument("--contexts", type=int_list, default=None, help="tokens in the cache per row")
    parser.add_argument("--tiles", type=int_list, default=None, help="token-kernel tile sizes timed beside its default")
    parser.add_argument("--sets", type=int, default=4, help="input sets per timing graph (at least; L2 rotation)")
    parser.add_argument("--repeats", type=int, default=20, help="graph replays (the median is reported)")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/h200/bench_token_attention"),
                        help="results prefix: OUT.json, OUT.csv, OUT.md")
    args = parser.parse_args(argv)
    fill_grid_defaults(args, QUICK_GRID if args.quick else FULL_GRID)
    problems = check_args(args)
    if problems:
        parser.error("; ".join(problems))
    return args


def check_args(args) -> list[str]:
    problems = [f"--tokens: {c} is not a multiple of {BLOCK} (the block kernel's column lists C / {BLOCK} blocks)"
                for c in args.tokens if c % BLOCK]
    problems += [f"--contexts: {t} is not a multiple of {BLOCK}" for t in args.contexts if t % BLOCK]
    problems += [f"--tiles: {t} is not a power of two >= 16" for t in args.tiles if t < 16 or t & (t - 1)]
    if not cells(args):
        problems.append(f"--tokens {args.tokens} --contexts {args.contexts}: no cell lists at most its context")
    problems += timing_count_problems(args)
    return problems


def cells(args) -> list[tuple[int, int, int]]:
    """(context, batch, tokens) of the grid, tokens <= context only; one cache per (context, batch)."""
    return [(t, b, c) for t in args.contexts for b in args.batches for c in args.tokens if c <= t]


def attention_bytes(batch: int, tokens: int) -> int:
    """The gathered K and V rows (bf16) + q and out (bf16): what one call must move."""
    return batch * HKV * tokens * 2 * D * BF16 + 2 * batch * HQ * D * BF16


def timing_sets(batch: int, tokens: int, sets: int) -> int:
    """Sets per graph: at least `sets`, and enough that the graph reads L2_ROTATION_BYTES of K/V rows."""
    return rotation_sets(attention_bytes(batch, tokens), sets, MAX_SETS)




def best_tile(row: dict) -> tuple[int | None, float | None]:
    """(tile, µs) of the fastest `token_tile<T>_us` column of a row, or (None, None)."""
    timed = [(int(key[len("token_tile"):-len("_us")]), v) for key, v in row.items()
             if key.startswith("token_tile") and key.endswith("_us") and v is not None]
    return min(timed, key=lambda kv: kv[1]) if timed else (None, None)


def table(rows: list[dict]) -> str:
    header = ["B", "context", "tokens", "splits x tile", "token µs", "fused µs", "shared µs", "best tile (µs)",
              "block16 µs", "gather+SDPA µs", "floor µs", "token / floor", "block16 / floor", "SDPA / floor",
              "token / block16", "checks"]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["batch"], r["context"], r["tokens"], *["—"] * 12, r["error"][:60]])
            continue
        tile, tile_us = best_tile(r)
        body.append([r["batch"], r["context"], r["tokens"], f"{r['splits']} x {r['tile']}", r.get("token_us"),
                     r.get("token_fused_us"), r.get("token_shared_us"),
                     "-" if tile is None else f"{tile} ({tile_us:.3g})", r.get("block16_us"),
                     r.get("gather_sdpa_us"), r["floor_us"], ratio(r.get("token_us"), r["floor_us"]),
                     ratio(r.get("block16_us"), r["floor_us"]), ratio(r.get("gather_sdpa_us"), r["floor_us"]),
                     ratio(r.get("token_us"), r.get("block16_us")), r["checks"]])
    return markdown(header, body)


def report(record: dict) -> str:
    env = record.get("environment", {})
    bandwidth = record.get("bandwidth_GBps")
    return "\n".join([
        "# Token-list decode attention beside the block kernel, gather + SDPA and the byte floor (issue 52, item 2)",
        "", f"Command: `{record.get('command', '')}`", "",
        f"{env.get('gpu', '?')}, driver {env.get('driver', '?')}, torch {env.get('torch', '?')}, "
        f"triton {env.get('triton', '?')}, CUDA {env.get('cuda', '?')}, {env.get('date', '?')}; timer "
        f"{record.get('timer', '?')}" + (f"; floor bandwidth {bandwidth:.0f} GB/s (measured)." if bandwidth else "."),
        "", f"8B shape (Hq {HQ}, Hkv {HKV}, D {D}), bf16, out in bf16. µs per call (median over graph replays / sets). "
        "tokens: listed per (batch row, KV head); block16: the same number of tokens as blocks of 16; "
        "fused: fuse_merge=True; shared: one list per batch row for all KV heads; best tile: the fastest of "
        "--tiles; floor: gathered K/V rows + q + out over the measured bandwidth; checks: the outputs "
        f"agree (out within {OUT_BOUND:g}, lse within {LSE_BOUND:g}).", "", table(record.get("rows", [])), ""])


def write_outputs(record: dict, out: Path) -> str:
    """OUT.json, OUT.csv (one row per cell, the command in each), OUT.md -> the markdown."""
    return write_bench_outputs(record, out, report)


# --- measurement (GPU) ---------------------------------------------------------------------------


def random_lists(batch: int, heads: int, candidates: int, k: int, gen):
    """[B, heads, k] int32: k distinct random ids of [0, candidates) per row, ascending (made on gen's device)."""
    import torch

    keys = torch.rand(batch, heads, candidates, generator=gen, device=gen.device)
    return keys.topk(k, dim=-1).indices.sort(dim=-1).values.to(torch.int32)


def cell_row(k_cache, v_cache, q, tokens: int, tiles: list[int], sets: int, repeats: int, bandwidth: float,
             gen, timer=None) -> dict:
    """One cell: k_cache, v_cache [B, 8, context, 128] and q [B, 32, 128] (bf16, on the GPU), C = tokens
    listed per (row, KV head); gen: the lists' generator (the cache's device). timer(make_call, sets,
    repeats) -> µs per call (default `prr.benchmarking.graph_time_us`; the tests pass a stand-in to run
    a cell's checks on the CPU, under the interpreter)."""
    import torch
    import torch.nn.functional as F
    from prr.kernels.reference_token_sparse_decode import token_sparse_decode_reference, tokens_of_blocks
    from prr.kernels.sparse_decode import sparse_decode
    from prr.kernels.token_sparse_decode import token_sparse_decode, token_sparse_decode_plan

    from prr.benchmarking import graph_time_us, rel_err

    timer = graph_time_us if timer is None else timer
    device = k_cache.device
    batch, _, context, _ = k_cache.shape
    sets = timing_sets(batch, tokens, sets)
    scale = D ** -0.5
    lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
    counts = torch.full((batch, HKV), tokens, dtype=torch.int32, device=device)
    shared_counts = counts[:, :1].contiguous()
    block_counts = torch.full((batch, HKV), tokens // BLOCK, dtype=torch.int32, device=device)
    token_lists = [random_lists(batch, HKV, context, tokens, gen) for _ in range(sets)]
    shared_lists = [random_lists(batch, 1, context, tokens, gen) for _ in range(sets)]
    block_lists = [random_lists(batch, HKV, context // BLOCK, tokens // BLOCK, gen) for _ in range(sets)]
    arrivals = torch.zeros(batch * HKV, dtype=torch.int32, device=device)  # fuse_merge's workspace, left zeroed
    nbytes = attention_bytes(batch, tokens)
    plan = token_sparse_decode_plan(tokens, batch, HKV, device, head_dim=D, cache_dtype=torch.bfloat16)
    row = dict(batch=batch, context=context, tokens=tokens, sets=sets, bytes=nbytes, splits=plan.num_splits,
               tile=plan.tile_tokens, tokens_per_split=plan.tokens_per_split, floor_us=nbytes / bandwidth * 1e6)

    def token(ids, cnt, fuse_merge=False, **kw):
        return token_sparse_decode(q, k_cache, v_cache, ids, cnt, lengths, scale, out_dtype=torch.bfloat16,
                                   fuse_merge=fuse_merge, arrivals=arrivals if fuse_merge else None, **kw)

    def block(ids):
        return sparse_decode(q, k_cache, v_cache, ids, block_counts, lengths, BLOCK, scale, out_dtype=torch.bfloat16)

    def gather_sdpa(ids):
        index = ids.long().unsqueeze(-1).expand(-1, -1, -1, D)  # [B, Hkv, C, D]
        keys, values = torch.gather(k_cache, 2, index), torch.gather(v_cache, 2, index)
        return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, scale=scale, enable_gqa=True).squeeze(2)

    # checks first (set 0)
    errors = {}
    out, lse = token(token_lists[0], counts)
    ref_out, ref_lse = token_sparse_decode_reference(q, k_cache, v_cache, token_lists[0], counts, lengths, scale,
                                                     compute_dtype=torch.float32)
    errors["token_vs_reference_out"], errors["token_vs_reference_lse"] = rel_err(out, ref_out), rel_err(lse, ref_lse)
    errors["token_vs_sdpa_out"] = rel_err(out, gather_sdpa(token_lists[0]))
    fused_out, fused_lse = token(token_lists[0], counts, fuse_merge=True)
    errors["fused_vs_token_out"], errors["fused_vs_token_lse"] = rel_err(fused_out, out), rel_err(fused_lse, lse)
    s_out, s_lse = token(shared_lists[0], shared_counts)
    sr_out, sr_lse = token_sparse_decode_reference(q, k_cache, v_cache, shared_lists[0], shared_counts, lengths,
                                                   scale, compute_dtype=torch.float32)
    errors["shared_vs_reference_out"], errors["shared_vs_reference_lse"] = rel_err(s_out, sr_out), rel_err(s_lse, sr_lse)
    as_tokens, token_counts = tokens_of_blocks(block_lists[0], block_counts, BLOCK)
    b_out, b_lse = block(block_lists[0])
    t_out, t_lse = token(as_tokens, token_counts.to(torch.int32))
    errors["token_vs_block16_out"], errors["token_vs_block16_lse"] = rel_err(t_out, b_out), rel_err(t_lse, b_lse)
    row.update(errors)
    row["checks"] = all(v <= (LSE_BOUND if key.endswith("_lse") else OUT_BOUND) for key, v in errors.items())
    del ref_out, ref_lse, sr_out, sr_lse

    guarded(row, "token_us", lambda: timer(lambda i: (lambda: token(token_lists[i], counts)), sets, repeats))
    guarded(row, "token_fused_us", lambda: timer(
        lambda i: (lambda: token(token_lists[i], counts, fuse_merge=True)), sets, repeats))
    guarded(row, "token_shared_us", lambda: timer(
        lambda i: (lambda: token(shared_lists[i], shared_counts)), sets, repeats))
    for tile in tiles:
        guarded(row, f"token_tile{tile}_us", lambda tile=tile: timer(
            lambda i: (lambda: token(token_lists[i], counts, tile_tokens=tile)), sets, repeats))
    guarded(row, "block16_us", lambda: timer(lambda i: (lambda: block(block_lists[i])), sets, repeats))
    guarded(row, "gather_sdpa_us", lambda: timer(lambda i: (lambda: gather_sdpa(token_lists[i])), sets, repeats))
    for name in ("token", "block16", "gather_sdpa"):
        row[f"{name}_over_floor"] = ratio(row.get(f"{name}_us"), row["floor_us"])
    row["token_over_block16"] = ratio(row.get("token_us"), row.get("block16_us"))
    return row


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import os

    from prr.cli_exits import refuse

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        refuse("bench_token_attention times compiled kernels: unset TRITON_INTERPRET (or set it to 0)")
    import torch

    if not torch.cuda.is_available():
        refuse("bench_token_attention needs a CUDA GPU (none here): run it on the GPU machine")
    from prr.benchmarking import announce_gpu, graph_bench_record, randn

    env, bandwidths, bandwidth = announce_gpu()
    record = graph_bench_record(bench_command("experiments/bench_token_attention.py", argv), env, bandwidths)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    grid = cells(args)
    for context, batch in dict.fromkeys((t, b) for t, b, _ in grid):
        k_cache, v_cache = randn(batch, HKV, context, D), randn(batch, HKV, context, D)
        q = randn(batch, HQ, D)
        for tokens in [c for t, b, c in grid if (t, b) == (context, batch)]:
            record_cell(record, args.out, write_outputs, dict(batch=batch, context=context, tokens=tokens),
                        cell_row, k_cache, v_cache, q, tokens, args.tiles, args.sets, args.repeats, bandwidth, gen)
        del k_cache, v_cache
        torch.cuda.empty_cache()
    print("\n" + write_outputs(record, args.out))


if __name__ == "__main__":
    main()
