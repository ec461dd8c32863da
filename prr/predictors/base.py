"""The predictor interface: from history only (steps < t), rank the blocks that decode
step t will probably select; the speculation budget then decides how many of the
top-ranked blocks form the predicted set P.

State lives in an explicit object made by `init_state` and handed back on every call,
so one predictor instance can serve several runs and the runtime owns all state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from torch import Tensor

from prr.blocks import BlockSet, top_blocks
from prr.selectors.base import Selection

NEVER = float("-inf")  # a rank that keeps a block out of P whatever the budget


class Predictor(ABC):
    # The oracle sees the current step's selection (computed untimed); nobody else may.
    needs_current_selection: bool = False

    @abstractmethod
    def init_state(self, num_layers: int, batch: int, num_kv_heads: int, max_blocks: int, device: Any) -> Any:
        """A fresh state for one run."""

    @abstractmethod
    def rank(self, state: Any, layer: int, num_blocks: int) -> Tensor:
        """-> [B, Hkv, max_blocks] fp32 ranking for the next step; NEVER for blocks not to propose."""

    @abstractmethod
    def update(self, state: Any, layer: int, selection: Selection) -> None:
        """Learn from this step's selection A_t of `layer` (in place)."""

    def calibrate(self, history: list[list[Selection] | None]) -> dict[str, Any]:
        """Fit parameters to selections of the prefill tail (history[layer] = A over steps,
        None for dense layers). Returns what was chosen, for the run record."""
        return {}

    def propose(
        self, state: Any, layer: int, num_blocks: int, budget_blocks: int, current: Selection | None = None
    ) -> BlockSet:
        """P: the `budget_blocks` best-ranked blocks. -> BlockSet [B, Hkv, budget_blocks]."""
        return top_blocks(self.rank(state, layer, num_blocks), budget_blocks)
