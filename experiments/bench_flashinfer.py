"""FlashInfer beside prr's kernels, same inputs, same run: attention over A, top-k, the serial Quest stage.

    python experiments/bench_flashinfer.py [--quick] [--parts attention,topk,stage,prr] \
        [--topk-split 1024,2048] [--topk-radix 1] [--topk-filter off,512,2048r2] \
        [--out experiments/results/h200/bench_flashinfer]

The outside anchor of issue 21 (part 1). Shape: Llama-3.1-8B attention (32 query / 8 KV
heads, head_dim 128), bf16, random values (timings do not depend on them).

- attention: for batch x context x block size x top-K budget, prr's `sparse_decode` over
  random block lists A (prr.benchmarking.decode_inputs) against FlashInfer's paged decode
  (BatchDecodeWithPagedKVCacheWrapper, CUDA-core and tensor-core kernels) where each (row,
  KV head) is one request whose page table is its selected blocks (page = prr block: the
  cache [B, Hkv, T, D] is viewed as B*Hkv*T/block pages of one KV head, no copy), and
  FlashInfer's BlockSparseAttentionWrapper (fa2 backend) over the same mask (block row =
  one (row, KV head), R = 1, C = block). Outputs are checked first: each against a float32
  torch reference, and prr's against FlashInfer's (max |difference|).
- topk: prr's `topk_select` (what Quest's selection runs) against `flashinfer.top_k`
  (radix; it returns int64 indices) and `flashinfer.top_k_page_table_transform` (int32, the
  indices mapped through a page table in the same kernel) and torch.topk, on random fp32
  scores; the selected sets are compared. Beside it prr's split-row variant,
  `topk_select(..., split=CHUNK)` for each --topk-split chunk (its indices and counts must
  equal topk_select's bit for bit); the table shows the fastest chunk. Also other radix bits
  (--topk-radix) and candidate-filter settings (--topk-filter: off, a cap, a cap with 2-bit
  candidate passes), each checked bit for bit against the default; the fastest of each family shown.
- stage: prr's serial Quest stage as the graph engine runs it (quest_score, topk_select,
  sparse_decode with the output in bf16; and quest_select fused + sparse_decode) against a
  FlashInfer-composed one (prr's quest_score, top_k_page_table_transform straight to page
  ids, a copy into the decode wrapper's page table, FlashInfer's paged decode over A; one
  decode over all of A, so no merge_state is needed). Quest metadata in bf16 (the engine's).
  No forced blocks in either (FlashInfer's top-k has none): sink_blocks = recent_blocks = 0.
  Also prr's stage with the split-row top-k (each valid --topk-split chunk) and with other
  radix bits (--topk-radix); the best of them is the "best prr" column.
- prr: PRR at a controlled 90% hit rate (prr_row): prr's graph engine (serial, PRR exact and
  superset) against the paper's construction from FlashInfer (decode over P on a side stream
  while A is selected, A \\ P, decode over the misses, merge_state), which equals prr's superset
  mode and is checked against it. Caches of `context` tokens holding context - 256.

Timing (as bench_kernels.py): every op captured over `--sets` different input sets in one CUDA
graph (L2 rotation, no launch overhead), median replay / sets; attention and stage cells use at
least enough sets for 128 MiB of selected K/V per graph (2.5x the H200's L2; runs before
2026-12-02 08:30 UTC used --sets alone, so their batch-1 2K-budget cells rotated ~34 MB). Floors: bytes / the best of
the copy and read bandwidth measured in the same run (prr.benchmarking.copy_bandwidth,
read_bandwidth); also at the H200's nominal 4.8 TB/s. attention: K/V of the
selected blocks + q + bf16 output + block ids; topk: the scores + the indices;
stage: Quest metadata (graph_decode.metadata_bytes_per_block) + the attention bytes.

FlashInfer on a machine with torch and nvcc but no registry: flashinfer-python==0.6.14 with
apache-tvm-ffi (0.1.x), cuda-tile, nvidia-cudnn-frontend, ninja, einops, tabulate, tqdm,
nvidia-ml-py and click, each `pip install --no-deps --target DIR` (ninja's bin/ on PATH); it
JIT-compiles its decode, prefill (fa2) and top-k kernels on first use (about 3 minutes on
the H200; FLASHINFER_WORKSPACE_BASE names where the cache goes).

Writes OUT.json (command, GPU, driver, torch / triton / flashinfer versions, date, every row),
OUT.csv and OUT.md (the tables); prints the short markdown tables last.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from prr.bench_args import L2_ROTATION_BYTES, OneLineParser, int_list, markdown, ratio, topk_bytes
from prr.benchmarking import BF16, HEADROOM, HKV, HQ, D  # the 8B decode shape
from prr.paths import strict_json_dumps

ROOT = Path(__file__).resolve().parents[1]
GROUP = HQ // HKV
NOMINAL_BANDWIDTH = 4.8e12  # bytes/s, the H200's HBM3e figure
PAPER_BLOCKSPARSE_SPEEDUP = 2.22  # the paper: its sparse kernel vs FlashInfer BlockSparse at an 8K budget
PARTS = ("attention", "topk", "stage", "prr")
OTHER_RADIX_BITS = (1,)  # topk_select's radix_bits other than its default 2 (threshold bits per counting pass)
PRR_HIT_RATE = 0.9  # the prr part's controlled hit rate: |A \\ P| = 10% of A in every row
FULL_GRID = dict(batches=[1, 8], contexts=[32768, 131072], blocks=[16, 64], budgets=[2048, 8192],
                 topk_blocks=[2048, 8192], topk_k=[32, 128], topk_rows=[8, 64], topk_split=[1024, 2048],
                 topk_radix=[])
QUICK_GRID = dict(batches=[1], contexts=[32768], blocks=[16], budgets=[2048],
                  topk_blocks=[2048], topk_k=[32], topk_rows=[8], topk_split=[1024], topk_radix=[])


# --- arguments, floors and tables: pure python (tests/test_bench_flashinfer.py) -------------------



def filter_list(text: str) -> list[str]:
    """--topk-filter: comma-separated candidate-filter settings of topk_select, each `off` (no
    filter), CAP (candidate_cap, a power of two >= 16, with 4-bit candidate passes) or CAPrB
    (B = 2 or 4 bits per candidate pass)."""
    specs = [v for v in text.split(",") if v]
    for spec in specs:
        try:
            filter_kwargs(spec)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return specs


def filter_kwargs(spec: str) -> dict:
    """topk_select's keyword arguments for one --topk-filter setting."""
    if spec == "off":
        return dict(candidate_filter=False)
    match = re.fullmatch(r"(\d+)(?:r([24]))?", spec)
    cap = int(match.group(1)) if match else 0
    if cap < 16 or cap & (cap - 1):
        raise ValueError(f"{spec!r} is not off, CAP or CAPrB (CAP a power of two >= 16, B 2 or 4)")
    return dict(candidate_cap=cap, candidate_radix_bits=int(match.group(2) or 4))


