"""`ema_membership`: an exponential moving average of selection membership,
s_b <- alpha * s_b + (1 - alpha) * [b in A_t], P = the |P| blocks of highest s (ties to the
lower block id; blocks never selected rank 0, after every block ever selected).

The simplest predictor with memory beyond one step, and the one the CUDA-graph engine runs
on the device (prr/runtime/graph_decode.py, predictor "ema"): `runtime.engine=graph
predictor=ema_membership` and the eager runtime propose the same P. Unlike `ema` it uses no
selector scores, stickiness, recency or calibration.

On backend triton (prr.kernels.predict): propose = the top-k kernel over the state as it is,
update = one launch; a range of layers learns and proposes at once
(`StateRankPredictor.update_layers` / `propose_layers`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from prr.blocks import block_counts, inside_context
from prr.predictors.base import NEVER, StateRankPredictor
from prr.predictors.options import EmaMembershipPredictorOptions
from prr.selectors.base import Selection


class EmaMembershipPredictor(EmaMembershipPredictorOptions, StateRankPredictor):
    # the constructor is EmaMembershipPredictorOptions' (prr.predictors.options: no torch, checked before torch is imported)

    def init_state(self, num_layers: int, batch: int, num_kv_heads: int, max_blocks: int, device: Any) -> Any:
        return torch.zeros(num_layers, batch, num_kv_heads, max_blocks, device=device)  # [L, B, Hkv, NB]

    def rank(self, state: Tensor, layer: int, num_blocks: int | Tensor) -> Tensor:
        nb = block_counts(num_blocks, state.shape[1], state.device)  # [B]
        return state[layer].masked_fill(~inside_context(nb, state.shape[-1]), NEVER)  # [B, Hkv, N]

    update_reads_scores = False  # membership only

    def update_rows(self, rows: Tensor, selection: Selection) -> None:
        from prr.kernels.predict import membership_ema_update

        membership_ema_update(rows, selection.blocks.indices, selection.blocks.count, self.alpha)

    def update(self, state: Tensor, layer: int, selection: Selection) -> None:
        if self.backend == "triton":
            self.update_rows(state[layer], selection)
            return
        member = selection.blocks.mask(state.shape[-1]).to(state.dtype)  # [B, Hkv, N]
        state[layer].mul_(self.alpha).add_(member, alpha=1.0 - self.alpha)
