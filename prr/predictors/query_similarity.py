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

Static shapes (one definition, eager or captured in a CUDA graph): the ring buffer's
`cursor` and `filled` are device counters; rank scores all `cache_size` slots and masks the
unfilled ones (-inf similarity, a vote weight of 0), so the neighbour top-k has a fixed size.
The query reaches `update` through the state: `propose` copies it (normalised) into the
buffer `pending[layer]` and raises the device flag `has_pending[layer]`; `update`
writes the pair into slot `cursor` only where the flag is up, then lowers it. Selections
that arrive without a propose (the prefill tail) therefore pair with nothing, and no Python
value changes from step to step. The query size G·D is not an argument of `init_state`:
`keys` and `pending` are sized by the first propose (an eager warm-up call before any
capture) and never re-allocated.

On backend triton (prr.kernels.predict): propose = one launch (normalise, similarities, the
neighbours' votes, the rank and its top-k: counted among the voted blocks when they hold it;
where fewer than |P| got a vote, every voted block and the best others by TIE·last_z, read from
`fill`, a list the update writes off the critical path since it does not depend on the query,
when fill_width > 0; else the whole row's top-k);
update = one launch (ring-buffer slot, last selection and z-scores) + a one-program launch moving
the counters + the fill list (the top-k kernel and a sort of its W entries). The cosine similarities
are summed in another order than torch's einsum, so votes can differ in the last bit: P is the
same set unless two blocks' ranks lie within that (tested on random inputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from prr.blocks import BlockSet, block_counts, inside_context, top_blocks
from prr.kernels.reference_predict import fill_reference
from prr.predictors.base import NEVER, Predictor
from prr.predictors.ema import newest_mask, standardise
from prr.predictors.options import QuerySimilarityPredictorOptions
from prr.selectors.base import Selection

TIE = 1e-3  # |z| stays well below 1/TIE, so scores only order blocks of equal votes


@dataclass
class QuerySimilarityState:
    keys: Tensor  # [L, B, Hkv, C, G·D] fp32 normalised past queries (C = cache_size); G·D = 0 until the first propose
    sets: Tensor  # [L, B, Hkv, C, max_blocks] bool: the selection each past query got
    filled: Tensor  # [L] int64 pairs cached per layer (<= C)
    cursor: Tensor  # [L] int64 ring-buffer slot the next pair goes to
    pending: Tensor  # [L, B, Hkv, G·D] fp32 this step's normalised query, written by propose, paired in update
    has_pending: Tensor  # [L] bool: a propose of this step left a query in `pending` for update to pair
    last_selected: Tensor  # [L, B, Hkv, max_blocks] bool: A_{t−1}
    last_z: Tensor  # [L, B, Hkv, max_blocks] fp32 standardised scores of step t−1
    # [L, B, Hkv, W] int32 (W = fill_width; 0: none): the W blocks of largest TIE·last_z, best first
    # (ties to the lower id), written by update off the critical path: where fewer than |P| blocks
    # got a vote the kernel's propose takes the rest from it instead of ranking the whole row (the
    # torch path ignores it)
    fill: Tensor
    fill_valid: Tensor  # [L] bool: fill matches last_z


class QuerySimilarityPredictor(QuerySimilarityPredictorOptions, Predictor):
    # the constructor is QuerySimilarityPredictorOptions' (prr.predictors.options: no torch, checked before torch is imported)
    needs_query = True  # the runtime passes propose(..., query=q)
    history_only = False  # ranks this step's query

    def init_state(self, num_layers: int, batch: int, num_kv_heads: int, max_blocks: int, device: Any) -> QuerySimilarityState:
        per_layer = (num_layers, batch, num_kv_heads)
        counter = torch.zeros(num_layers, dtype=torch.int64, device=device)
        return QuerySimilarityState(
            keys=torch.zeros(*per_layer, self.cache_size, 0, device=device),
            sets=torch.zeros(*per_layer, self.cache_size, max_blocks, dtype=torch.bool, device=device),
            filled=counter, cursor=counter.clone(),
            pending=torch.zeros(*per_layer, 0, device=device),
            has_pending=torch.zeros(num_layers, dtype=torch.bool, device=device),
            last_selected=torch.zeros(*per_layer, max_blocks, dtype=torch.bool, device=device),
            last_z=torch.zeros(*per_layer, max_blocks, device=device),
            fill=torch.zeros(*per_layer, min(self.fill_width, max_blocks), dtype=torch.int32, device=device),
            fill_valid=torch.zeros(num_layers, dtype=torch.bool, device=device),
        )

    def triton_problems(self) -> list[str]:
        return []

    def propose(
        self, state: QuerySimilarityState, layer: int, num_blocks: int | Tensor, budget_blocks: int,
        current: Selection | None = None, query: Tensor | None = None,
    ) -> BlockSet:
        """query: [B, Hkv, G, D] this step's (post-RoPE) query; required."""
        if query is None:
            raise ValueError("query_similarity needs this step's query: call propose(..., query=q) with q [B, Hkv, G, D]"
                             " (prr's runtime does so for predictors with needs_query=True)")
        if self.backend == "triton":
            from prr.kernels.predict import query_similarity_propose

            self.size_for_query(state, query[0, 0].numel())
            one = slice(layer, layer + 1)
            return BlockSet(*query_similarity_propose(
                query, state.keys[layer], state.sets[layer], state.last_selected[layer], state.last_z[layer],
                state.filled[one], num_blocks, state.pending[layer], state.has_pending[one], self.neighbours,
                self.recent_blocks, TIE, max(budget_blocks, 0), fill=state.fill[layer], fill_valid=state.fill_valid[one]))
        q = F.normalize(query.float().flatten(2), dim=-1)  # [B, Hkv, G·D]
        self.size_for_query(state, q.shape[-1])
        state.pending[layer] = q
        state.has_pending[layer].fill_(True)  # a device fill: setting a Python bool would copy from the host
        return top_blocks(self.rank(state, layer, num_blocks), budget_blocks)

    def size_for_query(self, state: QuerySimilarityState, query_size: int) -> None:
        """Size the query buffers for queries of query_size = G·D values, once (a host shape; an
        engine calls it before capturing, so no buffer is replaced afterwards)."""
        if state.pending.shape[-1] == query_size:
            return
        if state.pending.shape[-1] != 0:
            raise ValueError(f"query size changed from {state.pending.shape[-1]} to {query_size} within a run")
        state.keys = state.keys.new_zeros(*state.keys.shape[:-1], query_size)
        state.pending = state.pending.new_zeros(*state.pending.shape[:-1], query_size)

    def rank(self, state: QuerySimilarityState, layer: int, num_blocks: int | Tensor) -> Tensor:
        """-> [B, Hkv, max_blocks] for the query given to the last propose of this layer."""
        if state.pending.shape[-1] == 0:
            raise ValueError("query_similarity ranks the query of the last propose(..., query=q); none was given for "
                             f"layer {layer} yet")
        q = state.pending[layer]  # [B, Hkv, G·D]
        max_blocks = state.sets.shape[-1]
        filled = state.filled[layer]  # 0-dim device tensor
        similarity = torch.einsum("bhcd,bhd->bhc", state.keys[layer], q)  # [B, Hkv, C]
        cached = torch.arange(self.cache_size, device=q.device) < filled  # [C]
        best, which = similarity.masked_fill(~cached, NEVER).topk(self.neighbours, dim=-1)  # [B, Hkv, m]
        sets = torch.gather(state.sets[layer], 2, which.unsqueeze(-1).expand(-1, -1, -1, max_blocks))  # [B, Hkv, m, N]
        weight = torch.where(best > NEVER, 1.5 + best / 2, 0.0)  # unfilled slots picked when filled < m do not vote
        votes = (weight.unsqueeze(-1) * sets).sum(2)  # [B, Hkv, N]
        votes = torch.where(filled > 0, votes, state.last_selected[layer].float())  # no pair cached yet: A_{t−1} stands in
        nb = block_counts(num_blocks, q.shape[0], q.device)  # [B]
        recent = newest_mask(nb, self.recent_blocks, max_blocks)  # [B, 1, N]
        score = votes + (2 * self.neighbours + 1) * recent + TIE * state.last_z[layer]
        return score.masked_fill(~inside_context(nb, max_blocks), NEVER)

    def update(self, state: QuerySimilarityState, layer: int, selection: Selection) -> None:
        if self.backend == "triton":
            from prr.kernels.predict import query_similarity_update

            one = slice(layer, layer + 1)
            query_similarity_update(selection.scores, selection.blocks.indices, selection.blocks.count, state.keys[layer],
                                    state.sets[layer], state.pending[layer], state.has_pending[one], state.cursor[one],
                                    state.filled[one], state.last_selected[layer], state.last_z[layer])
            self._write_fill(state, layer)
            return
        chosen = selection.blocks.mask(state.sets.shape[-1])  # [B, Hkv, N]
        if state.pending.shape[-1] != 0:  # structural: false only before the first propose of the run
            # Pair this step's query with its selection where propose left one; else rewrite the slot as it was.
            paired = state.has_pending[layer]  # 0-dim bool
            slot = state.cursor[layer : layer + 1]  # [1] int64
            keys, sets = state.keys[layer], state.sets[layer]  # [B, Hkv, C, G·D], [B, Hkv, C, N] views
            keys.index_copy_(2, slot, torch.where(paired, state.pending[layer].unsqueeze(2), keys.index_select(2, slot)))
            sets.index_copy_(2, slot, torch.where(paired, chosen.unsqueeze(2), sets.index_select(2, slot)))
            step = paired.long()
            state.cursor[layer] = (state.cursor[layer] + step) % self.cache_size
            state.filled[layer] = (state.filled[layer] + step).clamp(max=self.cache_size)
            state.has_pending[layer].fill_(False)
        state.last_selected[layer] = chosen
        state.last_z[layer] = standardise(selection.scores)
        self._write_fill(state, layer)

    def _write_fill(self, state: QuerySimilarityState, layer: int) -> None:
        """fill <- the W best blocks of TIE·last_z, best first, ties to the lower id
        (reference_predict.fill_reference; on triton the top-k kernel's set ordered by a sort of W)."""
        width = state.fill.shape[-1]
        if width == 0:
            return
        ranked = TIE * state.last_z[layer]  # [B, Hkv, N] fp32, as the rank adds it
        if self.backend == "triton":
            from prr.kernels.predict import propose_top

            batch, n = ranked.shape[0], ranked.shape[-1]
            idx, _ = propose_top(ranked, width, torch.full((batch,), n, dtype=torch.int32, device=ranked.device))
            order = torch.sort(ranked.gather(-1, idx.long()), dim=-1, descending=True, stable=True).indices
            state.fill[layer] = idx.gather(-1, order)  # (the set in ascending order: stable keeps ties by id)
        else:
            state.fill[layer] = fill_reference(state.last_z[layer], TIE, width)
        state.fill_valid[layer].fill_(True)
