"""The lightning indexer's kernels (issue 52, item 2) beside the torch reference and the byte floor.

    python experiments/bench_indexer.py [--quick] [--contexts 8192,32768,131072] [--batch 1,8] \
        [--index-dtypes bf16,fp8] [--heads 64] [--dim 128] [--q-dtype bf16] [--sets 4] [--repeats 20] [--tune] \
        [--out experiments/results/h100/bench_indexer]

For every cell (context T, batch B, index dtype):
- inputs: `prr.kernels.reference_indexer.random_indexer_inputs` on the GPU (index queries [B, H_I, d_I]
  in --q-dtype, fp32 head weights of either sign, one index key per token in bf16, or fp8 e4m3 with an
  fp32 scale per token), every row T tokens long in a cache of T slots.
- scores: `prr.kernels.indexer_score.indexer_scores` (one launch), checked first against the float64
  reference on set 0 (relative error; the -inf tail where a row is one token shorter) and timed beside
  `indexer_scores_reference` in torch on the same GPU, the outside baseline (dequantize, matmul, ReLU,
  weighted sum): in fp32, and in bf16 (bf16 matmul, heads summed in fp32).
- append: `prr.kernels.indexer_keys.index_key_append` (one key per row, fp8 quantized in the kernel),
  its bytes checked against `index_key_append_reference`, timed beside that reference in torch.
- --tune: the score kernel also at every launch shape of TUNE_GRID (tokens per tile, pipeline stages,
  warps, programs per SM), each checked against the float64 reference first; the fastest is reported.

Timing (as bench_hinted_topk.py): `--sets` different input sets (more where needed so that one graph
reads at least 128 MiB: the H100's L2 is 50 MB) captured in one CUDA graph, median replay over
`--repeats`, / sets (prr.benchmarking.graph_time_us). Floors: bytes / the best copy or read bandwidth
measured in the same run; score bytes = B · T · (d_I · elem + 4 for fp8's scale + 4 for the fp32 score
written) + q and weights; append bytes = B · (d_I · 2 read + d_I · elem + 4 written). A CUDA GPU is
required (without one the script says so in one line and exits 2).

Writes OUT.json (command, GPU, driver, versions, date, bandwidths, every row), OUT.csv and OUT.md;
prints the short table last.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
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

MAX_SETS = 64
INDEX_DTYPES = ("bf16", "fp8")
Q_DTYPES = ("bf16", "fp32")
FULL_GRID = dict(contexts=[8192, 32768, 131072], batch=[1, 8], index_dtypes=["bf16", "fp8"])
TUNE_GRID = dict(block_t=(64, 128), num_stages=(2, 3, 4), num_warps=(4, 8), programs_per_sm=(1, 2, 4, 8))
QUICK_GRID = dict(contexts=[8192], batch=[1], index_dtypes=["bf16", "fp8"])


# --- arguments, floors and tables: pure python (tests/test_bench_indexer.py) ---------------------


def name_list(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        values = text.split(",")
        bad = [v for v in values if v not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{text!r}: {bad} not in {list(choices)}")
        return values

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"a tiny grid: {QUICK_GRID}")
    parser.add_argument("--contexts", type=int_list, default=None, help="tokens per row (the cache's T_max)")
    parser.add_argument("--batch", type=int_list, default=None, help="rows")
    parser.add_argument("--index-dtypes", type=name_list(INDEX_DTYPES), default=None, help="bf16,fp8")
    parser.add_argument("--heads", type=int, default=64, help="index heads H_I (DeepSeek-V3.2: 64; GLM-5: 32)")
    parser.add_argument("--dim", type=int, default=128, help="index head dim d_I (a power of two)")
    parser.add_argument("--q-dtype", choices=Q_DTYPES, default="bf16", help="the index queries' dtype")
    parser.add_argument("--sets", type=int, default=4, help="input sets per timing graph (at least; L2 rotation)")
    parser.add_argument("--repeats", type=int, default=20, help="graph replays (the median is reported)")
    parser.add_argument("--tune", action="store_true",
                        help=f"also time the score kernel's launch shapes {TUNE_GRID} (t = block_t, s = num_stages, "
                             "w = num_warps, p = programs per SM); each checked against the reference first")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/h100/bench_indexer"),
                        help="results prefix: OUT.json, OUT.csv, OUT.md")
    args = parser.parse_args(argv)
    fill_grid_defaults(args, QUICK_GRID if args.quick else FULL_GRID)
    problems = []
    if args.dim < 16 or args.dim & (args.dim - 1):
        problems.append(f"--dim={args.dim} must be a power of two >= 16")
    if not 1 <= args.heads <= 128:
        problems.append(f"--heads={args.heads} must be in [1, 128]")
    if any(t < 2 for t in args.contexts):
        problems.append(f"--contexts {args.contexts}: every context must be >= 2 (one row is a token short)")
    problems += timing_count_problems(args)
    if problems:
        parser.error("; ".join(problems))
    return args


def cells(args: argparse.Namespace) -> list[tuple[int, int, str]]:
    """(context, batch, index dtype) of the grid."""
    return [(t, b, d) for t in args.contexts for b in args.batch for d in args.index_dtypes]


def key_bytes_per_token(dim: int, index_dtype: str) -> int:
    """An index key as cached: d_I bytes + a 4-byte scale in fp8 (132 at d_I = 128), 2 d_I in bf16."""
    return dim + 4 if index_dtype == "fp8" else 2 * dim


def score_bytes(batch: int, context: int, heads: int, dim: int, index_dtype: str, q_bytes: int) -> int:
    """Bytes one scoring call must move: every key (and scale) read once, the fp32 scores written, q and w read."""
    return batch * context * (key_bytes_per_token(dim, index_dtype) + 4) + batch * heads * (dim * q_bytes + 4)


def append_bytes(batch: int, dim: int, index_dtype: str) -> int:
    """Bytes one append must move: the bf16 new keys read, one cached key (and scale) written per row."""
    return batch * (2 * dim + key_bytes_per_token(dim, index_dtype))


def timing_sets(nbytes: int, sets: int) -> int:
    """Sets per graph: at least `sets`, and enough that the graph reads L2_ROTATION_BYTES."""
    return rotation_sets(nbytes, sets, MAX_SETS)


def tune_configs(batch: int, num_sms: int) -> dict[str, dict]:
    """--tune's launch shapes of indexer_scores: name -> keyword arguments (splits from programs per SM)."""
    return {f"t{bt}_s{st}_w{nw}_p{pps}": dict(block_t=bt, num_stages=st, num_warps=nw,
                                              splits=math.ceil(pps * num_sms / batch))
            for bt, st, nw, pps in itertools.product(*TUNE_GRID.values())}




