"""The speculation budget: how many of the predictor's top-ranked blocks to speculate on
(|P|). Not the DSA top-K: `selector.topk_blocks` is what selection keeps, the budget is
what speculation covers, and it may exceed top-K (a wider P hits more of A for more work).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from prr.runtime.records import LayerStepRecord


class TimingProbe(Protocol):
    """Measures the two stages a budget trades off, on the running device and model shape."""

    device_name: str
    shape_key: str  # what the timings depend on: heads, head_dim, block_size, selector, ...

    def time_select(self, context_blocks: int) -> float:
        """Median seconds of one layer's selection over a context of this many blocks."""
        ...

    def time_speculate(self, predicted_blocks: int, context_blocks: int) -> float:
        """Median seconds of one layer's speculation over this many blocks."""
        ...


class SpeculationBudget(ABC):
    # Capabilities engines dispatch on: `profiles` decides |P| from timings measured before
    # decoding (profiled); `adapts_online` changes its decision while decoding (adaptive).
    profiles: bool = False
    adapts_online: bool = False

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
