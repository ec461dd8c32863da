"""`fixed`: |P| = ratio × |A| (the selector's top-K, or every block for `dense`), or an absolute `blocks` count."""

from __future__ import annotations

from prr.budget.base import SpeculationBudget


class FixedBudget(SpeculationBudget):
    def __init__(self, ratio: float = 1.0, blocks: int | None = None) -> None:
        if ratio < 0:
            raise ValueError(f"budget.ratio={ratio} must be >= 0 (|P| = ratio × |A|)")
        if blocks is not None and blocks < 0:
            raise ValueError(f"budget.blocks={blocks} must be >= 0 or null")
        self.ratio = ratio
        self.blocks = blocks

    def static_blocks(self, selected_blocks: int) -> int:
        return self.blocks if self.blocks is not None else round(self.ratio * selected_blocks)

    def predicted_blocks(self, layer: int, context_blocks: int, selected_blocks: int) -> int:
        n = self.blocks if self.blocks is not None else round(self.ratio * selected_blocks)
        return min(n, context_blocks)