def table(rows: list[dict]) -> str:
    header = ["T", "B", "keys", "score µs", "floor µs", "score / floor", "torch fp32 µs", "torch bf16 µs",
              "score / torch bf16", "rel err", "append µs", "append torch µs", "append floor µs", "checks", "tuned µs", "tuned best"]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["context"], r["batch"], r["index_dtype"], *["—"] * 12, r["error"][:60]])
            continue
        body.append([r["context"], r["batch"], r["index_dtype"], r.get("score_us"), r["score_floor_us"],
                     ratio(r.get("score_us"), r["score_floor_us"]), r.get("torch_fp32_us"), r.get("torch_bf16_us"),
                     ratio(r.get("score_us"), r.get("torch_bf16_us")), r["score_rel_err"], r.get("append_us"),
                     r.get("append_torch_us"), r["append_floor_us"], r["checks_pass"], r.get("tuned_us"),
                     r.get("tuned_best")])
    return markdown(header, body)


def report(record: dict) -> str:
    env = record.get("environment", {})
    floor = record.get("bandwidth_GBps")
    shape = record.get("shape", {})
    out = ["# Lightning indexer kernels beside torch and the byte floor (issue 52, item 2)", "",
           f"Command: `{record.get('command', '')}`", "",
           f"{env.get('gpu', '?')}, driver {env.get('driver', '?')}, torch {env.get('torch', '?')}, "
           f"triton {env.get('triton', '?')}, CUDA {env.get('cuda', '?')}, {env.get('date', '?')}; "
           f"timer {record.get('timer', '?')}" + (f"; floor bandwidth {floor:.0f} GB/s (measured)." if floor else "."),
           "",
           f"H_I = {shape.get('heads', '?')} index heads, d_I = {shape.get('dim', '?')}, q in {shape.get('q_dtype', '?')}. "
           "µs per call (median over graph replays / sets). score: `indexer_scores`; torch fp32 / bf16: "
           "`indexer_scores_reference` (dequantize, matmul, ReLU, weighted sum) in that compute dtype; "
           "floor: the bytes (keys and scales read once, fp32 scores written) / the measured bandwidth; "
           "rel err: against the float64 reference; append: `index_key_append` of one key per row beside "
           "`index_key_append_reference`; checks: scores within 1e-4 of the reference with the -inf tail, "
           "append bytes equal; tuned: the fastest of --tune's launch shapes (t block_t, s num_stages, w num_warps, "
           "p programs per SM), each within the same check.", "", table(record.get("rows", [])), ""]
    return "\n".join(out)


