"""`adaptive`: serial DSA or PRR, chosen online per window of decode steps by what each
measured. One rule, whichever engine runs it.

|P| is static (= ratio × |A|, as `fixed`): a CUDA graph fixes every shape, so the engine
captures both variants over one cache beforehand and the host picks between them at window
boundaries, never inside a step; the eager runtime runs the same windows. The rule:
  - the first two windows run serial DSA, then PRR (each measured once);
  - afterwards each window runs the variant whose smoothed step time is lower, except that
    PRR is not chosen while its latest window's hit rate |P ∩ A| / |A| is below `min_hit`
    (speculation that is mostly repaired);
  - one window in every `probe_every` re-measures the variant not in use, so a change of
    regime (the context grows, the predictor warms up or degrades) is seen.
A window's time is the median over its steps of the step's time (`smoothing`: the weight of a
variant's past windows in its running time). What "a step's time" is depends on the engine
and is its own measurement: the graph engine's device time of the step's replay (host clock
on a CPU); the eager runtime's summed attention-stage timers of the step. The predictor
learns in PRR windows only, so the first PRR steps after serial ones speculate over a P that
has not seen the serial steps' selections; the hit rate those windows measure includes that.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prr.budget.base import SpeculationBudget

if TYPE_CHECKING:  # annotations only: run.py checks a budget's options before torch is imported
    from prr.step_record import LayerStepRecord

VARIANTS = ("serial", "prr")


class AdaptiveBudget(SpeculationBudget):
    def __init__(self, ratio: float = 1.0, min_hit: float = 0.3, smoothing: float = 0.5, probe_every: int = 8,
                 window_steps: int = 16) -> None:
        problems = []
        if ratio <= 0:
            problems.append(f"budget.ratio={ratio} must be > 0 (|P| = ratio × |A| in PRR windows)")
        if not 0.0 <= min_hit <= 1.0:
            problems.append(f"budget.min_hit={min_hit} must lie in [0, 1]")
        if not 0.0 <= smoothing < 1.0:
            problems.append(f"budget.smoothing={smoothing} must lie in [0, 1) (weight of the past in the running times)")
        if probe_every < 2:
            problems.append(f"budget.probe_every={probe_every} must be >= 2 (one window in probe_every re-measures)")
        if window_steps < 1:
            problems.append(f"budget.window_steps={window_steps} must be >= 1")
        if problems:
            raise ValueError("; ".join(problems))
        self.ratio, self.min_hit, self.smoothing = ratio, min_hit, smoothing
        self.probe_every, self.window_steps = probe_every, window_steps
        self.seconds: dict[str, float] = {}  # variant -> smoothed window median (s)
        self.hit_rate: float | None = None  # PRR's latest window hit rate
        self.windows: list[dict[str, Any]] = []  # what each window ran and measured (the run record)
        self.variant = self.next_variant()  # what the current window runs
        self._steps: list[float] = []  # the eager runtime's current window: each step's time (s)
        self._counts = [0, 0]  # ... and its |P ∩ A|, |A| summed over PRR steps
        self.info: dict[str, Any] = {"windows": self.windows}  # budget_setup in summary.json, filled as windows end

    def setup(self, probe: Any, selected_blocks: int, max_blocks: int) -> dict[str, Any]:
        return self.info

    # --- the rule ------------------------------------------------------------------------
    def best(self) -> str:
        """The variant to run, from what was measured so far."""
        if "serial" not in self.seconds or "prr" not in self.seconds:
            return "serial"
        if self.hit_rate is not None and self.hit_rate < self.min_hit:
            return "serial"
        return "prr" if self.seconds["prr"] < self.seconds["serial"] else "serial"

    def next_variant(self) -> str:
        """The variant for the next window: each once first, then the best, re-probing the other."""
        n = len(self.windows)
        if n < len(VARIANTS):
            return VARIANTS[n]
        best = self.best()
        if n % self.probe_every == 0:
            return "prr" if best == "serial" else "serial"
        return best

    def end_window(self, variant: str, median_s: float, hit_rate: float | None = None) -> str:
        """One finished window: its variant, the median of its steps' times (s), and for PRR
        the share of A its P held. -> the variant of the next window."""
        if variant not in VARIANTS:
            raise ValueError(f"variant {variant!r} is not one of {VARIANTS}")
        old = self.seconds.get(variant)
        self.seconds[variant] = median_s if old is None else self.smoothing * old + (1 - self.smoothing) * median_s
        if variant == "prr":
            self.hit_rate = hit_rate
        self.windows.append({"variant": variant, "median_ms": 1e3 * median_s, "hit_rate": hit_rate,
                             "choice_after": self.best()})
        self.variant = self.next_variant()
        ran = [w["variant"] for w in self.windows]
        self.info.update(windows_prr=ran.count("prr"), windows_serial=ran.count("serial"))
        return self.variant

    # --- the graph engine's side: both variants captured over one cache, one per window -----
    def engine_problems(self, speculates: bool, purpose: str, tensor_parallel: int = 1) -> list[str]:
        head = "runtime.engine=graph with budget=adaptive"
        out = []
        if not speculates:
            out.append(f"{head} chooses between serial DSA and PRR: it needs a predictor; predictor=none is serial DSA "
                       "already")
        if purpose == "scoring":
            out.append(f"{head} and a scored task: budget=adaptive switches variants per window of one decode; use "
                       "budget=fixed or budget=profiled (or runtime.engine=eager)")
        if purpose == "study":
            out.append("the study decode takes a fixed budget (|P| static for the decode); got budget=adaptive")
        if tensor_parallel > 1:
            out.append(f"runtime.tensor_parallel={tensor_parallel} with budget=adaptive: each rank would decide from "
                       "its own timings; not yet supported (use budget=fixed)")
        return out

    def resolve_engine_blocks(self, make_probe: Any, planned: int, selected_blocks: int, max_blocks: int,
                              context_blocks: int) -> tuple[int, dict[str, Any]]:
        return planned, self.info

    def engine_variants(self, variant: str) -> tuple[str, ...]:
        return VARIANTS

    def window_steps_or(self, default: int) -> int:
        return self.window_steps

    def window_variant(self, variant: str) -> str:
        return self.variant

    # --- the eager runtime's side: |P| per step, windows from its records -----------------
    def static_blocks(self, selected_blocks: int) -> int:
        return round(self.ratio * selected_blocks)

    def predicted_blocks(self, layer: int, context_blocks: int, selected_blocks: int) -> int:
        if self.variant == "serial":
            return 0
        return min(round(self.ratio * selected_blocks), context_blocks)

    def observe(self, records: Iterable[LayerStepRecord]) -> None:
        """One eager decode step (every sparse layer's record): its stage time and hits join the
        window; a full window ends here."""
        seconds = 0.0
        for r in records:
            seconds += sum(r.timings.values())
            if self.variant == "prr":
                self._counts[0] += int((r.selected & r.predicted).sum())
                self._counts[1] += int(r.selected.sum())
        self._steps.append(seconds)
        if len(self._steps) < self.window_steps:
            return
        hit = self._counts[0] / self._counts[1] if self.variant == "prr" and self._counts[1] else None
        self.end_window(self.variant, statistics.median(self._steps), hit)
        self._steps, self._counts = [], [0, 0]
