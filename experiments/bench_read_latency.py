"""What stops a batch-1 stage short of its byte floor: one launch reading S bytes, and chains of launches.

    python experiments/bench_read_latency.py [--out experiments/results/h200/bench_read_latency]

Issue 21 (part 2) asks for serial DSA's attention stage at batch 1 within 2x its byte floor
(bytes / the best measured bandwidth). At batch 1 that stage moves 2-17 MB, where a GPU does
not reach its large-transfer bandwidth. This script measures, with the timing every prr
benchmark uses (calls captured in one CUDA graph, median replay / calls, the inputs of
consecutive calls in different buffers so reads miss L2):

- read: one launch of a streaming read (each program loads BLOCK bf16 values and writes one
  fp32 partial sum, < 0.1% of the bytes) over S bytes, S = 256 KiB .. 1 GiB; the best of
  BLOCK x num_warps x {one tile per program, a persistent grid of 4 programs per SM}.
  -> the effective bandwidth at each size, and the fixed cost of a launch that reads.
- chain: n dependent launches of a one-element kernel per call, n = 1 .. 32 -> a + b n.
- stage: for each batch-1 cell of bench_flashinfer.py's serial Quest stage (8B shape: Quest
  metadata of every block, then K/V of the selected blocks), the best read kernel over those
  bytes in one launch ("fused"), in two dependent launches (metadata, then K/V: a perfect
  score and a perfect attention), and in the serial stage's four (score, top-k, attention,
  merge: the two reads with a one-element launch after each) -> each over the byte floor.
  What bench_flashinfer.py measures for the real stage is read against these.

Writes OUT.json (command, GPU, versions, date, every row), OUT.csv, OUT.md; prints the tables.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from prr.paths import strict_json_dumps

ROOT = Path(__file__).resolve().parents[1]
KIB = 1 << 10
SIZES = [256 * KIB << i for i in range(13)]  # 256 KiB .. 1 GiB
CHAIN = [1, 2, 4, 8, 16, 32]
L2_FLUSH_BYTES = 512 << 20  # a graph's buffers together: ~10x the H200's 50 MB L2
STAGE_CELLS = [(c, b, k) for c in (32768, 131072) for b in (16, 64) for k in (2048, 8192)]  # context, block, budget


def flashinfer_bench():
    """experiments/bench_flashinfer.py as a module: its stage byte count is the one this script reads."""
    spec = importlib.util.spec_from_file_location("bench_flashinfer", ROOT / "experiments" / "bench_flashinfer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv: list[str] | None = None):
    parser = flashinfer_bench().OneLineParser(prog="bench_read_latency", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/h200/bench_read_latency")
    parser.add_argument("--repeats", type=int, default=20, help="graph replays per timing (median)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} must be >= 1")
    return args


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (a, b) of y = a + b x."""
    import numpy as np

    b, a = np.polyfit(xs, ys, 1)
    return float(a), float(b)


def stage_split(bf, context: int, block: int, budget: int, meta_per_block: int) -> tuple[int, int]:
    """-> (metadata bytes, K/V bytes) of bench_flashinfer's batch-1 serial stage (bf: that module):
    the Quest metadata of every block, then the rest of its stage bytes (K/V of A, q, output, ids)."""
    meta = bf.HKV * (context // block) * meta_per_block
    return meta, bf.stage_bytes(1, context, budget, block, meta_per_block) - meta


def markdown(header: list[str], body: list[list]) -> str:
    def cell(x):
        return f"{x:.3g}" if isinstance(x, float) else str(x)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cell(x) for x in row) + " |" for row in body])


def report(record: dict) -> str:
    env = record["environment"]
    a, b = record["chain_fit_us"]
    out = ["# One launch reading S bytes, chains of launches, and the batch-1 stage's reachable floor", "",
           f"Command: `{record['command']}`", "",
           f"{env['gpu']}, driver {env['driver']}, torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, "
           f"{env['date']}; floor bandwidth {record['bandwidth_GBps']:.0f} GB/s (best large read or copy).", "",
           "## One launch reading S bytes", "",
           markdown(["bytes", "µs", "GB/s", "over floor", "best kernel"],
                    [[r["bytes"], r["us"], r["GBps"], r["over_floor"], r["kernel"]] for r in record["read"]]), "",
           "## n dependent one-element launches per call", "",
           markdown(["n", "µs per call"], [[r["n"], r["us"]] for r in record["chain"]]), "",
           f"Fit: {a:.2f} + {b:.2f} n µs.", "",
           "## The batch-1 serial Quest stage's bytes read by perfect kernels (8B shape)", "",
           markdown(["ctx", "block", "budget", "metadata bytes", "K/V bytes", "floor µs", "1 launch µs",
                     "2 launches µs", "4 launches µs", "1 launch / floor", "2 / floor", "4 / floor"],
                    [[r["context"], r["block_size"], r["budget_tokens"], r["meta_bytes"], r["kv_bytes"], r["floor_us"],
                      r["fused_us"], r["two_launch_us"], r["four_launch_us"], r["fused_over_floor"],
                      r["two_over_floor"], r["four_over_floor"]] for r in record["stage"]])]
    return "\n".join(out)


# --- GPU ------------------------------------------------------------------------------------------

def kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def read_tiles(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + pid, tl.sum(x.to(tl.float32), 0))

    @triton.jit
    def read_persistent(x_ptr, out_ptr, n, tiles, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for t in range(pid, tiles, tl.num_programs(0)):
            offs = t * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc, 0))

    @triton.jit
    def bump(x_ptr):
        tl.store(x_ptr, tl.load(x_ptr) + 1)

    return read_tiles, read_persistent, bump


def read_calls(buffers, out, block: int, warps: int, persistent: bool, sms: int, kern):
    """One zero-arg call per buffer: the read kernel over it."""
    import triton

    read_tiles, read_persistent, _ = kern
    calls = []
    for x in buffers:
        n = x.numel()
        tiles = triton.cdiv(n, block)
        if persistent:
            grid = min(tiles, 4 * sms)
            calls.append(lambda x=x, n=n, t=tiles, g=grid: read_persistent[(g,)](x, out, n, t, BLOCK=block,
                                                                                num_warps=warps))
        else:
            calls.append(lambda x=x, n=n, t=tiles: read_tiles[(t,)](x, out, n, BLOCK=block, num_warps=warps))
    return calls


CONFIGS = [(block, warps, persistent) for block in (2048, 4096, 8192, 16384) for warps in (4, 8)
           for persistent in (False, True)]


def best_read(nbytes_list: list[int], repeats: int, sms: int, kern, extra=None) -> tuple[float, str]:
    """Best µs per call over CONFIGS of one call = the reads of nbytes_list in order (dependent
    launches on one stream), each followed by extra() when given; buffers rotate over calls so
    their reads miss L2."""
    import torch

    from prr.runtime.graph_budget import graph_median_us

    total = sum(nbytes_list)
    count = max(2, -(-L2_FLUSH_BYTES // total))
    sets = [[torch.ones(b // 2, dtype=torch.bfloat16, device="cuda") for b in nbytes_list] for _ in range(count)]
    out = torch.empty(1 << 20, dtype=torch.float32, device="cuda")
    best, name = float("inf"), ""
    for block, warps, persistent in CONFIGS:
        if max(nbytes_list) // 2 < block:
            continue
        per_set = [read_calls(bufs, out, block, warps, persistent, sms, kern) for bufs in sets]

        def one_call(calls):
            def run():
                for c in calls:
                    c()
                    if extra is not None:
                        extra()
            return run
        us = graph_median_us([one_call(c) for c in per_set], repeats)
        if us < best:
            best, name = us, f"BLOCK {block}, {warps} warps, {'persistent' if persistent else 'one tile per program'}"
    del sets
    torch.cuda.empty_cache()
    return best, name


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_read_latency needs a CUDA GPU")
    from prr.benchmarking import copy_bandwidth, environment, read_bandwidth
    from prr.runtime.graph_budget import graph_median_us
    from prr.runtime.graph_decode import metadata_bytes_per_block

    bf = flashinfer_bench()
    bw = copy_bandwidth() | read_bandwidth()
    bandwidth = max(bw.values())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kern = kernels()
    record = {"command": "python " + " ".join(sys.argv), "environment": environment(),
              "bandwidth_GBps": bandwidth / 1e9, "bandwidths_GBps": {k: v / 1e9 for k, v in bw.items()},
              "read": [], "chain": [], "stage": []}
    print(f"{record['environment']['gpu']}: floor bandwidth {bandwidth / 1e12:.2f} TB/s, {sms} SMs", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    for size in SIZES:
        us, name = best_read([size], args.repeats, sms, kern)
        row = dict(bytes=size, us=us, GBps=size / us / 1e3, over_floor=us / (size / bandwidth * 1e6), kernel=name)
        record["read"].append(row)
        print(json.dumps(row), flush=True)

    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    bump = kern[2]
    for n in CHAIN:
        def chain(n=n):
            for _ in range(n):
                bump[(1,)](flag, num_warps=1)
        us = graph_median_us([chain] * 8, args.repeats)
        record["chain"].append(dict(n=n, us=us))
    record["chain_fit_us"] = fit_line([float(r["n"]) for r in record["chain"]], [r["us"] for r in record["chain"]])
    print(json.dumps(record["chain"]), flush=True)

    meta_per_block = metadata_bytes_per_block("quest", torch.bfloat16, bf.D)
    for context, block, budget in STAGE_CELLS:
        meta, kv = stage_split(bf, context, block, budget, meta_per_block)
        total = meta + kv
        floor = bf.floor_us(total, bandwidth)
        fused, _ = best_read([total], args.repeats, sms, kern)
        two, _ = best_read([meta, kv], args.repeats, sms, kern)
        four, _ = best_read([meta, kv], args.repeats, sms, kern, extra=lambda: bump[(1,)](flag, num_warps=1))
        row = dict(batch=1, context=context, block_size=block, budget_tokens=budget, meta_bytes=meta, kv_bytes=kv,
                   floor_us=floor, fused_us=fused, two_launch_us=two, four_launch_us=four,
                   fused_over_floor=fused / floor, two_over_floor=two / floor, four_over_floor=four / floor)
        record["stage"].append(row)
        print(json.dumps(row), flush=True)

    args.out.with_suffix(".json").write_text(strict_json_dumps(record, indent=1) + "\n")
    import pandas as pd

    pd.concat([pd.DataFrame(record[p]).assign(part=p) for p in ("read", "chain", "stage")]).assign(
        command=record["command"]).to_csv(args.out.with_suffix(".csv"), index=False)
    text = report(record)
    args.out.with_suffix(".md").write_text(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