def write_outputs(record: dict, out: Path) -> str:
    """OUT.json, OUT.csv (one row per cell, the command in each), OUT.md -> the markdown."""
    return write_bench_outputs(record, out, report)


# --- measurement (CUDA) ---------------------------------------------------------------------------


def cell_row(context: int, batch: int, index_dtype: str, args: argparse.Namespace, bandwidth: float,
             seed: int, device: str = "cuda", timer=None) -> dict:
    """One cell's checks and timings. device / timer (make_call, sets, repeats -> µs per call; default
    CUDA-graph replays) are for the CPU test of this function under TRITON_INTERPRET=1 only: main()
    runs on CUDA."""
    import torch
    from prr.kernels.indexer_keys import index_key_append
    from prr.kernels.indexer_score import indexer_scores
    from prr.kernels.reference_indexer import (
        index_key_append_reference,
        indexer_scores_reference,
        random_indexer_inputs,
    )
    from prr.kernels.reference_sparse_decode import relative_error

    from prr.benchmarking import graph_time_us

    q_dtype = torch.bfloat16 if args.q_dtype == "bf16" else torch.float32
    nbytes = score_bytes(batch, context, args.heads, args.dim, index_dtype, 2 if args.q_dtype == "bf16" else 4)
    sets = timing_sets(nbytes, args.sets) if device == "cuda" else args.sets
    row = dict(context=context, batch=batch, index_dtype=index_dtype, heads=args.heads, dim=args.dim,
               q_dtype=args.q_dtype, sets=sets, score_bytes=nbytes, score_floor_us=nbytes / bandwidth * 1e6,
               append_bytes=append_bytes(batch, args.dim, index_dtype),
               append_floor_us=append_bytes(batch, args.dim, index_dtype) / bandwidth * 1e6)
    # Every row T tokens long, but for set 0's last row, one short: its last score must be -inf.
    lengths = [context] * batch
    inputs = [random_indexer_inputs(seed + i, lengths, args.heads, args.dim, index_dtype, q_dtype, device=device)
              for i in range(sets)]
    check = inputs[0]
    check.lengths[-1] = context - 1
    got = indexer_scores(*check.args())
    want = indexer_scores_reference(*check.args())
    row["score_rel_err"] = relative_error(got, want)
    row["score_tail_ok"] = bool(torch.equal(torch.isinf(got), torch.isinf(want))) and bool(got[-1, -1] == float("-inf"))
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 4
    configs = tune_configs(batch, num_sms) if args.tune else {}
    for kw in configs.values():  # every launch shape checked before any is timed
        other = indexer_scores(*check.args(), **kw)
        row["tune_worst_rel_err"] = max(row.get("tune_worst_rel_err", 0.0), relative_error(other, want))
        row["tune_all_equal_default"] = row.get("tune_all_equal_default", True) and bool(torch.equal(other, got))
    check.lengths[-1] = context
    del got, want

    gen = torch.Generator(device=device).manual_seed(seed)
    new_keys = [torch.randn(batch, args.dim, generator=gen, device=device).to(torch.bfloat16) for _ in range(sets)]
    positions = torch.full((batch,), context - 1, dtype=torch.int32, device=device)
    ref_keys = check.keys.clone()
    ref_scales = None if check.scales is None else check.scales.clone()
    index_key_append(check.keys, check.scales, new_keys[0], positions)
    index_key_append_reference(ref_keys, ref_scales, new_keys[0], positions)
    same = torch.equal(check.keys.view(torch.uint8), ref_keys.view(torch.uint8)) if index_dtype == "fp8" else \
        torch.equal(check.keys, ref_keys)
    row["append_equal"] = bool(same) and (ref_scales is None or bool(torch.equal(check.scales, ref_scales)))
    del ref_keys, ref_scales
    row["checks_pass"] = row["score_rel_err"] < 1e-4 and row["score_tail_ok"] and row["append_equal"] \
        and row.get("tune_worst_rel_err", 0.0) < 1e-4

    outs = [torch.empty(batch, context, device=device) for _ in range(sets)]
    timer = timer or graph_time_us
    timed = lambda make_call: timer(make_call, sets, args.repeats)  # noqa: E731
    guarded(row, "score_us", lambda: timed(lambda i: (lambda: indexer_scores(*inputs[i].args(), out=outs[i]))))
    guarded(row, "torch_fp32_us", lambda: timed(lambda i: (lambda: indexer_scores_reference(
        *inputs[i].args(), compute_dtype=torch.float32))))
    guarded(row, "torch_bf16_us", lambda: timed(lambda i: (lambda: indexer_scores_reference(
        *inputs[i].args(), compute_dtype=torch.bfloat16))))
    guarded(row, "append_us", lambda: timed(lambda i: (lambda: index_key_append(
        inputs[i].keys, inputs[i].scales, new_keys[i], positions))))
    guarded(row, "append_torch_us", lambda: timed(lambda i: (lambda: index_key_append_reference(
        inputs[i].keys, inputs[i].scales, new_keys[i], positions))))
    for name, kw in configs.items():
        guarded(row, f"tune_us_{name}", lambda kw=kw: timed(lambda i: (lambda: indexer_scores(
            *inputs[i].args(), out=outs[i], **kw))))
    tuned = {name: row[f"tune_us_{name}"] for name in configs if f"tune_us_{name}" in row}
    if tuned:
        row["tuned_best"] = min(tuned, key=tuned.get)
        row["tuned_us"] = tuned[row["tuned_best"]]
    row["score_over_floor"] = ratio(row.get("score_us"), row["score_floor_us"])
    row["score_over_torch_bf16"] = ratio(row.get("score_us"), row.get("torch_bf16_us"))
    row["score_over_torch_fp32"] = ratio(row.get("score_us"), row.get("torch_fp32_us"))
    return row


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_indexer: no CUDA GPU here: it times compiled kernels on one (run it on the GPU machine)",
              file=sys.stderr)
        sys.exit(2)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("bench_indexer times compiled kernels: unset TRITON_INTERPRET (or set it to 0)", file=sys.stderr)
        sys.exit(2)
    from prr.benchmarking import announce_gpu, graph_bench_record

    env, bandwidths, bandwidth = announce_gpu()
    record = graph_bench_record(bench_command("experiments/bench_indexer.py", argv), env, bandwidths,
                                shape=dict(heads=args.heads, dim=args.dim, q_dtype=args.q_dtype))
    for index, (context, batch, index_dtype) in enumerate(cells(args)):
        record_cell(record, args.out, write_outputs, dict(context=context, batch=batch, index_dtype=index_dtype),
                    cell_row, context, batch, index_dtype, args, bandwidth, seed=1000 * index)
        torch.cuda.empty_cache()
    print("\n" + write_outputs(record, args.out))


if __name__ == "__main__":
    main()
