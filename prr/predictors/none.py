"""`none`: P = ∅, i.e. serial DSA: everything selected is attended in the repair stage."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from prr.blocks import BlockSet
from prr.predictors.base import NEVER, Predictor
from prr.selectors.base import Selection


class NoPredictor(Predictor):
    speculates = False  # P is always empty: serial DSA
    def init_state(self, num_layers: int, batch: int, num_kv_heads: int, max_blocks: int, device: Any) -> Any:
        return {"shape": (batch, num_kv_heads, max_blocks), "device": device}

    def rank(self, state: Any, layer: int, num_blocks: int | Tensor) -> Tensor:
        return torch.full(state["shape"], NEVER, device=state["device"])

    def update(self, state: Any, layer: int, selection: Selection) -> None:
        pass  # nothing to learn: P is always empty

    def propose(
        self, state: Any, layer: int, num_blocks: int | Tensor, budget_blocks: int,
        current: Selection | None = None, query: Tensor | None = None,
    ) -> BlockSet:
        b, h, _ = state["shape"]  # capacity 0 whatever the budget: a static shape, no speculation
        return BlockSet.empty(b, h, state["device"])
