"""`last_step`: P_t = A_{t-1}, ranked by the previous step's selector scores (so a budget
smaller than |A_{t-1}| keeps its best blocks; ties to the lower block id).

On backend triton (prr.kernels.predict): propose = the top-k kernel over the state as it is
(it masks blocks past the context itself), update = one launch; a range of layers learns and
proposes at once (`StateRankPredictor.update_layers` / `propose_layers`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from prr.blocks import block_counts, inside_context
from prr.predictors.base import NEVER, StateRankPredictor
from prr.selectors.base import Selection


class LastStepPredictor(StateRankPredictor):
    def init_state(self, num_layers: int, batch: int, num_kv_heads: int, max_blocks: int, device: Any) -> Any:
        # rank per layer: [L, B, Hkv, max_blocks]; NEVER until a selection is seen
        return torch.full((num_layers, batch, num_kv_heads, max_blocks), NEVER, device=device)

    def rank(self, state: Tensor, layer: int, num_blocks: int | Tensor) -> Tensor:
        nb = block_counts(num_blocks, state.shape[1], state.device)  # [B]
        # A_{t-1} lies inside the context already; the mask only guards a row whose context shrank.
        return state[layer].masked_fill(~inside_context(nb, state.shape[-1]), NEVER)  # [B, Hkv, N]

    def update_rows(self, rows: Tensor, selection: Selection) -> None:
        from prr.kernels.predict import last_step_update

        last_step_update(selection.scores, selection.blocks.indices, selection.blocks.count, rows)

    def update(self, state: Tensor, layer: int, selection: Selection) -> None:
        if self.backend == "triton":
            self.update_rows(state[layer], selection)
            return
        chosen = selection.blocks.mask(state.shape[-1])  # [B, Hkv, N]
        # Forced blocks may score -inf-free but low; any finite rank keeps them in P.
        finite = torch.nan_to_num(selection.scores, neginf=-1e30, posinf=1e30)
        state[layer] = torch.where(chosen, finite, torch.full_like(finite, NEVER))
