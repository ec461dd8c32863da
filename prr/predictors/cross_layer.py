"""`cross_layer`: predict layer l's set from the layer below's selection at the same decode
step, optionally mixed with the temporal EMA of layer l itself.

The runtime updates the predictor layer by layer inside a step, so when layer l proposes,
the nearest sparse layer below it (l−1, or further down past dense layers) has already
been selected this step; that selection is history for layer l (it never sees its own
current selection). The source c is found structurally, the same on every step: the
nearest layer below l that has ever received an update (`updated_layers`, a host set that
changes only when a layer gets its first selection; dense layers never get one). In decode
every sparse layer below l was selected earlier in the same step, so c's latest selection
is this step's. With c = that source layer:

    cross(b) = z_{c,t}(b) + source_stickiness · 1[b ∈ A_{c,t}]       z: standardised scores
    rank(b)  = (1 − w) · cross(b) + w · ema_l(b)                    w = temporal_weight

ema_l is `ema`'s rank for layer l (prr/predictors/ema.py, calibrated on the prefill tail
when calibrate=true). When no layer below has ever been selected (the first sparse layer),
rank = ema_l alone. w = 0: pure cross-layer; w = 1: the plain EMA.

On backend triton (prr.kernels.predict): update = one launch (ema's update kernel, also writing
z and the selection's mask), propose = one rank launch + the top-k kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from prr.blocks import BlockSet, block_counts, inside_context
from prr.predictors.base import NEVER, Predictor
from prr.predictors.ema import EmaPredictor, EmaState, standardise
from prr.predictors.options import CrossLayerPredictorOptions
from prr.selectors.base import Selection


@dataclass
class CrossLayerState:
    ema: EmaState  # the temporal part, per layer
    z: Tensor  # [L, B, Hkv, max_blocks] fp32 standardised scores of each layer's latest selection
    selected: Tensor  # [L, B, Hkv, max_blocks] bool: each layer's latest selection
    # Layers that ever received a selection: structural (dense layers never do), fixed once the
    # first step has run, so a graph captured after it replays the same source layers.
    updated_layers: set[int] = field(default_factory=set)


class CrossLayerPredictor(CrossLayerPredictorOptions, Predictor):
    # the constructor is CrossLayerPredictorOptions' (prr.predictors.options: no torch, checked before torch is imported)
    temporal_class = EmaPredictor
    history_only = False  # reads the layer below's selection of the same step

    def init_state(self, num_layers: int, batch: int, num_kv_heads: int, max_blocks: int, device: Any) -> CrossLayerState:
        shape = (num_layers, batch, num_kv_heads, max_blocks)
        return CrossLayerState(self.temporal.init_state(num_layers, batch, num_kv_heads, max_blocks, device),
                               torch.zeros(shape, device=device), torch.zeros(shape, dtype=torch.bool, device=device))

    def source_layer(self, state: CrossLayerState, layer: int) -> int | None:
        """The nearest layer below `layer` that has ever been selected, if any (see the module docstring)."""
        below = [i for i in state.updated_layers if i < layer]
        return max(below) if below else None

    def triton_problems(self) -> list[str]:
        return []

    def set_backend(self, backend: str) -> str:
        self.temporal.set_backend(backend)
        return super().set_backend(backend)

    def propose(self, state: CrossLayerState, layer: int, num_blocks: int | Tensor, budget_blocks: int,
                current: Selection | None = None, query: Tensor | None = None) -> BlockSet:
        source = self.source_layer(state, layer)
        if self.backend != "triton" or budget_blocks <= 0:
            return super().propose(state, layer, num_blocks, budget_blocks)
        if source is None or self.temporal_weight == 1.0:  # ema's rank alone
            return self.temporal.propose(state.ema, layer, num_blocks, budget_blocks)
        from prr.kernels.predict import cross_layer_rank, propose_top, row_counts

        nb = row_counts(num_blocks, state.z.shape[1], state.z.device)
        e, one = state.ema, slice(layer, layer + 1)
        rank = cross_layer_rank(state.z[source], state.selected[source], self.source_stickiness, self.temporal_weight, nb,
                                e.ema[layer], e.last_selected[layer], e.stickiness[one], e.recency[one],
                                self.temporal.recent_blocks)
        return BlockSet(*propose_top(rank, budget_blocks, nb))

    def proposals_after_update(self, state: CrossLayerState, layer: int) -> list[tuple[int, bool]]:
        """This layer's next P where it ranks by its own EMA alone (no source below, or w = 1), and
        this step's P of the next selected layer above, whose source this layer is (its own EMA
        is not updated before its own selection, so the P is the one it would propose itself)."""
        out = [(layer, True)] if self.source_layer(state, layer) is None or self.temporal_weight == 1.0 else []
        above = [i for i in state.updated_layers if i > layer]
        if above and self.temporal_weight < 1.0:
            out.append((min(above), False))
        return out

    def proposed_ahead(self, state: CrossLayerState, layer: int) -> bool:
        return layer in state.updated_layers  # structural: fixed once every sparse layer has learned once

    def rank(self, state: CrossLayerState, layer: int, num_blocks: int | Tensor) -> Tensor:
        nb = block_counts(num_blocks, state.z.shape[1], state.z.device)  # [B]
        temporal = self.temporal.rank(state.ema, layer, nb)  # [B, Hkv, N], NEVER past the context
        source = self.source_layer(state, layer)
        if source is None or self.temporal_weight == 1.0:
            return temporal
        cross = state.z[source] + self.source_stickiness * state.selected[source]  # [B, Hkv, N]
        w = self.temporal_weight
        score = (1 - w) * cross + w * temporal if w > 0 else cross
        return score.masked_fill(~inside_context(nb, score.shape[-1]), NEVER)

    def update(self, state: CrossLayerState, layer: int, selection: Selection) -> None:
        if self.backend == "triton":
            from prr.kernels.predict import ema_update

            e = state.ema
            ema_update(selection.scores, selection.blocks.indices, selection.blocks.count, e.alpha[layer : layer + 1],
                       e.ema[layer], e.last_selected[layer], z_out=state.z[layer], selected_out=state.selected[layer])
            state.updated_layers.add(layer)
            return
        self.temporal.update(state.ema, layer, selection)
        state.z[layer] = standardise(selection.scores)
        state.selected[layer] = selection.blocks.mask(state.z.shape[-1])
        state.updated_layers.add(layer)  # structural: changes on a layer's first selection only

    def calibrate(self, history: list[list[Selection] | None]) -> dict[str, Any]:
        """Calibrates the temporal EMA (see EmaPredictor.calibrate); the cross-layer part has no fitted parameters."""
        return self.temporal.calibrate(history)
