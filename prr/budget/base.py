"""The speculation budget: how many of the predictor's top-ranked blocks to speculate on
(|P|). Not the DSA top-K: `selector.topk_blocks` is what selection keeps, the budget is
what speculation covers, and it may exceed top-K (a wider P hits more of A for more work).
"""

from __future__ import annotations

import statistics
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from prr.step_record import LayerStepRecord


@dataclass(frozen=True)
class StageTiming:
    """One stage timed over repeats: the median decides; the quartiles say how far to trust
    it (a loaded machine spreads them apart). min and max are kept for the record, but a
    single interrupt makes max/min of sub-millisecond ops large even on an idle machine, so
    the spread is the interquartile ratio q3/q1."""

    min_s: float
    q1_s: float
    median_s: float
    q3_s: float
    max_s: float

    def __post_init__(self) -> None:
        if not 0 <= self.min_s <= self.q1_s <= self.median_s <= self.q3_s <= self.max_s:
            raise ValueError(f"stage timing min={self.min_s} <= q1={self.q1_s} <= median={self.median_s} <= "
                             f"q3={self.q3_s} <= max={self.max_s} must hold, all >= 0")

    @classmethod
    def of(cls, samples: list[float]) -> StageTiming:
        if len(samples) < 2:
            raise ValueError(f"a stage timing needs >= 2 repeats for its quartiles, got {len(samples)}")
        q1, median, q3 = statistics.quantiles(samples, n=4, method="inclusive")
        return cls(min(samples), q1, median, q3, max(samples))

    @property
    def spread(self) -> float:
        """q3 / q1 over the repeats (1.0: perfectly steady)."""
        return self.q3_s / self.q1_s if self.q1_s > 0 else (1.0 if self.q3_s == 0 else float("inf"))

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "spread": self.spread}


class TimingProbe(Protocol):
    """Measures the two stages a budget trades off, on the running device and model shape."""

    device_name: str
    shape_key: str  # what the timings depend on: heads, head_dim, block_size, selector, ...

    def time_select(self, context_blocks: int) -> StageTiming:
        """One layer's selection over a context of this many blocks, timed over repeats."""
        ...

    def time_speculate(self, predicted_blocks: int, context_blocks: int) -> StageTiming:
        """One layer's speculation over this many blocks, timed over repeats."""
        ...

    def time_stage(self, context_blocks: int, predicted_blocks: int, hit_rate: float) -> StageTiming:
        """One layer's whole attention stage as the engine runs it, timed over repeats: serial
        DSA for predicted_blocks = 0, else PRR with a P of that many blocks holding `hit_rate`
        of the true selection A (the rest outside A)."""
        ...


class SpeculationBudget(ABC):
    """|P| per layer and step for the eager runtime (`predicted_blocks`, `observe`), and the
    graph engine's policy, where |P| is static for the decode (a CUDA graph fixes every shape):
    `engine_blocks` before anything is measured, `resolve_engine_blocks` once before the decode,
    then windows of steps (`engine_variants`, `window_variant`, `end_window`). The defaults are
    a static |P|; profiled and adaptive override what they decide otherwise, so that engines
    never ask a budget what kind it is."""

    def static_blocks(self, selected_blocks: int) -> int | None:
        """|P| for a selection of selected_blocks blocks when it is known before decoding
        (fixed; adaptive's starting size), None when it is measured (profiled)."""
        return None

    def setup(self, probe: TimingProbe, selected_blocks: int, max_blocks: int) -> dict[str, Any]:
        """Called once before decoding (selected_blocks: the selector's |A| at max_blocks);
        returns what it decided, for the run record."""
        return {}

    @abstractmethod
    def predicted_blocks(self, layer: int, context_blocks: int, selected_blocks: int) -> int:
        """|P| for this layer and context; selected_blocks is the selector's |A| there."""

    def observe(self, records: Iterable[LayerStepRecord]) -> None:
        """After each decode step (timings resolved): what speculation did. Budgets that
        adapt online (adaptive) learn here; the others ignore it."""
        return None

    def config_problems(self, selector: Any, predictor: Any, model: Any, predictor_name: str) -> list[str]:
        """Why this budget cannot size |P| for these options (checked before any weights load); empty: it can."""
        return []

    # --- the graph engine --------------------------------------------------------------------
    def engine_problems(self, speculates: bool, purpose: str, tensor_parallel: int = 1) -> list[str]:
        """Why the graph engine cannot decode under this budget (empty: it can). purpose: "decode"
        (run.py), "scoring" (scored tasks' requests) or "study" (the locality studies' decode)."""
        return []

    def engine_blocks(self, selected_blocks: int, max_blocks: int) -> int:
        """The engine's |P| before anything is measured, for a selection of selected_blocks of a
        cache of max_blocks (profiled: |A|, a placeholder its profile replaces)."""
        size = self.static_blocks(selected_blocks)
        if size is None:
            raise NotImplementedError(f"{type(self).__name__} measures |P|: it must define engine_blocks")
        return min(size, max_blocks)

    def resolve_engine_blocks(self, make_probe: Callable[[], TimingProbe], planned: int, selected_blocks: int,
                              max_blocks: int, context_blocks: int) -> tuple[int, dict[str, Any]]:
        """The engine's |P| for the decode (0: serial DSA), decided once before it at the first
        step's context, from the planned one (`engine_blocks`, or every block for a selector that
        selects them all); make_probe builds a probe of the engine's own stages, called only by a
        budget that measures. -> (|P|, what it decided, for the run record)."""
        return planned, {}

    def engine_variants(self, variant: str) -> tuple[str, ...]:
        """The variants ("serial", "prr") the engine captures for a run planned as `variant`."""
        return (variant,)

    def window_steps_or(self, default: int) -> int:
        """Decode steps between the host's looks (and the budget's decisions)."""
        return default

    def window_variant(self, variant: str) -> str:
        """The variant the next window of steps runs (the run was planned as `variant`)."""
        return variant

    def end_window(self, variant: str, median_s: float, hit_rate: float | None = None) -> str:
        """One finished window: its variant, its steps' median time (s) and PRR's hit rate in it.
        -> the variant of the next window."""
        return variant
