"""Top-k over long rows (issue 52, item 2): prr's one-program path, its multi-program path and torch.topk.

    python experiments/bench_topk_long.py [--candidates 8192,16384,32768,131072,1048576] [--k 32,256,2048]
        [--rows 1,8,64] [--sets 4] [--repeats 20] [--chunk 4096] [--cap 4096] [--finish]
        [--out experiments/results/h100/bench_topk_long]

For every cell (rows = batch x KV heads, candidates N, k < N), fp32 scores drawn from a normal
distribution (`make_topk_scores`, kind randn), every block in context, no forced blocks
(torch.topk has none: sink = recent = 0):
- one-program: `topk_select(..., multi_program=False)`, the path every row took before (one program
  per row: the row in registers up to MAX_ROW_BLOCK = 16384, the tiled kernel beyond);
- multi-program: `topk_select(..., multi_program=True)` (kernels/topk_radix_jit.py), with --chunk /
  --cap when given (else the launcher's defaults; the row records the ones used), and how each row found its threshold (its
  `multi_program_path`: candidates at level 2/3/4, or all histograms);
- finish (--finish): the multi-program path with `multi_program_finish=True` (2 launches: a memset and
  level 1, whose last program of a row finishes the row alone) beside it, same chunk and cap, timed
  in the same run; its indices, counts and threshold paths must equal the multi-program path's;
- auto: which of the two `topk_select`'s rule (multi_program=None, what the selectors call) takes;
- torch.topk(scores, k, dim=-1).
Correctness first, per cell and set: the multi-program indices and counts equal the one-program ones
bit for bit (with --finish, the finish path's too, and its threshold paths the multi-program path's),
and set 0's selected ids equal torch.topk's (sorted; distinct scores). A cell that fails
is kept, marked in the table (sets_equal = NO).

Timing (as bench_hinted_topk.py): `--sets` input sets (more where needed so that one graph reads at
least 128 MiB of scores, 2.5x the L2) captured in one CUDA graph, median replay over `--repeats`, /
sets. Floor: the fp32 scores read once + int32 indices written (a row of 128K fp32 is 512 KB) / the
best copy or read bandwidth measured in the same run. Needs a CUDA GPU: elsewhere it refuses in one
line (exit 2).

Writes OUT.json (command, GPU, driver, versions, date, bandwidths, every row), OUT.csv and OUT.md;
prints the short table last.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from prr.bench_args import (
    TOPK_KV_HEADS,
    OneLineParser,
    bench_command,
    guarded,
    int_list,
    markdown,
    ratio,
    record_cell,
    rotation_sets,
    timing_count_problems,
    topk_bytes,
    topk_rows_problems,
    write_bench_outputs,
)
from prr.bench_args import topk_row_shape as row_shape

MAX_SETS = 64
GRID = dict(candidates=[8192, 16384, 32768, 131072, 1 << 20], k=[32, 256, 2048], rows=[1, 8, 64])


# --- arguments, floors and tables: pure python (tests/test_bench_topk_long.py) ----------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__.split("\n")[0])
    parser.add_argument("--candidates", type=int_list, default=GRID["candidates"], help="candidates per row")
    parser.add_argument("--k", type=int_list, default=GRID["k"], help="top-k; cells with k >= candidates are skipped")
    parser.add_argument("--rows", type=int_list, default=GRID["rows"], help=f"rows = batch x KV heads: < {TOPK_KV_HEADS}, or a multiple")
    parser.add_argument("--sets", type=int, default=4, help="input sets per timing graph (at least; L2 rotation)")
    parser.add_argument("--repeats", type=int, default=20, help="graph replays (the median is reported)")
    parser.add_argument("--chunk", type=int, default=None, help="blocks per program of the multi-program path")
    parser.add_argument("--cap", type=int, default=None, help="candidate buffer of the multi-program path")
    parser.add_argument("--finish", action="store_true",
                        help="also time the multi-program path with multi_program_finish=True (2 launches)")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/h100/bench_topk_long"),
                        help="results prefix: OUT.json, OUT.csv, OUT.md")
    args = parser.parse_args(argv)
    problems = check_args(args)
    if problems:
        parser.error("; ".join(problems))
    return args


def check_args(args: argparse.Namespace) -> list[str]:
    problems = topk_rows_problems(args.rows)
    if not cells(args):
        problems.append(f"--k {args.k} --candidates {args.candidates}: no cell has k < candidates")
    problems += timing_count_problems(args)
    for name in ("chunk", "cap"):
        value = getattr(args, name)
        if value is not None and (value < 16 or value & (value - 1)):
            problems.append(f"--{name}={value} must be a power of two >= 16")
    return problems


def cells(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """(rows, candidates, k) of the grid, k < candidates only."""
    return [(r, n, k) for r in args.rows for n in args.candidates for k in args.k if k < n]






def timing_sets(rows: int, n: int, sets: int) -> int:
    """Sets per graph for rows x n fp32 scores (rotation_sets)."""
    return rotation_sets(rows * n * 4, sets, MAX_SETS)




def table(rows: list[dict]) -> str:
    header = ["rows", "candidates", "k", "auto path", "one-program µs", "multi-program µs", "torch.topk µs",
              "multi / torch", "multi / one", "floor µs", "multi / floor", "finish µs", "finish / multi",
              "threshold found at", "sets equal"]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["rows"], r["candidates"], r["k"], *["—"] * 11, r["error"][:60]])
            continue
        body.append([r["rows"], r["candidates"], r["k"], r["auto_path"], r.get("one_program_us"),
                     r.get("multi_program_us"), r.get("torch_topk_us"), r.get("multi_over_torch"),
                     r.get("multi_over_one"), r.get("floor_us"), ratio(r.get("multi_program_us"), r.get("floor_us")),
                     r.get("finish_us"), r.get("finish_over_multi"), r.get("threshold_found_at"), r["sets_equal"]])
    return markdown(header, body)


def report(record: dict) -> str:
    env = record.get("environment", {})
    floor = record.get("bandwidth_GBps")
    out = ["# Top-k over long rows: one-program, multi-program and torch.topk (issue 52, item 2)", "",
           f"Command: `{record.get('command', '')}`", "",
           f"{env.get('gpu', '?')}, driver {env.get('driver', '?')}, torch {env.get('torch', '?')}, "
           f"triton {env.get('triton', '?')}, CUDA {env.get('cuda', '?')}, {env.get('date', '?')}; "
           f"timer {record.get('timer', '?')}" + (f"; floor bandwidth {floor:.0f} GB/s (measured)." if floor else "."),
           "",
           "µs per call (median over graph replays / sets). auto path: what topk_select takes with "
           "multi_program=None. floor: fp32 scores read once + int32 indices written, at the measured bandwidth. "
           "threshold found at: rows by how the multi-program path found T (candidates compacted at level "
           "2/3/4; 'hist' = all four histograms, heavy ties). finish (--finish): the multi-program path with "
           "multi_program_finish=True (a memset and level 1, whose last program of a row finishes it); "
           "'-' where not run.", "", table(record.get("rows", [])), ""]
    return "\n".join(out)


def write_outputs(record: dict, out: Path) -> str:
    """OUT.json, OUT.csv (one row per cell, the command in each), OUT.md -> the markdown."""
    return write_bench_outputs(record, out, report)


def describe_paths(counts: dict[int, int]) -> str:
    """{path: rows} (multi_program_path values) -> e.g. 'level 3: 8, hist: 0'."""
    names = {2: "level 2", 3: "level 3", 4: "level 4", -1: "hist", 0: "none"}
    return ", ".join(f"{names.get(p, p)}: {c}" for p, c in sorted(counts.items(), key=lambda x: -x[1]))


# --- measurement (CUDA) --------------------------------------------------------------------------


def cell_row(rows: int, n: int, k: int, sets: int, repeats: int, chunk: int | None, cap: int | None,
             bandwidth: float, seed: int, finish: bool = False) -> dict:
    import torch
    from prr.kernels.reference_selection import make_topk_scores
    from prr.kernels.topk import (
        MULTI_PROGRAM_CAP,
        MULTI_PROGRAM_MIN_BLOCKS,
        multi_program_chunk_for,
        topk_select,
    )

    from prr.benchmarking import graph_time_us

    batch, heads = row_shape(rows)
    sets = timing_sets(rows, n, sets)
    scores = [make_topk_scores(batch, heads, n, None, "randn", seed=seed + i, device="cuda")[0] for i in range(sets)]
    num_blocks = torch.full((batch,), n, dtype=torch.int32, device="cuda")
    knobs = dict(multi_program_chunk=chunk, multi_program_cap=cap)
    nbytes = topk_bytes(rows, n, k)
    row = dict(rows=rows, batch=batch, kv_heads=heads, candidates=n, k=k, sets=sets, bytes=nbytes,
               floor_us=nbytes / bandwidth * 1e6, chunk=chunk or multi_program_chunk_for(rows, n),
               cap=cap or MULTI_PROGRAM_CAP,
               auto_path="multi-program" if n >= MULTI_PROGRAM_MIN_BLOCKS else "one-program")

    equal = True
    finish_equal = True
    path = torch.empty(batch, heads, dtype=torch.int32, device="cuda")
    finish_path = torch.empty_like(path)
    found: dict[int, int] = {}
    for s in scores:
        m_idx, m_cnt = topk_select(s, k, num_blocks, 0, 0, multi_program=True, multi_program_path=path, **knobs)
        o_idx, o_cnt = topk_select(s, k, num_blocks, 0, 0, multi_program=False)
        equal &= bool(torch.equal(m_idx, o_idx)) and bool(torch.equal(m_cnt, o_cnt))
        if finish:
            f_idx, f_cnt = topk_select(s, k, num_blocks, 0, 0, multi_program=True, multi_program_path=finish_path,
                                       multi_program_finish=True, **knobs)
            finish_equal &= bool(torch.equal(f_idx, o_idx)) and bool(torch.equal(f_cnt, o_cnt)) \
                and bool(torch.equal(finish_path, path))
        for p, c in zip(*torch.unique(path, return_counts=True), strict=True):
            found[int(p)] = found.get(int(p), 0) + int(c)
    row["multi_equals_one"] = equal
    if finish:
        row["finish_equals_multi"] = finish_equal
    ref = torch.topk(scores[0], k, dim=-1).indices.sort(-1).values
    idx0, cnt0 = topk_select(scores[0], k, num_blocks, 0, 0, multi_program=True, **knobs)
    row["multi_equals_torch"] = bool(torch.equal(idx0.long(), ref)) and bool((cnt0 == k).all())
    row["sets_equal"] = row["multi_equals_one"] and row["multi_equals_torch"] and row.get("finish_equals_multi", True)
    row["threshold_found_at"] = describe_paths(found)

    guarded(row, "one_program_us", lambda: graph_time_us(
        lambda i: (lambda: topk_select(scores[i], k, num_blocks, 0, 0, multi_program=False)), sets, repeats))
    guarded(row, "multi_program_us", lambda: graph_time_us(
        lambda i: (lambda: topk_select(scores[i], k, num_blocks, 0, 0, multi_program=True, **knobs)), sets, repeats))
    guarded(row, "torch_topk_us", lambda: graph_time_us(
        lambda i: (lambda: torch.topk(scores[i], k, dim=-1)), sets, repeats))
    if finish:
        guarded(row, "finish_us", lambda: graph_time_us(
            lambda i: (lambda: topk_select(scores[i], k, num_blocks, 0, 0, multi_program=True,
                                           multi_program_finish=True, **knobs)), sets, repeats))
        row["finish_over_multi"] = ratio(row.get("finish_us"), row.get("multi_program_us"))
    row["multi_over_torch"] = ratio(row.get("multi_program_us"), row.get("torch_topk_us"))
    row["multi_over_one"] = ratio(row.get("multi_program_us"), row.get("one_program_us"))
    return row


def refusal() -> str | None:
    """Why this machine cannot run the benchmark (one line), or None."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "bench_topk_long: TRITON_INTERPRET is set; this benchmark times compiled kernels on a CUDA GPU: unset it"
    try:
        import torch
    except ImportError:
        return "bench_topk_long: torch is not installed; this benchmark needs torch with CUDA and a GPU"
    if not torch.cuda.is_available():
        return "bench_topk_long: no CUDA GPU here; run it on a machine with one (the lead's GPU run)"
    return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    reason = refusal()
    if reason:
        print(reason, file=sys.stderr)
        sys.exit(2)
    import torch

    from prr.benchmarking import announce_gpu, graph_bench_record

    env, bandwidths, bandwidth = announce_gpu()
    record = graph_bench_record(bench_command("experiments/bench_topk_long.py", argv), env, bandwidths)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for index, (rows, n, k) in enumerate(cells(args)):
        record_cell(record, args.out, write_outputs, dict(rows=rows, candidates=n, k=k),
                    cell_row, rows, n, k, args.sets, args.repeats, args.chunk, args.cap, bandwidth, seed=1000 * index,
                    finish=args.finish)
        torch.cuda.empty_cache()
    print("\n" + write_outputs(record, args.out))


if __name__ == "__main__":
    main()
