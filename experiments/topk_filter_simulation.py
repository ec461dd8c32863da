"""How often `topk_select`'s candidate filter falls back to a full-row select, simulated on the CPU.

    python experiments/topk_filter_simulation.py [--rows 20000] [--out experiments/results/cpu/topk_candidate_filter]

The row kernel (kernels/topk_jit.py) bounds the k-th largest score from below by the smallest
of the maxima of G strided groups (G = next power of two >= k), and selects among the keys at or
above that bound, if there are at most CAP of them; otherwise over the full row. G and CAP come
from the kernel's own policy, `candidate_filter_shape` (CAP depends on the rows per launch; where
it would exceed a quarter of the row the policy runs the full row: the mean candidate count is
still shown). A launch takes as long as its slowest row, so a launch of R rows waits for a
full-row select whenever any row falls back: 1 - (1 - p)^R.
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

from prr.paths import strict_json_dumps

ROOT = Path(__file__).resolve().parents[1]
CELLS = [(n, k, r) for n in (2048, 4096, 8192) for k in (32, 128, 512) for r in (8, 64)]  # rows per launch:
# batch 1 and 8 of the 8B shape's 8 KV heads


def candidate_counts(n: int, k: int, rows: int, seed: int = 0, chunk: int = 2000) -> torch.Tensor | None:
    """[rows] keys at or above the filter's bound (the smallest of `filter_groups` strided group
    maxima) in iid normal rows of n blocks; None where the filter cannot apply."""
    from prr.kernels.topk import filter_groups

    groups = filter_groups(n, k)
    if groups == 0:
        return None
    gen = torch.Generator().manual_seed(seed)
    counts = []
    for start in range(0, rows, chunk):
        x = torch.randn(min(chunk, rows - start), n, generator=gen)
        bound = x.view(x.shape[0], n // groups, groups).amax(1).amin(1)  # block b is in group b % groups
        counts.append((x >= bound[:, None]).sum(1))
    return torch.cat(counts).double()


def fallback_rate(n: int, k: int, rows: int, launch_rows: int = 8, counts: torch.Tensor | None = None) -> dict:
    """-> the policy's filter shape for launches of `launch_rows` rows and, over `rows` iid normal
    rows, the mean candidate count and the fraction of rows with more than CAP candidates and of
    launches with such a row (None where the policy runs the full row)."""
    from prr.kernels.topk import candidate_filter_shape

    groups, cap, radix = candidate_filter_shape(n, k, launch_rows)
    counts = candidate_counts(n, k, rows) if counts is None else counts
    out = dict(blocks=n, k=k, launch_rows=launch_rows, groups=groups, cap=cap, candidate_radix_bits=radix, rows=rows,
               mean_candidates=None if counts is None else float(counts.mean()))
    if groups == 0:
        return dict(out, fallback=None, launch_fallback=None)
    p = float((counts > cap).double().mean())
    return dict(out, fallback=p, launch_fallback=1 - (1 - p) ** launch_rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="topk_filter_simulation", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/cpu/topk_candidate_filter")
    args = parser.parse_args(argv)
    if args.rows < 1:
        print(f"topk_filter_simulation: error: --rows={args.rows} must be >= 1", file=sys.stderr)
        sys.exit(2)
    counts = {(n, k): candidate_counts(n, k, args.rows) for n, k in dict.fromkeys((n, k) for n, k, _ in CELLS)}
    cells = [fallback_rate(n, k, args.rows, r, counts[n, k]) for n, k, r in CELLS]
    for c in cells:
        print(json.dumps(c))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    script = Path(sys.argv[0]).resolve()
    script = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    record = {"command": " ".join(["python", str(script), *sys.argv[1:]]), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "cells": cells}
    args.out.with_suffix(".json").write_text(strict_json_dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
