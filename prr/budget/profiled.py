"""`profiled`: measure T_select(context) and T_speculate(|P|) on the running device once,
store the lookup table in a cache file keyed by device and shape, and use the largest |P|
with T_speculate(|P|) <= T_select(context): speculation that hides inside selection.
Where none fits, |P| = 0 (plain serial DSA), so PRR is not made slower by speculating.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Sequence
from typing import Any

from prr.budget.base import SpeculationBudget, TimingProbe
from prr.paths import cache_dir, write_json_atomic


class ProfiledBudget(SpeculationBudget):
    profiles = True
    def __init__(
        self,
        ratios: Sequence[float] = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0),
        context_points: int = 6,
        use_cache: bool = True,
    ) -> None:
        if not ratios or any(r <= 0 for r in ratios):
            raise ValueError(f"budget.ratios={list(ratios)} must be a non-empty list of positive multiples of top-K")
        if context_points < 1:
            raise ValueError(f"budget.context_points={context_points} must be >= 1")
        self.ratios = sorted(ratios)
        self.context_points = context_points
        self.use_cache = use_cache
        self.table: list[tuple[int, int]] = []  # (context_blocks, |P|), ascending context

    def _contexts(self, selected_blocks: int, max_blocks: int) -> list[int]:
        lo = max(1, min(selected_blocks, max_blocks))
        if self.context_points == 1 or lo == max_blocks:
            return [max_blocks]
        step = (max_blocks / lo) ** (1 / (self.context_points - 1))
        return sorted({min(max_blocks, round(lo * step**i)) for i in range(self.context_points)})

    def setup(self, probe: TimingProbe, selected_blocks: int, max_blocks: int) -> dict[str, Any]:
        key = f"{probe.device_name}|{probe.shape_key}|K={selected_blocks}|N={max_blocks}|r={self.ratios}|c={self.context_points}"
        path = cache_dir() / "budget" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
        if self.use_cache and path.exists():
            record = json.loads(path.read_text())
            if record.get("key") == key:
                self.table = [tuple(row) for row in record["table"]]
                return {"profile_cache": str(path), "profile_table": record["table"], "profile_cached": True}
        contexts = self._contexts(selected_blocks, max_blocks)
        sizes = sorted({max(1, round(r * selected_blocks)) for r in self.ratios})
        t_select = {c: probe.time_select(c) for c in contexts}
        rows: list[dict[str, Any]] = []
        table = []
        for c in contexts:
            t_spec = {n: probe.time_speculate(min(n, c), c) for n in sizes}
            fitting = [n for n in sizes if n <= c and t_spec[n] <= t_select[c]]
            table.append((c, max(fitting) if fitting else 0))
            rows.append({"context_blocks": c, "t_select_s": t_select[c], "t_speculate_s": t_spec})
        self.table = table
        record = {"key": key, "device": probe.device_name, "table": table, "measurements": rows}
        if self.use_cache:
            write_json_atomic(path, record)
        return {"profile_cache": str(path) if self.use_cache else None, "profile_table": table, "profile_cached": False,
                "profile_measurements": rows}

    def predicted_blocks(self, layer: int, context_blocks: int, selected_blocks: int) -> int:
        if not self.table:
            raise RuntimeError("budget=profiled was not set up; the runtime calls setup(probe) before decoding")
        contexts = [c for c, _ in self.table]
        # The largest profiled context not above this one (the first one below the grid).
        i = max(0, bisect.bisect_right(contexts, context_blocks) - 1)
        return min(self.table[i][1], context_blocks)