def topk_variants(splits: list[int], radixes: list[int], filters: list[str], k: int, n: int) -> list[tuple[str, dict]]:
    """(name, topk_select keyword arguments) of every top-k variant a cell of n blocks and top-k k
    times beside the default: split{C}, radix{B}, filter_{spec}."""
    return ([(f"split{c}", dict(split=c)) for c in split_chunks(list(splits), k, n)]
            + [(f"radix{r}", dict(radix_bits=r)) for r in radixes]
            + [(f"filter_{f}", filter_kwargs(f)) for f in filters])


def best_variant(row: dict, family: str, prefix: str = "") -> tuple[str | None, float | None]:
    """-> (the fastest variant's setting, its µs) among a row's `{prefix}{family}*_us` timings."""
    start = f"{prefix}{family}"
    keys = tuple(k for k in row if k.startswith(start) and k.endswith("_us") and k != f"{start}_us")
    name, us = best_of(row, keys)
    return (name[len(start):-len("_us")].lstrip("_") if name else None), us


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(prog="bench_flashinfer", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one cell per part (smoke run); grid flags still apply")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ",".join(PARTS))
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/h200/bench_flashinfer")
    parser.add_argument("--sets", type=int, default=4, help="distinct input sets per graph at batch 1 (2 at batch > 1)")
    parser.add_argument("--repeats", type=int, default=20, help="graph replays per timing (median)")
    parser.add_argument("--report", type=Path, default=None, metavar="JSON",
                        help="no GPU: rewrite the CSV and markdown of a saved run's JSON (next to it) and print the tables")
    parser.add_argument("--topk-filter", type=filter_list, default=[],
                        help="top-k candidate-filter settings timed beside the default: off, CAP (4-bit candidate passes) or CAPrB (e.g. off,512,2048r2)")
    for name in FULL_GRID:
        parser.add_argument("--" + name.replace("_", "-"), type=int_list, default=None,
                            help=f"comma-separated (default {','.join(map(str, FULL_GRID[name]))})")
    args = parser.parse_args(argv)
    grid = QUICK_GRID if args.quick else FULL_GRID
    for name, default in grid.items():
        if getattr(args, name) is None:
            setattr(args, name, list(default))
    args.parts = [p for p in args.parts.split(",") if p]
    problems = check_args(args)
    if args.report is not None and not args.report.is_file():
        problems.append(f"--report {args.report}: no such file")
    if problems:
        parser.error("; ".join(problems))
    return args


def check_args(args: argparse.Namespace) -> list[str]:
    problems = []
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown or not args.parts:
        problems.append(f"--parts {','.join(args.parts)!r}: choose from {','.join(PARTS)}")
    for name in ("sets", "repeats"):
        if getattr(args, name) < 1:
            problems.append(f"--{name}={getattr(args, name)} must be >= 1")
    for b in args.blocks:
        if b < 16 or b & (b - 1):
            problems.append(f"--blocks: {b} is not a power of two >= 16 (prr's sparse_decode)")
    for c in args.contexts:
        for b in args.blocks:
            if c % b:
                problems.append(f"--contexts: {c} is not a multiple of block size {b}")
    for k in args.budgets:
        for b in args.blocks:
            if k % b:
                problems.append(f"--budgets: {k} is not a multiple of block size {b}")
        for c in args.contexts:
            if k > c:
                problems.append(f"--budgets: {k} exceeds context {c}")
    for r in args.topk_rows:
        if r % HKV:
            problems.append(f"--topk-rows: {r} is not a multiple of {HKV} (rows are batch x {HKV} KV heads)")
    for k in args.topk_k:
        for n in args.topk_blocks:
            if k > n:
                problems.append(f"--topk-k: {k} exceeds {n} blocks")
    for r in args.topk_radix:
        if r not in OTHER_RADIX_BITS:
            problems.append(f"--topk-radix: {r} is not one of topk_select's non-default radix_bits {OTHER_RADIX_BITS}")
    if "prr" in args.parts:  # the prr part's cache holds context - HEADROOM tokens in full blocks
        for c in args.contexts:
            for b in args.blocks:
                if (c - HEADROOM) % b:
                    problems.append(f"--contexts/--blocks: the prr part holds {c} - {HEADROOM} tokens, not a multiple "
                                    f"of block size {b}")
            for k in args.budgets:
                if k > c - HEADROOM:
                    problems.append(f"--budgets: {k} exceeds the prr part's {c - HEADROOM} tokens at context {c}")
    for c in args.topk_split:
        if c < 16 or c > 16384 or c & (c - 1):
            problems.append(f"--topk-split: {c} is not a power of two in 16 .. 16384 (topk_select's split chunk)")
    return problems


def attention_bytes(batch: int, budget_tokens: int, block: int) -> int:
    """Bytes one decode over A must move: K and V of the selected blocks, q, the bf16 output
    and the block ids."""
    kv = 2 * batch * HKV * budget_tokens * D * BF16
    q_out = 2 * batch * HQ * D * BF16
    ids = batch * HKV * (budget_tokens // block) * 4
    return kv + q_out + ids




def stage_bytes(batch: int, context: int, budget_tokens: int, block: int, meta_bytes_per_block: int) -> int:
    """The serial stage: Quest metadata of every block once, then attention over A."""
    return batch * HKV * (context // block) * meta_bytes_per_block + attention_bytes(batch, budget_tokens, block)


def split_chunks(chunks: list[int], k: int, n: int) -> list[int]:
    """The --topk-split chunks topk_select accepts for rows of n blocks and top-k k: smaller than
    the row, and the merge's candidates (chunks x min(k, chunk)) within MAX_ROW_BLOCK."""
    from prr.kernels.topk import MAX_ROW_BLOCK

    return [c for c in chunks if c < n and -(-n // c) * min(k, c) <= MAX_ROW_BLOCK]


def missed_pages(table, p_sorted, misses: int):
    """A \\ P per row with static shapes: table [R, K] int32 page ids of A (any order), p_sorted
    [R, |P|] int32 page ids of P ascending, misses: |A \\ P|, the same in every row -> [R, misses]
    the pages of A not in P, ascending (the hits sort last, as int32 max)."""
    import torch

    pos = torch.searchsorted(p_sorted, table).clamp_(max=p_sorted.shape[-1] - 1)
    hit = p_sorted.gather(1, pos) == table
    return torch.where(hit, torch.iinfo(torch.int32).max, table).sort(-1).values[:, :misses]


def selection_disagreement(scores, prr_ids, fi_ids) -> dict:
    """Where two top-k selections of the same scores differ. scores [R, N] fp32; prr_ids, fi_ids
    [R, k] block ids (any order, distinct per row) -> rows_differ: rows whose sets differ;
    score_margin: over those rows, the smallest (lowest score only prr took) - (highest score
    only FlashInfer took): > 0, FlashInfer left out a better block; 0, a tie at the k-th score
    (both are top-k sets); < 0, prr did; None where the sets agree."""
    import torch

    taken = [torch.zeros_like(scores, dtype=torch.bool).scatter_(1, ids.long(), True) for ids in (prr_ids, fi_ids)]
    only_prr, only_fi = taken[0] & ~taken[1], taken[1] & ~taken[0]
    differ = only_prr.any(-1)
    if not differ.any():
        return dict(rows_differ=0, score_margin=None)
    low = scores.masked_fill(~only_prr, float("inf")).amin(-1)
    high = scores.masked_fill(~only_fi, float("-inf")).amax(-1)
    return dict(rows_differ=int(differ.sum()), score_margin=float((low - high)[differ].min()))


def floor_us(nbytes: int, bandwidth: float) -> float:
    return nbytes / bandwidth * 1e6






def best_of(row: dict, keys: tuple[str, ...]) -> tuple[str | None, float | None]:
    times = {k: row[k] for k in keys if isinstance(row.get(k), (int, float))}
    if not times:
        return None, None
    name = min(times, key=times.get)
    return name, times[name]


def attention_table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        fi_name, fi = best_of(r, ("fi_decode_us", "fi_decode_tc_us"))
        bs = r.get("fi_blocksparse_us")
        errs = [r.get(f"max_abs_prr_vs_{v}") for v in ("fi", "fi_tc", "fi_blocksparse", "fi_varblocksparse")]
        errs = [e for e in errs if isinstance(e, (int, float))]
        body.append([r["batch"], r["context"] // 1024, r["block_size"], r["budget_tokens"], r.get("prr_us"),
                     r.get("fi_decode_us"), r.get("fi_decode_tc_us"), bs, r.get("fi_varblocksparse_us"),
                     ratio(r.get("prr_us"), fi), ratio(bs, r.get("prr_us")), r.get("floor_us"),
                     ratio(r.get("prr_us"), r.get("floor_us")), ratio(fi, r.get("floor_us")),
                     max(errs) if errs else None, r.get("error", "")])
    return markdown(["B", "ctx K", "block", "budget", "prr µs", "FI decode µs", "FI decode TC µs", "FI BlockSparse µs",
                     "FI VarBlockSparse µs", "prr / best FI decode", "FI BlockSparse / prr (paper 2.22)", "floor µs",
                     "prr / floor", "best FI decode / floor", "max abs(prr - FI), all FI", "error"], body)


def topk_table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        _, fi = best_of(r, ("fi_top_k_us", "fi_page_table_us"))
        body.append([r["rows"], r["blocks"], r["k"], r.get("prr_us"), r.get("fi_top_k_us"), r.get("fi_page_table_us"),
                     r.get("torch_topk_us"), ratio(r.get("prr_us"), fi), ratio(r.get("prr_us"), r.get("floor_us")),
                     r.get("sets_equal"), r.get("split_us"), r.get("split_chunk"), ratio(r.get("split_us"), fi),
                     r.get("radix_us"), r.get("radix_bits"), ratio(r.get("radix_us"), fi),
                     r.get("filter_us"), r.get("filter_setting"), ratio(r.get("filter_us"), fi),
                     r.get("error", "")])
    return markdown(["rows", "blocks", "k", "prr topk_select µs", "FI top_k µs", "FI top_k_page_table µs", "torch.topk µs",
                     "prr / best FI", "prr / floor", "sets equal", "prr split µs (best chunk)", "split chunk",
                     "split / best FI", "prr other-radix µs (best)", "radix bits", "radix / best FI",
                     "prr filter setting µs (best)", "filter", "filter / best FI", "error"], body)


def stage_table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        _, prr = best_of(r, ("prr_serial_us", "prr_fused_us", "prr_split_us", "prr_radix_us"))
        body.append([r["batch"], r["context"] // 1024, r["block_size"], r["budget_tokens"], r.get("prr_serial_us"),
                     r.get("prr_fused_us"), r.get("prr_split_us"), r.get("prr_split_chunk"), r.get("prr_radix_us"),
                     r.get("prr_radix_bits"), r.get("fi_serial_us"), r.get("fi_table_copy_us"),
                     ratio(r.get("prr_serial_us"), r.get("fi_serial_us")),
                     ratio(prr, r.get("fi_serial_us")), r.get("floor_us"), ratio(prr, r.get("floor_us")),
                     ratio(r.get("fi_serial_us"), r.get("floor_us")), r.get("sets_equal"), r.get("max_abs_prr_vs_fi"),
                     r.get("error", "")])
    return markdown(["B", "ctx K", "block", "budget", "prr serial µs", "prr fused-select µs",
                     "prr split top-k µs (best chunk)", "chunk", "prr other-radix top-k µs", "radix bits",
                     "FI-composed µs",
                     "of which table copy µs", "prr serial / FI", "best prr / FI", "floor µs", "best prr / floor", "FI / floor", "sets equal",
                     "max abs(prr - FI)", "error"], body)


def prr_table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        _, fi_best = best_of(r, ("fi_serial_us", "fi_prr_us"))
        _, prr_best = best_of(r, ("engine_serial_us", "engine_prr_us", "engine_superset_us"))
        body.append([r["batch"], r["context"] // 1024, r["block_size"], r["budget_tokens"], r.get("hit_rate"),
                     r.get("engine_serial_us"), r.get("engine_prr_us"), r.get("engine_superset_us"),
                     r.get("fi_serial_us"), r.get("fi_prr_us"),
                     ratio(r.get("engine_prr_us"), r.get("engine_serial_us")),
                     ratio(r.get("fi_prr_us"), r.get("fi_serial_us")),
                     ratio(r.get("engine_superset_us"), r.get("fi_prr_us")),
                     ratio(prr_best, fi_best), r.get("floor_us"), ratio(prr_best, r.get("floor_us")),
                     r.get("max_abs_fi_prr_vs_engine"), r.get("error", "")])
    return markdown(["B", "ctx K", "block", "budget", "hit", "prr serial µs", "prr PRR (exact) µs",
                     "prr PRR (superset) µs", "FI serial µs", "FI PRR (superset) µs", "prr exact / serial",
                     "FI PRR / serial", "prr superset / FI PRR", "best prr / best FI", "floor µs",
                     "best prr / floor", "max abs(FI PRR - prr superset)", "error"], body)


def paper_scale(rows: list[dict]) -> str:
    """FlashInfer BlockSparse / prr at an 8K budget: the paper's own kernel measured 2.22x."""
    vals = [ratio(r.get("fi_blocksparse_us"), r.get("prr_us")) for r in rows if r.get("budget_tokens") == 8192]
    vals = [v for v in vals if v is not None]
    if not vals:
        return "Paper scale: no 8K-budget cell with both prr and FlashInfer BlockSparse timed."
    return (f"Paper scale: FlashInfer BlockSparse / prr sparse_decode at an 8K budget = {min(vals):.2f}-{max(vals):.2f}x "
            f"over {len(vals)} cells (the paper reports {PAPER_BLOCKSPARSE_SPEEDUP}x for its own kernel).")


def report(record: dict) -> str:
    """The markdown of a run: provenance, then one table per part."""
    env = record.get("environment", {})
    out = ["# FlashInfer beside prr (issue 21, part 1)", "",
           f"Command: `{record.get('command', '')}`", "",
           f"{env.get('gpu', '?')}, driver {env.get('driver', '?')}, torch {env.get('torch', '?')}, "
           f"triton {env.get('triton', '?')}, flashinfer {env.get('flashinfer', '?')}, CUDA {env.get('cuda', '?')}, "
           f"{env.get('date', '?')}; floor bandwidth {record.get('bandwidth_GBps', float('nan')):.0f} GB/s "
           f"(measured; the nominal {NOMINAL_BANDWIDTH / 1e12:.1f} TB/s floors are in the CSV).", ""]
    if record.get("attention"):
        out += ["## Attention over A (µs per call)", "", attention_table(record["attention"]), "",
                paper_scale(record["attention"]), ""]
    if record.get("topk"):
        out += ["## Top-k over block scores (µs per call)", "", topk_table(record["topk"]), ""]
    if record.get("stage"):
        out += ["## Serial Quest stage: scores + top-k + attention over A (µs per call)", "",
                stage_table(record["stage"]), ""]
    if record.get("prr"):
        out += ["## PRR beside serial DSA, prr's engine and FlashInfer-composed, at a controlled hit rate "
                "(µs per layer)", "", prr_table(record["prr"]), ""]
    return "\n".join(out)


# --- GPU measurement ------------------------------------------------------------------------------

def environment() -> dict:
    import flashinfer

    from prr.benchmarking import environment as base

    return {**base(), "flashinfer": flashinfer.__version__}


def page_ids(ids, num_blocks: int):
    """ids [B, Hkv, k] block ids -> [B*Hkv*k] int32 page ids in the pool of B*Hkv*num_blocks pages
    (page p = row (b, h) = p // num_blocks, block p % num_blocks)."""
    import torch

    rows = ids.shape[0] * ids.shape[1]
    base = torch.arange(rows, device=ids.device, dtype=torch.int32).view(rows, 1) * num_blocks
    return (ids.reshape(rows, -1).to(torch.int32) + base).flatten()


def as_pages(cache, block: int):
    """[B, Hkv, T, D] -> [B*Hkv*T/block, block, 1, D]: FlashInfer NHD pages of one KV head (a view)."""
    b, h, t, d = cache.shape
    return cache.view(b * h * (t // block), block, 1, d)


class FIDecode:
    """One FlashInfer paged-decode wrapper (CUDA-graph mode) planned for B*Hkv requests of
    `k` pages each; `indices` is its page table (write it in place)."""

    def __init__(self, workspace, rows: int, k: int, block: int, pages, scale: float, tensor_cores: bool):
        import flashinfer
        import torch

        dev = workspace.device
        indptr = torch.arange(rows + 1, dtype=torch.int32, device=dev) * k
        last = torch.full((rows,), block, dtype=torch.int32, device=dev)
        self.indices = torch.empty(rows * k, dtype=torch.int32, device=dev)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=indptr.clone(), paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=last.clone())
        self.wrapper.plan(indptr, pages, last, GROUP, 1, D, block, q_data_type=torch.bfloat16,
                          kv_data_type=torch.bfloat16, o_data_type=torch.bfloat16, sm_scale=scale)
        self.rows = rows
        self.out = torch.empty(rows, GROUP, D, dtype=torch.bfloat16, device=dev)

    def __call__(self, q, k_pages, v_pages):
        return self.wrapper.run(q.view(self.rows, GROUP, D), (k_pages, v_pages), out=self.out)


class FIBlockSparse:
    """FlashInfer's BlockSparseAttentionWrapper over the same A: block row r = (row, KV head),
    R = 1 query row of GROUP heads, C = block columns of one KV head."""

    def __init__(self, workspace, rows: int, k: int, block: int, tokens: int, pages, scale: float):
        import flashinfer
        import torch

        dev = workspace.device
        indptr = torch.arange(rows + 1, dtype=torch.int32, device=dev) * k
        self.wrapper = flashinfer.BlockSparseAttentionWrapper(workspace, backend="fa2")
        self.wrapper.plan(indptr, pages.clone(), rows, rows * tokens, 1, block, GROUP, 1, D, sm_scale=scale,
                          q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, o_data_type=torch.bfloat16)
        self.rows = rows
        self.out = torch.empty(rows, GROUP, D, dtype=torch.bfloat16, device=dev)

    def __call__(self, q, k_cache, v_cache):
        flat_k = k_cache.view(-1, 1, D)
        flat_v = v_cache.view(-1, 1, D)
        return self.wrapper.run(q.view(self.rows, GROUP, D), flat_k, flat_v, out=self.out)


class FIVariableBlockSparse:
    """FlashInfer's VariableBlockSparseAttentionWrapper over the same A: every (row, KV head) is
    one of B*Hkv "KV heads" with its own mask (one block row of 1 query, nb block columns of
    `block` tokens); q [B*Hq, 1, D] and K/V [B*Hkv, T, D] are views of prr's tensors. It expands
    the mask to one index per token (page size 1)."""

    def __init__(self, workspace, batch: int, ids, num_blocks: int, block: int, scale: float):
        import flashinfer
        import torch

        dev = workspace.device
        heads = batch * HKV
        mask = torch.zeros(heads, 1, num_blocks, dtype=torch.bool, device=dev)
        mask.view(heads, num_blocks).scatter_(1, ids.reshape(heads, -1).long(), True)
        rows = torch.ones(heads, 1, dtype=torch.int32, device=dev)
        cols = torch.full((heads, num_blocks), block, dtype=torch.int32, device=dev)
        self.wrapper = flashinfer.VariableBlockSparseAttentionWrapper(workspace, backend="fa2")
        self.wrapper.plan(mask, rows, cols, batch * HQ, heads, D, sm_scale=scale, q_data_type=torch.bfloat16,
                          kv_data_type=torch.bfloat16)
        self.batch = batch

    def __call__(self, q, k_cache, v_cache):
        b = self.batch
        return self.wrapper.run(q.view(b * HQ, 1, D), k_cache.view(b * HKV, -1, D), v_cache.view(b * HKV, -1, D))


def max_abs(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def guarded(row: dict, name: str, fn):
    """row[name] = fn(); a failure becomes row[name + '_error'] (the other variants still run)."""
    try:
        row[name] = fn()
    except Exception as err:  # noqa: BLE001 - recorded in the results
        row[name + "_error"] = f"{type(err).__name__}: {err}"[:400]
        print(f"  {name}: {row[name + '_error']}", flush=True)
        import torch

        torch.cuda.synchronize()


def cell_rows(batch: int, context: int, blocks: list[int], budgets: list[int], sets: int, repeats: int, gen,
              bandwidth: float, parts: list[str], workspace, topk_split: list[int],
              topk_radix: list[int]) -> tuple[list[dict], list[dict]]:
    """Attention and stage rows of one (batch, context): one set of caches and queries, new
    random block lists and Quest metadata for every block size and budget."""
    from types import SimpleNamespace

    import torch

    from prr.benchmarking import decode_inputs

    caches, qs, _, _, lengths, scale = decode_inputs(batch, context, blocks[0], budgets[0], sets, gen)
    inp = SimpleNamespace(batch=batch, context=context, sets=sets, repeats=repeats, gen=gen, bandwidth=bandwidth,
                          parts=parts, workspace=workspace, topk_split=topk_split, topk_radix=topk_radix, caches=caches, qs=qs, lengths=lengths, scale=scale)
    attention, stage = [], []
    for block in blocks:
        for budget in budgets:
            att, stg = block_budget_rows(inp, block, budget)
            attention += [att] if att else []
            stage += [stg] if stg else []
            torch.cuda.empty_cache()
    return attention, stage


def block_budget_rows(inp, block: int, budget: int) -> tuple[dict | None, dict | None]:
    """One (block size, budget) of a cell: the attention row and the stage row (None where
    the part is not run)."""
    import torch

    from prr.benchmarking import graph_time_us, random_block_lists

    batch, context, sets, caches, scale = inp.batch, inp.context, inp.sets, inp.caches, inp.scale
    nb, k, rows_n = context // block, budget // block, batch * HKV
    shape = dict(batch=batch, context=context, block_size=block, budget_tokens=budget, k_blocks=k, sets=sets)
    ids = [random_block_lists(batch, nb, k, inp.gen) for _ in range(sets)]
    counts = torch.full((batch, HKV), k, dtype=torch.int32, device="cuda")
    kpages = [as_pages(c[0], block) for c in caches]
    vpages = [as_pages(c[1], block) for c in caches]
    pages = [page_ids(i, nb) for i in ids]
    try:
        dec = {tc: [FIDecode(inp.workspace, rows_n, k, block, p, scale, tc) for p in pages] for tc in (False, True)}
    except Exception as err:  # noqa: BLE001 - recorded in the results
        row = dict(shape, error=f"FlashInfer decode plan: {type(err).__name__}: {err}"[:400])
        print(json.dumps(row), flush=True)
        return row, None

    def timed(make_call) -> float:
        return graph_time_us(make_call, sets, inp.repeats)

    att = attention_row(inp, shape, block, budget, ids, counts, kpages, vpages, pages, dec, timed) \
        if "attention" in inp.parts else None
    if att is not None:
        print(json.dumps(att), flush=True)
    stg = None
    if "stage" in inp.parts:
        tc = att is not None and att.get("fi_decode_tc_us", math.inf) < att.get("fi_decode_us", math.inf)
        stg = stage_row(inp, shape, block, budget, kpages, vpages, dec[tc], timed)
        stg["fi_decode_kernel"] = "tensor cores" if tc else "cuda cores"
        print(json.dumps(stg), flush=True)
    return att, stg


def attention_row(inp, shape: dict, block: int, budget: int, ids, counts, kpages, vpages, pages, dec, timed) -> dict:
    """prr's sparse_decode vs FlashInfer's paged decode (CUDA and tensor cores) and BlockSparse
    over the same block lists; correctness on set 0 first."""
    import torch
    import torch.nn.functional as F
    from prr.kernels.sparse_decode import sparse_decode

    from prr.benchmarking import rel_err

    batch, context, sets, caches, qs, lengths, scale = (inp.batch, inp.context, inp.sets, inp.caches, inp.qs,
                                                        inp.lengths, inp.scale)
    k, rows_n = budget // block, batch * HKV
    nbytes = attention_bytes(batch, budget, block)
    row = dict(shape, bytes=nbytes, floor_us=floor_us(nbytes, inp.bandwidth),
               floor_nominal_us=floor_us(nbytes, NOMINAL_BANDWIDTH))
    tokens = (ids[0].long().unsqueeze(-1) * block + torch.arange(block, device="cuda")).flatten(2)
    index = tokens.unsqueeze(-1).expand(-1, -1, -1, D)
    k_sel, v_sel = torch.gather(caches[0][0], 2, index), torch.gather(caches[0][1], 2, index)
    ref = F.scaled_dot_product_attention(qs[0].float().unsqueeze(2), k_sel.float(), v_sel.float(),
                                         scale=scale, enable_gqa=True).squeeze(2)
    del k_sel, v_sel, index

    def prr(i):
        return sparse_decode(qs[i], *caches[i], ids[i], counts, lengths, block, scale, out_dtype=torch.bfloat16)[0]

    out_prr = prr(0)
    row["prr_rel_err"] = rel_err(out_prr, ref)
    for tc, name in ((False, "fi"), (True, "fi_tc")):
        out = dec[tc][0](qs[0], kpages[0], vpages[0]).view(batch, HQ, D)
        row[f"{name}_rel_err"] = rel_err(out, ref)
        row[f"max_abs_prr_vs_{name}"] = max_abs(out_prr, out)
    guarded(row, "prr_us", lambda: timed(lambda i: (lambda: prr(i))))
    guarded(row, "fi_decode_us", lambda: timed(lambda i: (lambda: dec[False][i](qs[i], kpages[i], vpages[i]))))
    guarded(row, "fi_decode_tc_us", lambda: timed(lambda i: (lambda: dec[True][i](qs[i], kpages[i], vpages[i]))))

    def blocksparse():
        bsw = [FIBlockSparse(inp.workspace, rows_n, k, block, context, pages[i], scale) for i in range(sets)]
        out_bs = bsw[0](qs[0], *caches[0]).view(batch, HQ, D)
        row["fi_blocksparse_rel_err"] = rel_err(out_bs, ref)
        row["max_abs_prr_vs_fi_blocksparse"] = max_abs(out_prr, out_bs)
        return timed(lambda i: (lambda: bsw[i](qs[i], *caches[i])))
    guarded(row, "fi_blocksparse_us", blocksparse)

    def variable_blocksparse():
        vbs = [FIVariableBlockSparse(inp.workspace, batch, ids[i], context // block, block, scale) for i in range(sets)]
        out_v = vbs[0](qs[0], *caches[0]).view(batch, HQ, D)
        row["fi_varblocksparse_rel_err"] = rel_err(out_v, ref)
        row["max_abs_prr_vs_fi_varblocksparse"] = max_abs(out_prr, out_v)
        return timed(lambda i: (lambda: vbs[i](qs[i], *caches[i])))
    guarded(row, "fi_varblocksparse_us", variable_blocksparse)
    _, fi = best_of(row, ("fi_decode_us", "fi_decode_tc_us"))
    row["prr_over_fi_decode"] = ratio(row.get("prr_us"), fi)
    row["fi_blocksparse_over_prr"] = ratio(row.get("fi_blocksparse_us"), row.get("prr_us"))
    row["fi_varblocksparse_over_prr"] = ratio(row.get("fi_varblocksparse_us"), row.get("prr_us"))
    row["prr_over_floor"] = ratio(row.get("prr_us"), row["floor_us"])
    row["fi_over_floor"] = ratio(fi, row["floor_us"])
    return row


def stage_row(inp, shape: dict, block: int, budget: int, kpages, vpages, fdec, timed) -> dict:
    """prr's serial Quest stage (as the engine runs it, and with the fused select) vs a
    FlashInfer-composed one over the same metadata, caches and queries."""
    import flashinfer
    import torch
    from prr.kernels.quest import quest_score, quest_select
    from prr.kernels.sparse_decode import sparse_decode
    from prr.kernels.topk import topk_select

    from prr.benchmarking import randn
    from prr.runtime.graph_decode import metadata_bytes_per_block

    batch, context, sets, caches, qs, lengths, scale = (inp.batch, inp.context, inp.sets, inp.caches, inp.qs,
                                                        inp.lengths, inp.scale)
    nb, k, rows_n = context // block, budget // block, batch * HKV
    meta = metadata_bytes_per_block("quest", torch.bfloat16, D)
    nbytes = stage_bytes(batch, context, budget, block, meta)
    row = dict(shape, bytes=nbytes, floor_us=floor_us(nbytes, inp.bandwidth),
               floor_nominal_us=floor_us(nbytes, NOMINAL_BANDWIDTH))
    metas = []
    for _ in range(sets):  # Quest key max / min per block, bf16 (the cache dtype, as the engine keeps them)
        a, b = randn(batch, HKV, nb, D), randn(batch, HKV, nb, D)
        metas.append((torch.maximum(a, b), torch.minimum(a, b)))
    num_blocks = torch.full((batch,), nb, dtype=torch.int32, device="cuda")
    src = page_ids(torch.arange(nb, dtype=torch.int32, device="cuda").expand(batch, HKV, nb), nb).view(rows_n, nb)
    row_lens = torch.full((rows_n,), nb, dtype=torch.int32, device="cuda")
    arrivals = torch.zeros(rows_n, dtype=torch.int32, device="cuda")

    def prr_serial(i):
        scores = quest_score(qs[i], *metas[i], num_blocks)
        idx, cnt = topk_select(scores, k, num_blocks, sink_blocks=0, recent_blocks=0)
        return sparse_decode(qs[i], *caches[i], idx, cnt, lengths, block, scale, out_dtype=torch.bfloat16)[0], idx

    def prr_fused(i):
        _, idx, cnt = quest_select(qs[i], *metas[i], num_blocks, k, sink_blocks=0, recent_blocks=0, arrivals=arrivals)
        return sparse_decode(qs[i], *caches[i], idx, cnt, lengths, block, scale, out_dtype=torch.bfloat16)[0]

    def fi_serial(i):
        scores = quest_score(qs[i], *metas[i], num_blocks)
        table = flashinfer.top_k_page_table_transform(scores.view(rows_n, nb), src, row_lens, k)
        fdec[i].indices.copy_(table.view(-1))
        return fdec[i](qs[i], kpages[i], vpages[i]).view(batch, HQ, D), table

    out_p, idx_p = prr_serial(0)
    out_f, table = fi_serial(0)
    got = (table.view(batch, HKV, k) - src.view(batch, HKV, nb)[..., :1]).sort(-1).values
    row["sets_equal"] = bool(torch.equal(got, idx_p.sort(-1).values.to(got.dtype)))
    # If they differ: which one left out a better block, or a tie at the k-th score
    row.update(selection_disagreement(quest_score(qs[0], *metas[0], num_blocks).view(rows_n, nb),
                                      idx_p.view(rows_n, k), got.view(rows_n, k)))
    row["max_abs_prr_vs_fi"] = max_abs(out_p, out_f)
    row["max_abs_fused_vs_serial"] = max_abs(prr_fused(0), out_p)
    guarded(row, "prr_serial_us", lambda: timed(lambda i: (lambda: prr_serial(i))))
    guarded(row, "prr_fused_us", lambda: timed(lambda i: (lambda: prr_fused(i))))
    # The serial stage with another top-k (split rows, other radix bits): the same output, timed alike.
    variants = topk_variants(inp.topk_split, inp.topk_radix, [], k, nb)
    for name, topk_kw in variants:
        def prr_with(i, kw=topk_kw):
            scores = quest_score(qs[i], *metas[i], num_blocks)
            idx, cnt = topk_select(scores, k, num_blocks, sink_blocks=0, recent_blocks=0, **kw)
            return sparse_decode(qs[i], *caches[i], idx, cnt, lengths, block, scale, out_dtype=torch.bfloat16)[0]
        row[f"{name}_equals_serial"] = bool(torch.equal(prr_with(0), out_p))
        row["sets_equal"] = row["sets_equal"] and row[f"{name}_equals_serial"]
        guarded(row, f"prr_{name}_us", lambda f=prr_with: timed(lambda i: (lambda: f(i))))
    for family, key in (("split", "prr_split_chunk"), ("radix", "prr_radix_bits")):
        setting, row[f"prr_{family}_us"] = best_variant(row, family, prefix="prr_")
        row[key] = int(setting) if setting else None
    guarded(row, "fi_serial_us", lambda: timed(lambda i: (lambda: fi_serial(i))))
    # The public top_k_page_table_transform allocates its output: the composed stage copies it
    # into the decode wrapper's page table (one small launch), timed alone here.
    tables = [flashinfer.top_k_page_table_transform(quest_score(qs[i], *metas[i], num_blocks).view(rows_n, nb), src,
                                                    row_lens, k) for i in range(sets)]
    guarded(row, "fi_table_copy_us", lambda: timed(lambda i: (lambda: fdec[i].indices.copy_(tables[i].view(-1)))))
    _, best = best_of(row, ("prr_serial_us", "prr_fused_us", "prr_split_us", "prr_radix_us"))
    row["prr_serial_over_fi"] = ratio(row.get("prr_serial_us"), row.get("fi_serial_us"))
    row["best_prr_over_fi"] = ratio(best, row.get("fi_serial_us"))
    row["best_prr_over_floor"] = ratio(best, row["floor_us"])
    row["fi_over_floor"] = ratio(row.get("fi_serial_us"), row["floor_us"])
    return row


def prr_row(batch: int, context: int, block: int, budget: int, repeats: int, bandwidth: float, workspace) -> dict:
    """PRR's attention stage at PRR_HIT_RATE beside serial DSA, per layer over `layers` layers of
    one graph (so reads miss L2): prr's graph engine (Quest, sink = recent = 0, P set from
    outside, this step's K/V already appended) against a FlashInfer-composed one on the same
    caches, metadata and queries, the paper's construction: FlashInfer's paged decode over P
    (with its lse) on a side stream while prr's quest_score and FlashInfer's
    top_k_page_table_transform select A on the main one; then A \\ P by torch ops (searchsorted in
    the sorted P, a sort that puts the misses first: static shapes, since the controlled hit
    rate leaves the same number of misses m in every row), FlashInfer's decode over those m
    pages and `merge_state`. FlashInfer serial: the stage part's composition."""
    import flashinfer
    import torch
    from prr.kernels.quest import quest_score

    from prr.benchmarking import configured, model_of
    from prr.blocks import controlled_predictions
    from prr.runtime.graph_decode import GraphDecoder, StaticPlan, metadata_bytes_per_block

    layers = 8 if batch == 1 else 2
    k, rows_n = budget // block, batch * HKV
    # The benchmarks' convention: a cache of `context` tokens holding context - HEADROOM, so its
    # block count (the width of the engine's score rows and top-k) stays a power of two.
    tokens = context - HEADROOM
    # conf/selector/quest.yaml's Quest with no forced block (nothing attended but the top-K), every layer sparse
    quest = configured("selector", "quest", topk_blocks=k, dense_layers=[], sink_blocks=0, force_newest=False)
    eng = GraphDecoder(model_of(layers), StaticPlan(variant="prr", predicted_blocks=k, block_size=block), batch=batch,
                       max_tokens=context, selector=quest, predictor=None)  # P set from outside
    eng.fill_random_context(tokens - 1, seed=1)  # this step's token at tokens - 1: `tokens` tokens, full blocks
    lengths, num_blocks = eng.step_positions()
    nb, pool = tokens // block, eng.keys[0].shape[2] // block  # blocks in the context, pages per (row, KV head)
    gen = torch.Generator(device="cuda").manual_seed(2)
    qs = [torch.randn(batch, HQ, D, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(layers)]
    meta = metadata_bytes_per_block("quest", torch.bfloat16, D)
    nbytes = stage_bytes(batch, tokens, budget, block, meta)
    row = dict(batch=batch, context=context, tokens=tokens, block_size=block, budget_tokens=budget, k_blocks=k,
               layers=layers,
               hit_rate=PRR_HIT_RATE, bytes=nbytes, floor_us=floor_us(nbytes, bandwidth))

    def engine(variant: str, **changes):
        view = eng.with_plan(variant=variant, **changes)

        def fn():
            outs = [view.attention(i, qs[i], None, None, (lengths, num_blocks), appended=True) for i in range(layers)]
            view.join()
            return outs
        return fn

    serial_out = engine("serial")()
    torch.cuda.synchronize()
    hgen = torch.Generator().manual_seed(3)
    preds = [controlled_predictions(eng.last_selection[i], PRR_HIT_RATE, nb, hgen) for i in range(layers)]
    for i, (idx, cnt) in enumerate(preds):
        eng.set_predictions(i, idx, cnt)
    misses = k - round(PRR_HIT_RATE * k)
    row["misses_per_row"] = misses

    kpages = [as_pages(eng.keys[i], block) for i in range(layers)]
    vpages = [as_pages(eng.values[i], block) for i in range(layers)]
    metas = [eng.selector.metadata(eng.cache, i) for i in range(layers)]
    src = page_ids(torch.arange(pool, dtype=torch.int32, device="cuda").expand(batch, HKV, pool), pool).view(rows_n, pool)
    row_lens = num_blocks.to(torch.int32).repeat_interleave(HKV)
    p_pages = [page_ids(idx, pool).view(rows_n, k).sort(-1).values for idx, _ in preds]
    dec_a = [FIDecode(workspace, rows_n, k, block, src[:, :k].reshape(-1), eng.scale, False) for _ in range(layers)]
    dec_p = [FIDecode(workspace, rows_n, k, block, p_pages[i].reshape(-1), eng.scale, False) for i in range(layers)]
    dec_r = [FIDecode(workspace, rows_n, misses, block, src[:, :misses].reshape(-1), eng.scale, False)
             for _ in range(layers)] if misses else []
    side = torch.cuda.Stream()

    def select_pages(i):
        scores = quest_score(qs[i], *metas[i], num_blocks)
        return flashinfer.top_k_page_table_transform(scores.view(rows_n, -1), src, row_lens, k)

    def fi_serial():
        outs = []
        for i in range(layers):
            dec_a[i].indices.copy_(select_pages(i).view(-1))
            outs.append(dec_a[i](qs[i], kpages[i], vpages[i]).view(batch, HQ, D))
        return outs

    def fi_prr():
        outs = []
        for i in range(layers):
            q = qs[i].view(rows_n, GROUP, D)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                spec_out, spec_lse = dec_p[i].wrapper.run(q, (kpages[i], vpages[i]), return_lse=True)
            table = select_pages(i)
            torch.cuda.current_stream().wait_stream(side)
            dec_r[i].indices.copy_(missed_pages(table, p_pages[i], misses).reshape(-1))
            rep_out, rep_lse = dec_r[i].wrapper.run(q, (kpages[i], vpages[i]), return_lse=True)
            outs.append(flashinfer.merge_state(spec_out, spec_lse, rep_out, rep_lse)[0].view(batch, HQ, D))
        return outs

    from prr.runtime.graph_budget import graph_median_us

    def per_layer(fn) -> float:
        return graph_median_us([fn], repeats) / layers

    ref = [o.float() for o in serial_out]
    row["max_abs_fi_serial_vs_engine"] = max(max_abs(a, b) for a, b in zip(fi_serial(), ref, strict=True))
    prr_out = engine("prr")()
    row["max_abs_engine_prr_vs_serial"] = max(max_abs(a, b) for a, b in zip(prr_out, ref, strict=True))
    # FlashInfer's decode returns one state over all of P, so its PRR keeps P's false positives:
    # it equals prr's superset mode (attention over P ∪ A), not serial DSA (prr's exact mode).
    superset = [o.float() for o in engine("prr", repair_mode="superset", fused_repair=False)()]
    row["max_abs_engine_superset_vs_serial"] = max(max_abs(a, b) for a, b in zip(superset, ref, strict=True))
    if misses:
        row["max_abs_fi_prr_vs_engine"] = max(max_abs(a, b) for a, b in zip(fi_prr(), superset, strict=True))
    guarded(row, "engine_serial_us", lambda: per_layer(engine("serial")))
    guarded(row, "engine_prr_us", lambda: per_layer(engine("prr")))
    guarded(row, "engine_superset_us", lambda: per_layer(engine("prr", repair_mode="superset", fused_repair=False)))
    guarded(row, "fi_serial_us", lambda: per_layer(fi_serial))
    if misses:
        guarded(row, "fi_prr_us", lambda: per_layer(fi_prr))
    row["engine_prr_over_fi_prr"] = ratio(row.get("engine_prr_us"), row.get("fi_prr_us"))
    row["engine_superset_over_fi_prr"] = ratio(row.get("engine_superset_us"), row.get("fi_prr_us"))
    row["engine_serial_over_fi_serial"] = ratio(row.get("engine_serial_us"), row.get("fi_serial_us"))
    torch.cuda.empty_cache()
    return row


def topk_rows(rows_n: int, n: int, k: int, sets: int, repeats: int, bandwidth: float,
              splits: tuple[int, ...] = (), radixes: tuple[int, ...] = (), filters: tuple[str, ...] = ()) -> dict:
    import flashinfer
    import torch
    from prr.kernels.topk import topk_select

    from prr.benchmarking import graph_time_us, randn

    batch = rows_n // HKV
    scores = [randn(batch, HKV, n, dtype=torch.float32) for _ in range(sets)]
    num_blocks = torch.full((batch,), n, dtype=torch.int32, device="cuda")
    src = torch.arange(n, dtype=torch.int32, device="cuda").expand(rows_n, n).contiguous()
    lens = torch.full((rows_n,), n, dtype=torch.int32, device="cuda")
    nbytes = topk_bytes(rows_n, n, k)
    row = dict(rows=rows_n, blocks=n, k=k, sets=sets, bytes=nbytes, floor_us=floor_us(nbytes, bandwidth),
               floor_nominal_us=floor_us(nbytes, NOMINAL_BANDWIDTH))
    idx, cnt = topk_select(scores[0], k, num_blocks, sink_blocks=0, recent_blocks=0)
    ref = torch.topk(scores[0], k, dim=-1).indices.sort(-1).values
    mine = idx.long().sort(-1).values
    _, fi_idx = flashinfer.top_k(scores[0].view(rows_n, n), k)
    fi_set = fi_idx.view(batch, HKV, k).sort(-1).values
    pt = flashinfer.top_k_page_table_transform(scores[0].view(rows_n, n), src, lens, k)
    pt_set = pt.long().view(batch, HKV, k).sort(-1).values
    row["prr_equals_torch"] = bool(torch.equal(mine, ref)) and bool((cnt == k).all())
    row["fi_equals_torch"] = bool(torch.equal(fi_set, ref))
    row["fi_page_table_equals_torch"] = bool(torch.equal(pt_set, ref))
    row["sets_equal"] = row["prr_equals_torch"] and row["fi_equals_torch"] and row["fi_page_table_equals_torch"]
    variants = topk_variants(list(splits), list(radixes), list(filters), k, n)
    for name, kw in variants:  # split rows, other radix bits, filter settings: the same output, bit for bit
        v_idx, v_cnt = topk_select(scores[0], k, num_blocks, sink_blocks=0, recent_blocks=0, **kw)
        row[f"{name}_equals_prr"] = bool(torch.equal(v_idx, idx)) and bool(torch.equal(v_cnt, cnt))
        row["sets_equal"] = row["sets_equal"] and row[f"{name}_equals_prr"]

    def timed(make):
        return graph_time_us(make, sets, repeats)
    guarded(row, "prr_us", lambda: timed(lambda i: (lambda: topk_select(scores[i], k, num_blocks, sink_blocks=0,
                                                                        recent_blocks=0))))
    guarded(row, "fi_top_k_us", lambda: timed(lambda i: (lambda: flashinfer.top_k(scores[i].view(rows_n, n), k))))
    guarded(row, "fi_page_table_us", lambda: timed(lambda i: (lambda: flashinfer.top_k_page_table_transform(
        scores[i].view(rows_n, n), src, lens, k))))
    guarded(row, "torch_topk_us", lambda: timed(lambda i: (lambda: torch.topk(scores[i], k, dim=-1))))
    for name, kw in variants:
        guarded(row, f"{name}_us", lambda kw=kw: timed(lambda i: (lambda: topk_select(
            scores[i], k, num_blocks, sink_blocks=0, recent_blocks=0, **kw))))
    for family, key in (("split", "split_chunk"), ("radix", "radix_bits"), ("filter", "filter_setting")):
        setting, row[f"{family}_us"] = best_variant(row, family)
        row[key] = setting if family == "filter" or setting is None else int(setting)
    _, fi = best_of(row, ("fi_top_k_us", "fi_page_table_us"))
    row["prr_over_best_fi"] = ratio(row.get("prr_us"), fi)
    return row


def write_outputs(record: dict, out: Path) -> str:
    """OUT.json (unchanged), OUT.csv (one row per measurement, part and command in each) and
    OUT.md from a run's record -> the markdown."""
    import pandas as pd

    frames = [pd.DataFrame(record[p]).assign(part=p) for p in PARTS if record.get(p)]
    if frames:
        frame = pd.concat(frames, ignore_index=True)
        frame.insert(0, "command", record["command"])
        frame.to_csv(out.with_suffix(".csv"), index=False)
    text = report(record)
    out.with_suffix(".md").write_text(text + "\n")
    return text


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report is not None:
        print(write_outputs(json.loads(args.report.read_text()), args.report.with_suffix("")))
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_flashinfer needs a CUDA GPU")
    from prr.benchmarking import copy_bandwidth, read_bandwidth

    env = environment()
    bw = copy_bandwidth() | read_bandwidth()
    bandwidth = max(bw.values())
    print(f"{env['gpu']} | torch {env['torch']} | triton {env['triton']} | flashinfer {env['flashinfer']} | "
          f"floor bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    record = {"command": "python " + " ".join([sys.argv[0].split("/.fi/src/")[-1], *sys.argv[1:]]),
              "environment": env, "bandwidth_GBps": bandwidth / 1e9,
              "bandwidths_GBps": {k: v / 1e9 for k, v in bw.items()}, "attention": [], "topk": [], "stage": [], "prr": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        args.out.with_suffix(".json").write_text(strict_json_dumps(record, indent=1) + "\n")

    gen = torch.Generator().manual_seed(0)
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    if "topk" in args.parts:
        for rows_n in args.topk_rows:
            for n in args.topk_blocks:
                for k in args.topk_k:
                    try:
                        row = topk_rows(rows_n, n, k, args.sets, args.repeats, bandwidth, tuple(args.topk_split),
                                        tuple(args.topk_radix), tuple(args.topk_filter))
                    except Exception as err:  # noqa: BLE001
                        row = dict(rows=rows_n, blocks=n, k=k, error=f"{type(err).__name__}: {err}"[:400])
                    record["topk"].append(row)
                    print(json.dumps(row), flush=True)
                    save()
    if {"attention", "stage"} & set(args.parts):
        for batch in args.batches:
            for context in args.contexts:
                sets = args.sets if batch == 1 else min(args.sets, 2)
                # enough sets that a graph's reads miss L2 (its selected K/V alone > L2_ROTATION_BYTES)
                sets = max(sets, math.ceil(L2_ROTATION_BYTES / attention_bytes(batch, min(args.budgets), min(args.blocks))))
                try:
                    att, stg = cell_rows(batch, context, args.blocks, args.budgets, sets, args.repeats, gen, bandwidth,
                                         args.parts, workspace, args.topk_split, args.topk_radix)
                except Exception as err:  # noqa: BLE001
                    att = [dict(batch=batch, context=context, block_size=0, budget_tokens=0,
                                error=f"{type(err).__name__}: {err}"[:400])]
                    stg = []
                    print(json.dumps(att[0]), flush=True)
                record["attention"].extend(att)
                record["stage"].extend(stg)
                save()
                torch.cuda.empty_cache()
    if "prr" in args.parts:
        for batch in args.batches:
            for context in args.contexts:
                for block in args.blocks:
                    for budget in args.budgets:
                        try:
                            row = prr_row(batch, context, block, budget, args.repeats, bandwidth, workspace)
                        except Exception as err:  # noqa: BLE001
                            row = dict(batch=batch, context=context, block_size=block, budget_tokens=budget,
                                       error=f"{type(err).__name__}: {err}"[:400])
                        record["prr"].append(row)
                        print(json.dumps(row), flush=True)
                        save()
                        torch.cuda.empty_cache()
    save()
    print("\n" + write_outputs(record, args.out))


if __name__ == "__main__":
    main()
