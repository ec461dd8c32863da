"""Hinted exact top-k (issue 53, item 1) beside prr's top-k, torch.topk and FlashInfer's radix top-k.

    python experiments/bench_hinted_topk.py [--quick] [--candidates 2048,8192,32768,131072] \
        [--k 32,256,2048] [--rows 1,8,64] [--hit-rates 0.6,0.7,0.8] [--sets 4] [--repeats 20] \
        [--device cuda|cpu] [--out experiments/results/h200/bench_hinted_topk]

For every cell (rows = batch x KV heads, candidates N, k < N, hit rate h):
- scores: `prr.kernels.reference_hinted_topk.make_hinted_scores` draws a previous step's scores and
  the current one's per row as correlated Gaussians (current = sqrt(1 - rho^2) fresh + rho previous),
  rho found by bisection so that the previous top-k holds a fraction h of the current top-k (the
  hit rate real predictors reach on Qwen: 0.6-0.8); the measured mean overlap is in each row of the
  results. Fresh draws per timing set.
- hinted: `prr.kernels.hinted_topk.hinted_topk_select` with the previous step's k-th score per row as
  the hint (what selector.hinted_topk keeps), writing the next hint aside (next_hint) so that
  every replay starts from the same guess; also with the current k-th score as the hint (the
  oracle: the best any guess does); and with GVR's other guess, the smallest current score over the
  previous step's top-k ids (P = the last A: at least k scores are >= it), its gather and min timed
  with the kernel. The rows whose candidates fit the buffer, and the rounds they ran, are recorded
  (the `path` output, outside the timing).
- prr: `prr.kernels.topk.topk_select`, the function the selectors call today (one program per row
  up to 16384 candidates, the multi-program radix select above: bench_topk_long.py compares the
  two), same arguments; the hinted kernel likewise takes the multi-program path above 16384; torch.topk; FlashInfer's `flashinfer.top_k` (radix)
  when importable, else "not installed" (bench_flashinfer.py's docstring says how its wheels are
  carried to the GPU machine). No forced blocks (FlashInfer's top-k has none): sink = recent = 0.

Correctness first, per cell: the hinted indices and counts equal topk_select's bit for bit on
every set (the sets are the same), prr's set equals torch.topk's (sorted ids), FlashInfer's too, the
hinted next hint equals the current k-th score. A cell that fails any is kept with its flags and
marked in the table (sets_equal).

Timing (as bench_flashinfer.py): `--sets` different input sets (more where needed so one graph reads
at least 128 MiB of scores: the H200's L2 is 50 MB) captured in one CUDA graph, median replay over
`--repeats`, / sets. Floor: the fp32 scores read once + int32 indices written (+ 8 bytes of hints per
row for the hinted kernel, negligible) / the best copy or read bandwidth measured in the same run.
--device cpu (no CUDA; under TRITON_INTERPRET=1): the same checks, host wall-clock medians that
time the interpreter and mean nothing: for checking that the script runs end to end (--quick).

Writes OUT.json (command, GPU, driver, versions, date, bandwidths, every row), OUT.csv and OUT.md;
prints the short table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from prr.bench_args import (
    TOPK_KV_HEADS,
    OneLineParser,
    bench_command,
    fill_grid_defaults,
    guarded,
    host_time_us,
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
FULL_GRID = dict(candidates=[2048, 8192, 32768, 131072], k=[32, 256, 2048], rows=[1, 8, 64],
                 hit_rates=[0.6, 0.7, 0.8])
QUICK_GRID = dict(candidates=[2048], k=[32], rows=[1, 8], hit_rates=[0.7])
NOT_INSTALLED = "not installed"


# --- arguments, floors and tables: pure python (tests/test_bench_hinted_topk.py) ---------------------



def rate_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every hit rate must be in [0, 1]")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"a tiny grid: {QUICK_GRID}")
    parser.add_argument("--candidates", type=int_list, default=None, help="candidates per row (blocks or tokens)")
    parser.add_argument("--k", type=int_list, default=None, help="top-k; cells with k >= candidates are skipped")
    parser.add_argument("--rows", type=int_list, default=None, help=f"rows = batch x KV heads: < {TOPK_KV_HEADS}, or a multiple")
    parser.add_argument("--hit-rates", type=rate_list, default=None,
                        help="overlap of the previous step's top-k with the current one's")
    parser.add_argument("--sets", type=int, default=4, help="input sets per timing graph (at least; L2 rotation)")
    parser.add_argument("--repeats", type=int, default=20, help="graph replays (the median is reported)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the checks and host timings (meaningless under TRITON_INTERPRET=1)")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/h200/bench_hinted_topk"),
                        help="results prefix: OUT.json, OUT.csv, OUT.md")
    args = parser.parse_args(argv)
    fill_grid_defaults(args, QUICK_GRID if args.quick else FULL_GRID)
    problems = check_args(args)
    if problems:
        parser.error("; ".join(problems))
    return args


def check_args(args: argparse.Namespace) -> list[str]:
    problems = topk_rows_problems(args.rows)
    if not cells(args):
        problems.append(f"--k {args.k} --candidates {args.candidates}: no cell has k < candidates")
    problems += timing_count_problems(args)
    return problems


def cells(args: argparse.Namespace) -> list[tuple[int, int, int, float]]:
    """(rows, candidates, k, hit rate) of the grid, k < candidates only."""
    return [(r, n, k, h) for r in args.rows for n in args.candidates for k in args.k if k < n for h in args.hit_rates]






def timing_sets(rows: int, n: int, sets: int) -> int:
    """Sets per graph for rows x n fp32 scores (rotation_sets)."""
    return rotation_sets(rows * n * 4, sets, MAX_SETS)






def table(rows: list[dict]) -> str:
    header = ["rows", "candidates", "k", "hit rate", "fit", "hinted µs", "oracle-hint µs", "P-min-hint µs", "prr µs",
              "hinted / prr",
              "torch.topk µs", "FlashInfer µs", "hinted / FlashInfer", "floor µs", "sets equal"]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["rows"], r["candidates"], r["k"], r["hit_rate"], *["—"] * 10, r["error"][:60]])
            continue
        fi = r.get("flashinfer_us", NOT_INSTALLED) if r.get("flashinfer") != NOT_INSTALLED else NOT_INSTALLED
        body.append([r["rows"], r["candidates"], r["k"], r["measured_overlap"], r["fit_fraction"], r.get("hinted_us"),
                     r.get("hinted_oracle_us"), r.get("hinted_pmin_us"), r.get("prr_us"),
                     ratio(r.get("hinted_us"), r.get("prr_us")),
                     r.get("torch_topk_us"), fi,
                     ratio(r.get("hinted_us"), r.get("flashinfer_us")) if fi != NOT_INSTALLED else NOT_INSTALLED,
                     r.get("floor_us"), r["sets_equal"]])
    return markdown(header, body)


def report(record: dict) -> str:
    env = record.get("environment", {})
    floor = record.get("bandwidth_GBps")
    out = ["# Hinted exact top-k beside prr's top-k, torch.topk and FlashInfer (issue 53, item 1)", "",
           f"Command: `{record.get('command', '')}`", "",
           f"{env.get('gpu', '?')}, driver {env.get('driver', '?')}, torch {env.get('torch', '?')}, "
           f"triton {env.get('triton', '?')}, flashinfer {env.get('flashinfer', '?')}, CUDA {env.get('cuda', '?')}, "
           f"{env.get('date', '?')}; timer {record.get('timer', '?')}"
           + (f"; floor bandwidth {floor:.0f} GB/s (measured)." if floor else "."), "",
           "µs per call (median over graph replays / sets). hit rate: the measured overlap of the previous "
           "step's top-k with the current one's; fit: the fraction of rows whose candidates above the "
           "corrected guess fit the buffer (the others fell back to the full row); oracle hint: the current "
           "k-th score as the guess; P-min hint: the smallest current score over the previous top-k (its gather "
           "and min included).", "", table(record.get("rows", [])), ""]
    return "\n".join(out)


def write_outputs(record: dict, out: Path) -> str:
    """OUT.json, OUT.csv (one row per cell, the command in each), OUT.md -> the markdown."""
    return write_bench_outputs(record, out, report)


# --- measurement ---------------------------------------------------------------------------------

def flashinfer_module():
    """flashinfer, or None where it does not import (it is optional)."""
    try:
        import flashinfer
    except ImportError:
        return None
    return flashinfer


def cell_row(rows: int, n: int, k: int, hit_rate: float, sets: int, repeats: int, device: str,
             bandwidth: float | None, seed: int) -> dict:
    import torch
    from prr.kernels.hinted_topk import hinted_topk_select
    from prr.kernels.reference_hinted_topk import kth_scores, make_hinted_scores, topk_overlap
    from prr.kernels.topk import topk_select

    from prr.benchmarking import graph_time_us

    batch, heads = row_shape(rows)
    sets = timing_sets(rows, n, sets) if device == "cuda" else sets
    previous, current = zip(*(make_hinted_scores(batch, heads, n, k, hit_rate, seed=seed + i, device=device)
                              for i in range(sets)), strict=True)
    hints = [kth_scores(p, k) for p in previous]  # the previous step's k-th score per row
    predicted = [p.topk(k, dim=-1).indices for p in previous]  # P: the previous step's top-k ids [B, Hkv, k]
    oracle = [kth_scores(c, k) for c in current]
    overlap = statistics.mean(topk_overlap(p, c, k).mean().item() for p, c in zip(previous, current, strict=True))
    del previous
    num_blocks = torch.full((batch,), n, dtype=torch.int32, device=device)
    next_hint = torch.empty(batch, heads, device=device)
    nbytes = topk_bytes(rows, n, k)
    row = dict(rows=rows, batch=batch, kv_heads=heads, candidates=n, k=k, hit_rate=hit_rate,
               measured_overlap=overlap, sets=sets, bytes=nbytes,
               floor_us=None if bandwidth is None else nbytes / bandwidth * 1e6)

    # correctness first: every set, bit for bit against topk_select; set 0 against torch.topk / FlashInfer
    equal = True
    path = torch.empty(batch, heads, dtype=torch.int32, device=device)
    paths, pmin_paths = [], []
    for i in range(sets):
        h_idx, h_cnt = hinted_topk_select(current[i], k, num_blocks, hints[i], 0, 0, next_hint=next_hint, path=path)
        p_idx, p_cnt = topk_select(current[i], k, num_blocks, sink_blocks=0, recent_blocks=0)
        equal &= bool(torch.equal(h_idx, p_idx)) and bool(torch.equal(h_cnt, p_cnt))
        equal &= bool(torch.equal(next_hint, oracle[i]))
        paths.append(path.clone())
        m_idx, m_cnt = hinted_topk_select(current[i], k, num_blocks, p_min_hint(current[i], predicted[i]), 0, 0,
                                          next_hint=next_hint, path=path)
        equal &= bool(torch.equal(m_idx, p_idx)) and bool(torch.equal(m_cnt, p_cnt))
        pmin_paths.append(path.clone())
    row["hinted_equals_prr"] = equal
    ref = torch.topk(current[0], k, dim=-1).indices.sort(-1).values
    idx0, cnt0 = topk_select(current[0], k, num_blocks, sink_blocks=0, recent_blocks=0)
    row["prr_equals_torch"] = bool(torch.equal(idx0.long().sort(-1).values, ref)) and bool((cnt0 == k).all())
    paths = torch.stack(paths).float()
    row["fit_fraction"] = (paths >= 0).float().mean().item()
    row["mean_rounds_when_fit"] = paths[paths >= 0].mean().item() if (paths >= 0).any() else None
    pmin_paths = torch.stack(pmin_paths)
    row["pmin_fit_fraction"] = (pmin_paths >= 0).float().mean().item()
    fi = flashinfer_module()
    row["flashinfer"] = NOT_INSTALLED if fi is None or device != "cuda" else fi.__version__
    if row["flashinfer"] != NOT_INSTALLED:
        _, fi_idx = fi.top_k(current[0].view(rows, n), k)
        row["flashinfer_equals_torch"] = bool(torch.equal(fi_idx.view(batch, heads, k).long().sort(-1).values, ref))
    row["sets_equal"] = row["hinted_equals_prr"] and row["prr_equals_torch"] and row.get("flashinfer_equals_torch", True)

    def timed(make_call) -> float:
        if device == "cuda":
            return graph_time_us(make_call, sets, repeats)
        return host_time_us(make_call, sets, repeats)

    guarded(row, "hinted_us", lambda: timed(lambda i: (lambda: hinted_topk_select(
        current[i], k, num_blocks, hints[i], 0, 0, next_hint=next_hint))))
    guarded(row, "hinted_oracle_us", lambda: timed(lambda i: (lambda: hinted_topk_select(
        current[i], k, num_blocks, oracle[i], 0, 0, next_hint=next_hint))))
    guarded(row, "hinted_pmin_us", lambda: timed(lambda i: (lambda: hinted_topk_select(
        current[i], k, num_blocks, p_min_hint(current[i], predicted[i]), 0, 0, next_hint=next_hint))))
    guarded(row, "prr_us", lambda: timed(lambda i: (lambda: topk_select(current[i], k, num_blocks, sink_blocks=0,
                                                                         recent_blocks=0))))
    guarded(row, "torch_topk_us", lambda: timed(lambda i: (lambda: torch.topk(current[i], k, dim=-1))))
    if row["flashinfer"] != NOT_INSTALLED:
        guarded(row, "flashinfer_us", lambda: timed(lambda i: (lambda: fi.top_k(current[i].view(rows, n), k))))
    row["hinted_over_prr"] = ratio(row.get("hinted_us"), row.get("prr_us"))
    row["hinted_over_flashinfer"] = ratio(row.get("hinted_us"), row.get("flashinfer_us"))
    return row


def p_min_hint(scores, predicted):
    """GVR's guess from a predicted set: scores [B, Hkv, N], predicted [B, Hkv, k] ids -> [B, Hkv] the
    smallest current score over them (at least k scores are >= it)."""
    import torch

    return torch.gather(scores, -1, predicted).amin(-1)


def environment(device: str) -> dict:
    import torch
    import triton

    fi = flashinfer_module()
    version = NOT_INSTALLED if fi is None else fi.__version__
    if device == "cuda":
        from prr.benchmarking import environment as base

        return {**base(), "flashinfer": version}
    import datetime
    import platform

    return {"gpu": f"none (CPU: {platform.processor() or platform.machine()})", "driver": "—",
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda, "flashinfer": version,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import os

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_hinted_topk: no CUDA GPU here; pass --device cpu (under TRITON_INTERPRET=1: checks only, "
                 "timings meaningless)")
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if args.device == "cpu" and not interpreted:
        sys.exit("bench_hinted_topk --device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1")
    if args.device == "cuda" and interpreted:
        sys.exit("bench_hinted_topk --device cuda times compiled kernels: unset TRITON_INTERPRET (or set it to 0)")
    env = environment(args.device)
    bandwidth = None
    bandwidths = {}
    if args.device == "cuda":
        from prr.benchmarking import copy_bandwidth, read_bandwidth

        bandwidths = copy_bandwidth() | read_bandwidth()
        bandwidth = max(bandwidths.values())
    print(f"{env['gpu']} | torch {env['torch']} | triton {env['triton']} | flashinfer {env['flashinfer']}"
          + (f" | floor bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else ""), flush=True)
    record = {"command": bench_command("experiments/bench_hinted_topk.py", argv),
              "environment": env, "timer": "cuda_graph_replay" if args.device == "cuda" else
              "cpu_wall_clock (TRITON_INTERPRET=1: times the interpreter, not the kernels)",
              "bandwidth_GBps": None if bandwidth is None else bandwidth / 1e9,
              "bandwidths_GBps": {key: v / 1e9 for key, v in bandwidths.items()}, "rows": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for index, (rows, n, k, rate) in enumerate(cells(args)):
        record_cell(record, args.out, write_outputs, dict(rows=rows, candidates=n, k=k, hit_rate=rate),
                    cell_row, rows, n, k, rate, args.sets, args.repeats, args.device, bandwidth, seed=1000 * index)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print("\n" + write_outputs(record, args.out))


if __name__ == "__main__":
    main()
