"""How often `topk_select`'s candidate filter falls back to a full-row select, simulated on the CPU.

    python experiments/topk_filter_simulation.py [--rows 20000] [--out experiments/results/cpu/topk_candidate_filter]

The row kernel (kernels/topk_jit.py) bounds the k-th largest score from below by the smallest
of the maxima of G strided groups (G = next power of two >= k), and selects among the keys at or
above that bound, if there are at most CAP of them; otherwise over the full row. G and CAP come
from the kernel's own `candidate_filter_shape`. A launch takes as long as its slowest row, so a
launch of R rows waits for a full-row select whenever any row falls back: 1 - (1 - p)^R.
Scores: iid standard normal fp32 (random-score benchmarks use these; real Quest scores differ).

Writes OUT.json (command, every cell) and prints one line per cell.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CELLS = [(n, k) for n in (2048, 8192) for k in (32, 128, 512)]
LAUNCH_ROWS = (8, 64)  # batch 1 and 8 of the 8B shape's 8 KV heads


def fallback_rate(n: int, k: int, rows: int, seed: int = 0, chunk: int = 2000) -> dict:
    """-> the filter's shape and, over `rows` iid normal rows of n blocks, the mean candidate
    count and the fraction of rows with more than CAP candidates (None where the filter is off)."""
    from prr.kernels.topk import candidate_filter_shape

    groups, cap = candidate_filter_shape(n, k)
    out = dict(blocks=n, k=k, groups=groups, cap=cap, rows=rows)
    if groups == 0:
        return dict(out, mean_candidates=None, fallback=None)
    gen = torch.Generator().manual_seed(seed)
    counts = []
    for start in range(0, rows, chunk):
        x = torch.randn(min(chunk, rows - start), n, generator=gen)
        bound = x.view(x.shape[0], n // groups, groups).amax(1).amin(1)  # block b is in group b % groups
        counts.append((x >= bound[:, None]).sum(1))
    c = torch.cat(counts).double()
    p = float((c > cap).double().mean())
    return dict(out, mean_candidates=float(c.mean()), fallback=p,
                **{f"launch_fallback_{r}_rows": 1 - (1 - p) ** r for r in LAUNCH_ROWS})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="topk_filter_simulation", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/cpu/topk_candidate_filter")
    args = parser.parse_args(argv)
    if args.rows < 1:
        print(f"topk_filter_simulation: error: --rows={args.rows} must be >= 1", file=sys.stderr)
        sys.exit(2)
    cells = [fallback_rate(n, k, args.rows) for n, k in CELLS]
    for c in cells:
        print(json.dumps(c))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    script = Path(sys.argv[0]).resolve()
    script = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    record = {"command": " ".join(["python", str(script), *sys.argv[1:]]), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "cells": cells}
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
