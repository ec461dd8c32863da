"""`query_similarity`: reuse the selections of similar past queries (after ReTopK,
arXiv 2607.27692; our reading of its description).

Per layer and KV head a ring buffer holds the last `cache_size` (query, selected set)
pairs; the query of a KV head is its group's G query heads concatenated, L2-normalised.
At step t, with the current query q_t (known before selection runs):

    s_j      = cos(q_t, q_j)                                   for each cached pair j
    N        = the `neighbours` cached pairs of highest s_j
    rank(b)  = Σ_{j∈N} (1.5 + s_j / 2) · 1[b ∈ A_j]             each neighbour's vote in [1, 2]
             + (2m + 1) · 1[b among the `recent_blocks` newest] the recent window, first (m = neighbours)
             + TIE · z_{t−1}(b)                                 last selector scores: order within
                                                                equal votes, and fill a budget
                                                                larger than the union

so P is the union of the neighbours' selections and the recent window when |P| covers it,
the best-voted part of it otherwise. Before any pair is cached (the prefill tail reaches
predictors as selections without queries) the last selection stands in for the neighbours.
Memory is bounded: cache_size × (G·D fp32 + max_blocks bool) per layer and KV head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from prr.blocks import BlockSet, top_blocks
from prr.predictors.base import NEVER, Predictor
from prr.predictors.ema import newest_mask, standardise
from prr.selectors.base import Selection

TIE = 1e-3  # |z| stays well below 1/TIE, so scores only order blocks of equal votes


@dataclass
class QuerySimilarityState:
    keys: Tensor  # [L, B, Hkv, C, G·D] fp32 normalised past queries (C = cache_size)
    sets: Tensor  # [L, B, Hkv, C, max_blocks] bool: the selection each past query got
    filled: list[int]  # [L] pairs cached per layer (<= C)
    cursor: list[int]  # [L] ring-buffer slot the next pair goes to
    pending: list[Tensor | None]  # [L] this step's query [B, Hkv, G·D], set by propose, paired in update
    last_selected: Tensor  # [L, B, Hkv, max_blocks] bool: A_{t−1}
    last_z: Tensor  # [L, B, Hkv, max_blocks] fp32 standardised scores of step t−1


class QuerySimilarityPredictor(Predictor):
    needs_query = True  # the runtime passes propose(..., query=q)

    def __init__(self, cache_size: int = 64, neighbours: int = 2, recent_blocks: int = 1) -> None:
        if cache_size < 1:
            raise ValueError(f"predictor.cache_size={cache_size} must be >= 1 (past queries kept per layer and KV head)")
        if not 1 <= neighbours <= cache_size:
            raise ValueError(f"predictor.neighbours={neighbours} must lie in [1, cache_size={cache_size}]")
        if recent_blocks < 0:
            raise ValueError(f"predictor.recent_blocks={recent_blocks} must be >= 0")
        self.cache_size, self.neighbours, self.recent_blocks = cache_size, neighbours, recent_blocks

    def init_state(self, num_layers: int, batch: int, num_kv_heads: int, max_blocks: int, device: Any) -> QuerySimilarityState:
        # keys are sized on the first query (G·D is not an argument of init_state)
        per_layer = (num_layers, batch, num_kv_heads)
        return QuerySimilarityState(
            keys=torch.zeros(*per_layer, self.cache_size, 0, device=device),
            sets=torch.zeros(*per_layer, self.cache_size, max_blocks, dtype=torch.bool, device=device),
            filled=[0] * num_layers, cursor=[0] * num_layers, pending=[None] * num_layers,
            last_selected=torch.zeros(*per_layer, max_blocks, dtype=torch.bool, device=device),
            last_z=torch.zeros(*per_layer, max_blocks, device=device),
        )

    def propose(
        self, state: QuerySimilarityState, layer: int, num_blocks: int, budget_blocks: int,
        current: Selection | None = None, query: Tensor | None = None,
    ) -> BlockSet:
        """query: [B, Hkv, G, D] this step's (post-RoPE) query; required."""
        if query is None:
            raise ValueError("query_similarity needs this step's query: call propose(..., query=q) with q [B, Hkv, G, D]"
                             " (prr's runtime does so for predictors with needs_query=True)")
        state.pending[layer] = F.normalize(query.float().flatten(2), dim=-1)  # [B, Hkv, G·D]
        return top_blocks(self.rank(state, layer, num_blocks), budget_blocks)

    def rank(self, state: QuerySimilarityState, layer: int, num_blocks: int) -> Tensor:
        """-> [B, Hkv, max_blocks] for the query given to the last propose of this layer."""
        q = state.pending[layer]
        if q is None:
            raise ValueError("query_similarity ranks the query of the last propose(..., query=q); none was given for "
                             f"layer {layer} this step")
        max_blocks = state.sets.shape[-1]
        filled = state.filled[layer]
        if filled == 0:
            votes = state.last_selected[layer].float()  # no pair cached yet: the last selection stands in
        else:
            keys = state.keys[layer, :, :, :filled]  # [B, Hkv, F, G·D]
            similarity = torch.einsum("bhfd,bhd->bhf", keys, q)  # [B, Hkv, F]
            best, which = similarity.topk(min(self.neighbours, filled), dim=-1)  # [B, Hkv, m]
            sets = torch.gather(state.sets[layer, :, :, :filled], 2,
                                which.unsqueeze(-1).expand(-1, -1, -1, max_blocks))  # [B, Hkv, m, N]
            votes = ((1.5 + best / 2).unsqueeze(-1) * sets).sum(2)  # [B, Hkv, N]
        recent = newest_mask(num_blocks, self.recent_blocks, max_blocks, q.device)
        score = votes + (2 * self.neighbours + 1) * recent + TIE * state.last_z[layer]
        inside = torch.arange(max_blocks, device=q.device) < num_blocks
        return score.masked_fill(~inside, NEVER)

    def update(self, state: QuerySimilarityState, layer: int, selection: Selection) -> None:
        chosen = selection.blocks.mask(state.sets.shape[-1])  # [B, Hkv, N]
        q = state.pending[layer]
        if q is not None:  # pair this step's query with its selection
            if state.keys.shape[-1] != q.shape[-1]:
                if any(state.filled):
                    raise ValueError(f"query size changed from {state.keys.shape[-1]} to {q.shape[-1]} within a run")
                state.keys = state.keys.new_zeros(*state.keys.shape[:-1], q.shape[-1])
            slot = state.cursor[layer]
            state.keys[layer, :, :, slot] = q
            state.sets[layer, :, :, slot] = chosen
            state.cursor[layer] = (slot + 1) % self.cache_size
            state.filled[layer] = min(state.filled[layer] + 1, self.cache_size)
            state.pending[layer] = None
        state.last_selected[layer] = chosen
        state.last_z[layer] = standardise(selection.scores)
