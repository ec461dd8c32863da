"""reuse=steps' newest-block append per layer on the GPU (`ReusedSelections.with_newest`):

    PYTHONPATH=$PWD python3 experiments/bench_append_newest.py [--contexts 32768,131072] [--widths 9,11,130] \
        [--batches 1,8] [--out $OUT/append_newest]

Three ways to compute A ∪ {newest} ([B, 8 KV heads, width] from a list of the same width, blocks of
64 tokens): `mask` (what with_newest ran before the engine op: a membership mask over every block of
the cache, the newest set, a stable sort of it: prr.blocks' BlockSet.mask and from_mask), and
`ReusedSelections.with_newest` on backend `torch` (the op's torch reference) and `triton` (the
kernel). Per way: the CUDA kernels one call launches (torch.profiler over an eager call) and the
device time of one call inside a CUDA graph (32 calls captured back to back, like 32 layers:
prr.benchmarking.graph_time_us, the median of 20 replays over 32). Writes OUT.csv and prints it.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile

from prr.bench_args import OneLineParser, int_list
from prr.benchmarking import graph_time_us
from prr.blocks import BlockSet
from prr.reuse import StepReuse
from prr.runtime.engine_ops import engine_ops
from prr.runtime.selection_reuse import ReusedSelections

HEADS, BLOCK_TOKENS, LAYERS, REPLAYS = 8, 64, 32, 20


def mask_union(blocks: BlockSet, num_blocks: torch.Tensor, max_blocks: int, width: int) -> BlockSet:
    """with_newest before the engine op (prr.blocks' mask and stable sort)."""
    mask = blocks.mask(max_blocks)
    newest = (num_blocks.long() - 1).view(-1, 1, 1).expand(*mask.shape[:2], 1)
    union = BlockSet.from_mask(mask.scatter(-1, newest, True), width)
    return BlockSet(union.indices.to(torch.int32), union.count.to(torch.int32))


def kernels_launched(fn) -> int:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int_list, default=[32768, 131072])
    p.add_argument("--widths", type=int_list, default=[9, 11, 130], help="|A| as attended (K + blocks gained)")
    p.add_argument("--batches", type=int_list, default=[1, 8])
    p.add_argument("--out", required=True, help="results path without suffix (.csv)")
    args = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for context in args.contexts:
        max_blocks = context // BLOCK_TOKENS + 1
        for batch in args.batches:
            num_blocks = torch.full((batch,), max_blocks, dtype=torch.int32, device=dev)
            for width in args.widths:
                count = torch.full((batch, HEADS), width - 1, dtype=torch.int32, device=dev)  # room for the newest
                ids = torch.stack([torch.randperm(max_blocks - 1, generator=gen)[:width] for _ in range(batch * HEADS)])
                blocks = BlockSet(ids.sort(-1).values.view(batch, HEADS, width).int().to(dev), count)
                ways = {"mask": lambda b=blocks, n=num_blocks, m=max_blocks, w=width: mask_union(b, n, m, w)}
                for backend in ("torch", "triton"):
                    # every=width-8+1 under between=last gives reused_width = width over K = 8
                    reuse = ReusedSelections(StepReuse(every=width - 7), [True], batch, HEADS, max_blocks, 8, dev,
                                             engine_ops(backend))
                    assert reuse.width == width, (reuse.width, width)
                    ways[backend] = lambda r=reuse, b=blocks, n=num_blocks: r.with_newest(0, b, n)
                want = ways["mask"]()
                for name, fn in ways.items():
                    got = fn()
                    same = torch.equal(got.indices, want.indices) and torch.equal(got.count, want.count)
                    rows.append({"context": context, "max_blocks": max_blocks, "batch": batch, "width": width,
                                 "way": name, "kernels": kernels_launched(fn),
                                 "us_per_call": round(graph_time_us(lambda _, fn=fn: fn, sets=LAYERS, reps=REPLAYS), 2),
                                 "equals_mask": same})
    table = pd.DataFrame(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(f"{args.out}.csv", index=False)
    print(torch.cuda.get_device_name(), torch.__version__)
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()
