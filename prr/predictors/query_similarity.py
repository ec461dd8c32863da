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
Selections are kept as id lists (each its distinct block ids ascending, padded, with a count),
W = min(the selections' capacity K, max_blocks) ids each, sized at the first update: memory is
cache_size × (G·D fp32 + W int32) per layer and KV head (+ one list for A_{t−1}, and
last_selected / last_z over max_blocks).

Static shapes (one definition, eager or captured in a CUDA graph): the ring buffer's
`cursor` and `filled` are device counters; rank scores all `cache_size` slots and masks the
unfilled ones (-inf similarity, a vote weight of 0), so the neighbour top-k has a fixed size.
The query reaches `update` through the state: `propose` copies it (normalised) into the
buffer `pending[layer]` and raises the device flag `has_pending[layer]`; `update`
writes the pair into slot `cursor` only where the flag is up, then lowers it. Selections
that arrive without a propose (the prefill tail) therefore pair with nothing, and no Python
value changes from step to step. The query size G·D is not an argument of `init_state`:
`keys` and `pending` are sized by the first propose (an eager warm-up call before any
capture) and never re-allocated; the id lists likewise by the first update (an eager call
before any capture; widened, eagerly only, if a selection of larger capacity comes).

On backend triton (prr.kernels.predict): propose = one launch on the critical path that works
on the lists, not over the max_blocks blocks: normalise, the C cosine similarities (C·G·D),
the neighbours' m lists and the recent window merged (distinct ids and their summed votes:
m × (m + 1 rounded up to a power of two) × K comparisons), z_{t−1} gathered for those ids only,
then P: where at least |P| blocks are candidates (voted or recent) their top |P| (n_c² comparisons,
n_c <= m·K + recent_blocks); where fewer are, every candidate and the first |P| − n_c others of
`fill` (a list of the best blocks by TIE·z_{t−1} that the update writes off the critical path since
it does not depend on the query; fill_width × n_c comparisons, then one sort of the |P| ids). Only where fewer
than |P| are candidates and no fill list holds the rest (fill_width = 0, too short, not yet
written) does it rank the whole row (O(max_blocks), the same launch). Expected work per (row,
KV head) at the 8B shape (K = 32, m = 2, recent_blocks = 1, 8,192 blocks): 4 × 32 = 128 lanes (two
lists and the window, rows rounded up to a power of two), 2 × 128 × 32 comparisons to merge them,
at most 65² to rank them, where the kernel before scanned the 8,192 blocks several times; at |P| =
128 > 65 candidates P needs the fill list (fill_width >= |P| is enough unless blocks outside the
context, z = 0, rank among its first entries), else the row is ranked as before. No timing here:
the H200 numbers come from experiments/bench_predictors.py.
update = one launch (ring-buffer slot, last selection as mask and list, z-scores: O(max_blocks),
off the critical path) + a one-program launch moving the counters + the fill list (the top-k
kernel and a sort of its W entries). The cosine similarities are summed in another order than
torch's einsum, so votes can differ in the last bit: P is the same set unless two blocks' ranks
lie within that (tested on random inputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from prr.blocks import BlockSet, block_counts, inside_context, top_blocks
from prr.kernels.reference_predict import fill_reference
from prr.predictors.base import NEVER, Predictor, stacked_blocks
from prr.predictors.ema import newest_mask, standardise
from prr.predictors.options import QuerySimilarityPredictorOptions
from prr.selectors.base import Selection

TIE = 1e-3  # |z| stays well below 1/TIE, so scores only order blocks of equal votes


@dataclass
class QuerySimilarityState:
    keys: Tensor  # [L, B, Hkv, C, G·D] fp32 normalised past queries (C = cache_size); G·D = 0 until the first propose
    # [L, B, Hkv, C + 1, W] int32: slot j < C the selection query j got, slot C A_{t−1}, each as its
    # distinct block ids ascending, then padding 0 (W = min(the selections' capacity, max_blocks);
    # 0 until the first update), with set_count [L, B, Hkv, C + 1] int32 the ids each holds
    set_ids: Tensor
    set_count: Tensor
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
    layer_range_kernels = True  # update_layers (its update writes no P: no propose_layers)

    def init_state(self, num_layers: int, batch: int, num_kv_heads: int, max_blocks: int, device: Any) -> QuerySimilarityState:
        per_layer = (num_layers, batch, num_kv_heads)
        counter = torch.zeros(num_layers, dtype=torch.int64, device=device)
        return QuerySimilarityState(
            keys=torch.zeros(*per_layer, self.cache_size, 0, device=device),
            set_ids=torch.zeros(*per_layer, self.cache_size + 1, 0, dtype=torch.int32, device=device),
            set_count=torch.zeros(*per_layer, self.cache_size + 1, dtype=torch.int32, device=device),
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
                query, state.keys[layer], state.set_ids[layer], state.set_count[layer], state.last_selected[layer],
                state.last_z[layer], state.filled[one], num_blocks, state.pending[layer], state.has_pending[one],
                self.neighbours, self.recent_blocks, TIE, max(budget_blocks, 0), fill=state.fill[layer],
                fill_valid=state.fill_valid[one]))
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

    def size_for_selection(self, state: QuerySimilarityState, capacity: int) -> None:
        """Widen the id lists to hold selections of `capacity` ids (W = min(capacity, max_blocks)):
        at the first update, an eager call before any capture (the lists are empty until then), or
        eagerly later where a selection of larger capacity comes (the lists kept, padded)."""
        width = min(capacity, state.last_z.shape[-1])
        old = state.set_ids.shape[-1]
        if width <= old:
            return
        if state.set_ids.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"query_similarity's id lists hold {old} ids, a selection of capacity {capacity} came "
                               "during a CUDA-graph capture: run an update with such a selection eagerly before")
        wider = state.set_ids.new_zeros(*state.set_ids.shape[:-1], width)
        wider[..., :old] = state.set_ids
        state.set_ids = wider

    def rank(self, state: QuerySimilarityState, layer: int, num_blocks: int | Tensor) -> Tensor:
        """-> [B, Hkv, max_blocks] for the query given to the last propose of this layer."""
        if state.pending.shape[-1] == 0:
            raise ValueError("query_similarity ranks the query of the last propose(..., query=q); none was given for "
                             f"layer {layer} yet")
        q = state.pending[layer]  # [B, Hkv, G·D]
        max_blocks = state.last_z.shape[-1]
        filled = state.filled[layer]  # 0-dim device tensor
        similarity = torch.einsum("bhcd,bhd->bhc", state.keys[layer], q)  # [B, Hkv, C]
        cached = torch.arange(self.cache_size, device=q.device) < filled  # [C]
        best, which = similarity.masked_fill(~cached, NEVER).topk(self.neighbours, dim=-1)  # [B, Hkv, m]
        width = state.set_ids.shape[-1]
        ids = torch.gather(state.set_ids[layer], 2, which.unsqueeze(-1).expand(-1, -1, -1, width))  # [B, Hkv, m, W]
        sets = BlockSet(ids, torch.gather(state.set_count[layer], 2, which)).mask(max_blocks)  # [B, Hkv, m, N]
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

            self.size_for_selection(state, selection.blocks.capacity)
            one = slice(layer, layer + 1)
            query_similarity_update(selection.scores, selection.blocks.indices, selection.blocks.count, state.keys[layer],
                                    state.set_ids[layer], state.set_count[layer], state.pending[layer],
                                    state.has_pending[one], state.cursor[one], state.filled[one],
                                    state.last_selected[layer], state.last_z[layer])
            self._write_fill(state, layer)
            return
        chosen = selection.blocks.mask(state.last_z.shape[-1])  # [B, Hkv, N]
        self.size_for_selection(state, selection.blocks.capacity)
        # the selection as its list (distinct ids ascending; reference_predict.selection_lists_reference)
        listed = BlockSet.from_mask(chosen, state.set_ids.shape[-1])
        ids, count = listed.indices.to(torch.int32), listed.count.to(torch.int32)  # [B, Hkv, W], [B, Hkv]
        set_ids, set_count = state.set_ids[layer], state.set_count[layer]  # [B, Hkv, C + 1, W], [B, Hkv, C + 1] views
        set_ids[:, :, self.cache_size], set_count[:, :, self.cache_size] = ids, count  # slot C: A_{t−1}
        if state.pending.shape[-1] != 0:  # structural: false only before the first propose of the run
            # Pair this step's query with its selection where propose left one; else rewrite the slot as it was.
            paired = state.has_pending[layer]  # 0-dim bool
            slot = state.cursor[layer : layer + 1]  # [1] int64
            keys = state.keys[layer]  # [B, Hkv, C, G·D] view
            keys.index_copy_(2, slot, torch.where(paired, state.pending[layer].unsqueeze(2), keys.index_select(2, slot)))
            set_ids.index_copy_(2, slot, torch.where(paired, ids.unsqueeze(2), set_ids.index_select(2, slot)))
            set_count.index_copy_(2, slot, torch.where(paired, count.unsqueeze(2), set_count.index_select(2, slot)))
            step = paired.long()
            state.cursor[layer] = (state.cursor[layer] + step) % self.cache_size
            state.filled[layer] = (state.filled[layer] + step).clamp(max=self.cache_size)
            state.has_pending[layer].fill_(False)
        state.last_selected[layer] = chosen
        state.last_z[layer] = standardise(selection.scores)
        self._write_fill(state, layer)

    def update_layers(self, state: QuerySimilarityState, first: int, selections: list[Selection],
                      blocks: BlockSet | None = None) -> None:
        """`update` of layers first, first + 1, ... in the launches of one (triton; the engine's
        learning at once, StaticPlan.learn_layers_at_once: at the step's end on the side stream,
        not after each layer). blocks: their A stacked [L, B, Hkv, C] where the engine has that copy."""
        from prr.kernels.predict import query_similarity_update_layers

        layers = len(selections)
        span = slice(first, first + layers)
        for selection in selections:
            self.size_for_selection(state, selection.blocks.capacity)
        a = stacked_blocks(selections, blocks)
        query_similarity_update_layers(torch.stack([s.scores for s in selections]), a.indices, a.count,
                                       state.keys[span], state.set_ids[span], state.set_count[span], state.pending[span],
                                       state.has_pending[span], state.cursor[span], state.filled[span],
                                       state.last_selected[span], state.last_z[span])
        for layer in range(first, first + layers):
            self._write_fill(state, layer)

    def _write_fill(self, state: QuerySimilarityState, layer: int) -> None:
        """fill <- the W best blocks of TIE·last_z, best first, ties to the lower id
        (reference_predict.fill_reference; on triton one launch, `query_similarity_fill`, for rows
        the kernels hold in registers, else the top-k kernel's set ordered by a sort of W)."""
        width = state.fill.shape[-1]
        if width == 0:
            return
        if self.backend == "triton":
            from prr.kernels.predict import fill_in_one_launch, query_similarity_fill

            if fill_in_one_launch(state.last_z.shape[-1]):
                query_similarity_fill(state.last_z[layer], TIE, state.fill[layer], state.fill_valid[layer])
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
