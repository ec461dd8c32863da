"""Experiment: launch shapes of the selection kernels at batch 1 and 8, 128K, on one GPU — top-k
rows with 1..16 warps (the kernel's block-wide reductions get cheaper with fewer warps: one
warp needs no shared memory or barrier) and Quest scoring with other tile / warp counts; each
checked against the default's output.

    python experiments/try_select_latency.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from bench_kernels import environment, graph_time_us  # noqa: E402
from prr.kernels.quest import quest_score  # noqa: E402
from prr.kernels.topk import topk_select  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, sets, hkv, hq, d = [], 8, 8, 32, 128
    for batch in (1, 8):
        for block in (16, 64):
            nb = 131072 // block
            k = 2048 // block
            num_blocks = torch.full((batch,), nb - 4, dtype=torch.int32, device="cuda")
            scores = [torch.randn(batch, hkv, nb, device="cuda", generator=gen) for _ in range(sets)]
            want = topk_select(scores[0], k, num_blocks, 1, 1)
            for warps in (1, 2, 4, 8, 16):
                got = topk_select(scores[0], k, num_blocks, 1, 1, num_warps=warps)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (batch, block, warps)
                us = graph_time_us(lambda i, w=warps, s=scores, kb=k, n=num_blocks: (
                    lambda: topk_select(s[i], kb, n, 1, 1, num_warps=w)), sets)
                rows.append(dict(op="topk", batch=batch, block=block, blocks=nb, k=k, warps=warps, us=us))
            kmax = [torch.randn(batch, hkv, nb, d, device="cuda", generator=gen).to(torch.bfloat16)
                    for _ in range(sets)]
            kmin = [(m.float() - 1).to(torch.bfloat16) for m in kmax]
            q = torch.randn(batch, hq, d, device="cuda", generator=gen).to(torch.bfloat16)
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
    import pandas as pd

    df = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "try_select_latency.json").write_text(json.dumps(dict(
        command="python " + " ".join(sys.argv), environment=environment(), rows=rows), indent=1))
    for (op, batch, block), g in df.groupby(["op", "batch", "block"]):
        cfg = ["warps"] if op == "topk" else ["block_n", "warps"]
        best = g.sort_values("us").head(4)
        print(op, f"b{batch} bs{block}:", ", ".join(f"{'/'.join(str(int(r[c])) for c in cfg)} {r.us:.2f}"
                                                    for _, r in best.iterrows()))


if __name__ == "__main__":
    main()
