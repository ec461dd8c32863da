"""`adaptive`: |P| per layer adjusted online from what speculation actually did.

Each layer starts at ratio × |A|. After every decode step the runtime hands the step's
records to `observe`; per layer, smoothed over steps:
  - misses = |A \\ P| / |A| above `target_miss` while waste = |P \\ A| / |P| stays below
    `max_waste` -> grow |P| by `growth` (a wider P catches more of A);
  - waste above `max_waste`, or speculation measured slower than selection (it no longer
    hides) -> shrink by `growth`;
  - the predictor's hit rate at K (its top-|A| against A, known whatever |P| is) below
    `min_hit` -> |P| = 0 (serial DSA: speculation would be mostly repaired), and back to
    the last ratio once it recovers.
|P| never exceeds the profiled ceiling (the largest |P| whose speculation hid inside
selection on this device, as `budget=profiled` measures) when `use_profile`, nor the context.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from prr.budget.base import SpeculationBudget, TimingProbe
from prr.budget.profiled import ProfiledBudget
from prr.runtime.records import LayerStepRecord


class AdaptiveBudget(SpeculationBudget):
    adapts_online = True
    def __init__(
        self,
        ratio: float = 1.0,
        min_ratio: float = 0.5,
        max_ratio: float = 2.0,
        growth: float = 1.25,
        target_miss: float = 0.05,
        max_waste: float = 0.5,
        min_hit: float = 0.3,
        smoothing: float = 0.5,
        use_profile: bool = True,
        profile_ratios: Sequence[float] = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0),
        profile_context_points: int = 6,
    ) -> None:
        problems = []
        if not 0 < min_ratio <= ratio <= max_ratio:
            problems.append(f"budget.min_ratio={min_ratio} <= ratio={ratio} <= max_ratio={max_ratio} must hold, all > 0")
        if growth <= 1.0:
            problems.append(f"budget.growth={growth} must be > 1 (|P| grows or shrinks by this factor)")
        for name, value in (("target_miss", target_miss), ("max_waste", max_waste), ("min_hit", min_hit)):
            if not 0.0 <= value <= 1.0:
                problems.append(f"budget.{name}={value} must lie in [0, 1]")
        if not 0.0 <= smoothing < 1.0:
            problems.append(f"budget.smoothing={smoothing} must lie in [0, 1) (weight of the past in the running means)")
        if problems:
            raise ValueError("; ".join(problems))
        self.ratio, self.min_ratio, self.max_ratio, self.growth = ratio, min_ratio, max_ratio, growth
        self.target_miss, self.max_waste, self.min_hit, self.smoothing = target_miss, max_waste, min_hit, smoothing
        self.profile = ProfiledBudget(profile_ratios, profile_context_points) if use_profile else None
        self.ratios: dict[int, float] = {}  # layer -> current |P| / |A|
        self.off: dict[int, bool] = {}  # layer -> speculation switched off (predictor too weak)
        self.means: dict[int, dict[str, float]] = {}  # layer -> smoothed miss, waste, hit_at_k, speculate/select
        self.history: list[dict[str, Any]] = []  # (step, layer, ratio, off) after each change, for the run record

    def setup(self, probe: TimingProbe, selected_blocks: int, max_blocks: int) -> dict[str, Any]:
        return self.profile.setup(probe, selected_blocks, max_blocks) if self.profile is not None else {}

    def static_blocks(self, selected_blocks: int) -> int:
        return round(self.ratio * selected_blocks)

    def predicted_blocks(self, layer: int, context_blocks: int, selected_blocks: int) -> int:
        if self.off.get(layer, False):
            return 0
        n = round(self.ratios.get(layer, self.ratio) * selected_blocks)
        if self.profile is not None:
            n = min(n, self.profile.predicted_blocks(layer, context_blocks, selected_blocks))
        return min(n, context_blocks)

    def _smooth(self, layer: int, name: str, value: float) -> float:
        means = self.means.setdefault(layer, {})
        means[name] = value if name not in means else self.smoothing * means[name] + (1 - self.smoothing) * value
        return means[name]

    def observe(self, records: Iterable[LayerStepRecord]) -> None:
        for r in records:
            selected = int(r.selected.sum())
            if selected == 0:
                continue
            predicted = r.predicted
            n_pred = int(predicted.sum())
            miss = self._smooth(r.layer, "miss", int((r.selected & ~predicted).sum()) / selected)
            waste = self._smooth(r.layer, "waste", int((predicted & ~r.selected).sum()) / n_pred if n_pred else 0.0)
            if r.ranked_at_k is not None:
                hit_at_k = self._smooth(r.layer, "hit_at_k", int((r.ranked_at_k & r.selected).sum()) / selected)
                off = hit_at_k < self.min_hit
                if off != self.off.get(r.layer, False):
                    self.off[r.layer] = off
                    self.history.append({"step": r.step, "layer": r.layer, "off": off})
                if off:
                    continue
            slow = False
            if n_pred and r.timings.get("select", 0.0) > 0:
                slow = self._smooth(r.layer, "speculate_over_select", r.timings.get("speculate", 0.0) / r.timings["select"]) > 1.0
            ratio = self.ratios.get(r.layer, self.ratio)
            if waste > self.max_waste or slow:
                new = max(self.min_ratio, ratio / self.growth)
            elif miss > self.target_miss:
                new = min(self.max_ratio, ratio * self.growth)
            else:
                new = ratio
            if new != ratio:
                self.ratios[r.layer] = new
                self.history.append({"step": r.step, "layer": r.layer, "ratio": round(new, 4)})
