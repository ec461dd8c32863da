"""`oracle`: P_t = A_t, computed untimed. The 100%-hit upper bound of any predictor.
It ignores the speculation budget: P is exactly the selection."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from prr.blocks import BlockSet
from prr.predictors.base import NEVER, Predictor
from prr.predictors.options import OraclePredictorOptions
from prr.selectors.base import Selection


class OraclePredictor(OraclePredictorOptions, Predictor):
    # uses_budget = False: OraclePredictorOptions' (P = A, whatever |P| the budget asks for)
    needs_current_selection = True
    history_only = False  # P is this step's selection

    def init_state(self, num_layers: int, batch: int, num_kv_heads: int, max_blocks: int, device: Any) -> Any:
        return {"shape": (batch, num_kv_heads, max_blocks), "device": device}

    def rank(self, state: Any, layer: int, num_blocks: int | Tensor) -> Tensor:
        return torch.full(state["shape"], NEVER, device=state["device"])  # unused: propose is exact

    def update(self, state: Any, layer: int, selection: Selection) -> None:
        pass

    def propose(
        self, state: Any, layer: int, num_blocks: int | Tensor, budget_blocks: int,
        current: Selection | None = None, query: Tensor | None = None,
    ) -> BlockSet:
        if current is None:
            raise RuntimeError("the oracle predictor needs the current selection; the runtime must pass it")
        return current.blocks
