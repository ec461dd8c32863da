"""`indexer`: a DeepSeek-V3.2-style lightning indexer selecting TOKENS (issue 52).

Per sparse layer, from the layer's normed hidden state x (the attention input after its RMSNorm,
prr.selectors.indexer_weights's definition):

    q_I = RoPE(x W_qᵀ) [B, H_I, d_I],  w = x W_wᵀ [B, H_I],  k_I = RoPE(LayerNorm(x W_kᵀ)) [d_I] a token
    score(t) = Σ_h w_h · ReLU(q_I,h · k_I(t))       over the row's tokens t < length
    A = the sink tokens ∪ the newest `local_tokens + force_newest` ∪ the best by score, `topk_tokens` in all

one selection per row, shared by every KV head (the indexer has no head of the model's).

Token granularity end to end: the selector runs with `runtime.block_size=1` (refused otherwise,
before the model loads), so a "block id" of the engine IS a token id: A and P are token lists,
repair is A \\ P over tokens, merge folds per-token states, counters count tokens, and every
predictor ranks tokens (its state is [L, B, Hkv, T_max]: ema, an EMA of each token's standardised
index score; ema_membership, of its membership of A).
docs/design.md ("Token-level selection") says why and what it costs.

Where x comes from: the decoder hands each layer's normed hidden state to the attention backend's
`hidden_hook` (prr.model.decoder.Decoder.layers' `normed`), which calls `take_hidden`:
- prefill: x [B, T, hidden] is kept for the layer until its tail selections; `update_metadata`
  writes the index keys of its host range, `select_tail` scores the tail positions;
- decode: x [B, 1, hidden] is projected once by the stacked weights [W_q; W_k; W_w]
  (LayerIndexer.step_weight) into the slot `indexer_projection` (static: capturable);
  `append_metadata` (after the K/V append, at the device positions) turns it into the token's index
  key and the step's index query and head weights (kernels.indexer_step: one launch; the torch
  backend its reference), which `select` reads.
The projections run in the model's dtype, the rest (LayerNorm, RoPE, the scores) in fp32.

Slots (cache.state_slot, per row): `indexer_keys` [B, T_max, d_I] (bf16, fp8 e4m3 with
`indexer_key_scales` [B, T_max] fp32, or fp32 on the torch backend), `indexer_query` [B, H_I, d_I]
fp32, `indexer_head_weights` [B, H_I] fp32, `indexer_projection` [B, H_I·d_I + d_I + H_I] in the
cache's dtype.

Two op backends, one definition: torch (prr.kernels.reference_indexer: the scores in fp32) and,
under runtime backend triton, prr.kernels.indexer_keys / indexer_score (bf16 or fp8 keys) + the
shared top-K over the row's tokens (prr.kernels.topk: radix above 16,384 candidates).
Weights: `weights=random` (seeded, IndexerWeights.init_random_) or `weights=trained`
(prr.selectors.indexer_weights.load_indexer: the model's distilled indexer, or an error naming
`make train-indexer MODEL=...`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor

from prr.blocks import BlockSet
from prr.cache import PagedKVCache
from prr.kernels.reference_indexer import (
    INDEX_DTYPES,
    index_key_append_reference,
    indexer_scores_reference,
    indexer_step_reference,
    quantize_index_keys_reference,
)
from prr.selectors.base import Selection, Selector, tail_rows
from prr.selectors.indexer_weights import IndexerConfig, IndexerWeights, LayerIndexer, load_indexer
from prr.selectors.options import IndexerSelectorOptions

KEYS, SCALES = "indexer_keys", "indexer_key_scales"
QUERY, HEAD_WEIGHTS, PROJECTION = "indexer_query", "indexer_head_weights", "indexer_projection"
SLOT_DTYPES = {**INDEX_DTYPES, "fp32": torch.float32}
NO_HIDDEN = ("selector=indexer needs layer {layer}'s normed hidden states of the prefill (the decoder's hidden "
             "hook, prr.model.decoder.Decoder.layers' `normed`), and this prefill gave only q/k/v: prefill through "
             "the model, or replay a kept prefill that kept them (prr.runtime.eager_run.replay_into; "
             "prr.evaluation.kept_prefill(hidden_layers=))")


class IndexerSelector(IndexerSelectorOptions, Selector):
    # the constructor is IndexerSelectorOptions' (no torch: run.py checks it before importing torch, and
    # the keys against its signature), so the per-run state below is made on first use
    needs_hidden = True  # the decoder hands it each sparse layer's normed hidden state (`take_hidden`)
    bulk_metadata_equals_stepwise = False  # (a one-token tail would need the prompt's last hidden state kept)

    indexer: IndexerWeights | None = None  # fp32 on the CPU (bind_model)

    def _pending(self) -> dict[int, Tensor]:
        """layer -> the prefill's normed hidden states x [B, T, hidden], kept until the layer's tail."""
        return self.__dict__.setdefault("_prefill_hidden", {})

    # --- the model's facts and the weights --------------------------------------------------
    def indexer_config(self) -> IndexerConfig:
        return IndexerConfig(index_heads=self.index_heads, index_dim=self.index_dim, rope_dim=self.rope_dim,
                             dense_layers=tuple(sorted(self.dense_layers)))

    def bind_model(self, config: Any) -> None:
        """config: prr.model.config.ModelConfig -> the indexer's weights for that shape (fp32, CPU;
        moved to the hidden states' device and dtype on first use). Bound again to the same model (the
        graph engine after the eager prefill): kept, not reloaded."""
        if self.indexer is not None and self.__dict__.get("_bound_to") == config:
            return
        self._bound_to = config
        if self.weights == "trained":
            self.indexer = load_indexer(self.model, config, self.indexer_config())
        else:
            self.indexer = IndexerWeights.for_model(config, self.indexer_config(), seed=self.seed).requires_grad_(False)
        self._weights_on: dict[tuple[torch.device, torch.dtype], IndexerWeights] = {}  # its copies where used
        self._step_weights: dict[tuple[int, torch.device, torch.dtype], Tensor] = {}  # (of those copies: rebound, gone)

    @property
    def hidden_size(self) -> int:
        """The model's hidden size (the indexer's input), known once bound (bind_model)."""
        if self.indexer is None:
            raise RuntimeError("selector=indexer has no weights: call selector.bind_model(model.config) first")
        return self.indexer.hidden_size

    def _layer(self, layer: int, like: Tensor) -> tuple[LayerIndexer, Tensor]:
        """The layer's indexer on like's device and dtype, and the RoPE frequencies [rope_dim // 2] fp32."""
        if self.indexer is None:
            raise RuntimeError("selector=indexer has no weights: call selector.bind_model(model.config) before the "
                               "prefill (run.py does)")
        key = (like.device, like.dtype)
        if key not in self._weights_on:
            moved = copy.deepcopy(self.indexer).to(device=like.device, dtype=like.dtype)
            moved.inv_freq = self.indexer.inv_freq.float().to(like.device)  # (fp32 whatever the dtype)
            self._weights_on[key] = moved
        weights = self._weights_on[key]
        return weights.layer(layer), weights.inv_freq

    # --- the cache's slots ------------------------------------------------------------------
    def index_cache(self, cache: PagedKVCache, layer: int) -> tuple[Tensor, Tensor | None]:
        """(keys [B, T_max, d_I] in index_dtype, scales [B, T_max] fp32 for fp8 else None)."""
        if cache.block_size != 1:
            raise ValueError(self.block_size_problems(cache.block_size)[0])
        b, t = cache.batch, cache.max_tokens
        keys = cache.state_slot(layer, KEYS, (b, t, self.index_dim), SLOT_DTYPES[self.index_dtype])
        scales = cache.state_slot(layer, SCALES, (b, t), torch.float32) if self.index_dtype == "fp8" else None
        return keys, scales

    def step_query(self, cache: PagedKVCache, layer: int) -> tuple[Tensor, Tensor]:
        """This decode step's (index queries [B, H_I, d_I] fp32, head weights [B, H_I] fp32)."""
        b = cache.batch
        return (cache.state_slot(layer, QUERY, (b, self.index_heads, self.index_dim), torch.float32),
                cache.state_slot(layer, HEAD_WEIGHTS, (b, self.index_heads), torch.float32))

    def _projection_slot(self, cache: PagedKVCache, layer: int) -> Tensor:
        """[B, H_I·d_I + d_I + H_I]: this decode step's x [W_q; W_k; W_w]ᵀ (take_hidden's)."""
        width = self.index_heads * self.index_dim + self.index_dim + self.index_heads
        return cache.state_slot(layer, PROJECTION, (cache.batch, width), cache.dtype)

    def _step_weight(self, layer: int, like: Tensor) -> Tensor:
        """The layer's LayerIndexer.step_weight [H_I·d_I + d_I + H_I, hidden] on like's device and dtype,
        stacked once; that copy's W_q, W_k, W_w become views of it (one copy of the weights, not two:
        ~2 GiB at the 8B shape in bf16)."""
        indexer = self._layer(layer, like)[0]  # (raises, by name, before bind_model)
        key = (layer, like.device, like.dtype)
        if key not in self._step_weights:
            stacked = indexer.step_weight().contiguous()
            q_rows, k_rows = indexer.wq.shape[0], indexer.wk.shape[0]
            indexer.wq.data, indexer.wk.data = stacked[:q_rows], stacked[q_rows : q_rows + k_rows]
            indexer.ww.data = stacked[q_rows + k_rows :]
            self._step_weights[key] = stacked
        return self._step_weights[key]

    # --- the hidden states ------------------------------------------------------------------
    def take_hidden(self, cache: PagedKVCache, layer: int, x: Tensor, prefill: bool) -> None:
        """x: [B, T, hidden] the layer's normed hidden state (T = the prompt, or 1 at decode)."""
        if self.is_dense_layer(layer):
            return
        if prefill:
            self._pending()[layer] = x
            return
        # in place: a captured step's input (one GEMV for the query heads, the key and the head weights), in
        # the slot's dtype (mm's out= takes no other: x cast as the copy into the slot did before)
        slot = self._projection_slot(cache, layer)  # [B, H_I·d_I + d_I + H_I]
        torch.mm(x[:, 0].to(slot.dtype), self._step_weight(layer, slot).t(), out=slot)

    def hidden_projection(self, cache: PagedKVCache, layer: int) -> tuple[Tensor, Tensor] | None:
        """(W [H_I·d_I + d_I + H_I, hidden], slot [B, H_I·d_I + d_I + H_I]) for an engine that projects a
        decode step's normed hidden state itself (the graph engine's fused GEMVs: the RMSNorm inside
        the projection, the result written into slot: what take_hidden(x) writes); None for a dense
        layer. The weights are stacked by then (update_metadata, at the prefill)."""
        if self.is_dense_layer(layer):
            return None
        slot = self._projection_slot(cache, layer)
        return self._step_weight(layer, slot), slot

    def update_metadata(self, cache: PagedKVCache, layer: int, start: int, end: int) -> None:
        if self.is_dense_layer(layer):
            return
        x = self._pending().get(layer)
        if x is None:
            raise RuntimeError(NO_HIDDEN.format(layer=layer))
        keys, scales = self.index_cache(cache, layer)  # (every slot a decode step writes exists after the prefill)
        self.step_query(cache, layer)
        self._step_weight(layer, self._projection_slot(cache, layer))  # (stacked here: never inside a capture)
        if end <= start:
            return
        indexer, inv_freq = self._layer(layer, x)
        k = indexer.keys(x[:, start:end], torch.arange(start, end, device=x.device), inv_freq)  # [B, n, d_I]
        if scales is None:
            keys[:, start:end] = k.to(keys.dtype)
        else:
            keys[:, start:end], scales[:, start:end] = quantize_index_keys_reference(k)

    def append_metadata(self, cache: PagedKVCache, layer: int, positions: Tensor) -> None:
        """The decode token's index key at positions [B], and this step's index query and head weights,
        from take_hidden's projection."""
        keys, scales = self.index_cache(cache, layer)
        query, head_weights = self.step_query(cache, layer)
        projection = cache.metadata[layer][PROJECTION]  # [B, H_I·d_I + d_I + H_I]
        indexer, inv_freq = self._layer(layer, projection)
        c = indexer.config
        norm = (indexer.key_norm_weight, indexer.key_norm_bias, c.key_norm_eps)
        if self.backend == "triton":
            from prr.kernels.indexer_step import indexer_step_inputs

            indexer_step_inputs(projection, positions, inv_freq, *norm, c.rope_dim, query, head_weights, keys, scales)
            return
        q, w, k = indexer_step_reference(projection, positions, inv_freq, *norm, c.index_heads, c.index_dim, c.rope_dim)
        query.copy_(q)
        head_weights.copy_(w)
        index_key_append_reference(keys, scales, k, positions)

    # --- scores and selection ---------------------------------------------------------------
    def token_scores(self, cache: PagedKVCache, layer: int, lengths: Tensor) -> Tensor:
        """-> [B, T_max] fp32 index scores of this step's query, -inf from each row's length on."""
        keys, scales = self.index_cache(cache, layer)
        query, head_weights = self.step_query(cache, layer)
        return indexer_scores_reference(query, head_weights, keys, scales, lengths, compute_dtype=torch.float32)

    def head_scores(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor) -> Tensor:
        # q: [B, Hkv, G, D] (unused: the indexer scores from its own query) -> [B, Hkv, 1, T_max], one row's
        # scores for every KV head, so every head selects the same tokens
        b, h = q.shape[:2]
        scores = self.token_scores(cache, layer, lengths)
        return scores.view(b, 1, 1, -1).expand(b, h, 1, scores.shape[-1])

    def select_tail(self, q_tail: Tensor, cache: PagedKVCache, layer: int, start: int,
                    queries: Tensor | None = None) -> list[Selection]:
        """The prefill tail's selections, each of position t from the indexer's query at t over the
        index keys of tokens <= t (written here first: nothing later is read)."""
        x = self._pending().get(layer)
        if x is None:
            raise RuntimeError(NO_HIDDEN.format(layer=layer))
        tail = q_tail.shape[3]
        self.update_metadata(cache, layer, start, start + tail)
        keys, scales = self.index_cache(cache, layer)
        indexer, inv_freq = self._layer(layer, x)
        positions = torch.arange(start, start + tail, device=x.device)
        q_i = indexer.queries(x[:, positions], positions, inv_freq).float()  # [B, T, H_I, d_I]
        w = indexer.head_weights(x[:, positions]).float()  # [B, T, H_I]
        b, h = q_tail.shape[:2]
        # Each position's scores the step's own call (its q·K product: CPU matmuls are not
        # batch-invariant) on keys cast to fp32 once (the cast each call would make: the same
        # values); the reduce / force / top-K one call over the positions folded into the batch.
        keys32 = keys.float()  # [B, T_max, d_I]
        lengths = torch.arange(start + 1, start + tail + 1, device=x.device).repeat_interleave(b)  # [T * B], rows (t, b)
        scores = torch.cat([indexer_scores_reference(q_i[:, i], w[:, i], keys32, scales, lengths[i * b : (i + 1) * b],
                                                     compute_dtype=torch.float32) for i in range(tail)])  # [T * B, T_max]
        per_head = scores.view(tail * b, 1, 1, -1).expand(tail * b, h, 1, scores.shape[-1])
        del self._pending()[layer]  # decode reads its own projection from the slot
        return tail_rows(self.selection_from(per_head, lengths, cache.max_blocks), tail)

    def triton_problems(self) -> list[str]:
        from prr.kernels.indexer_keys import MAX_INDEX_DIM
        from prr.kernels.indexer_score import MAX_INDEX_HEADS

        out = []
        if self.index_dtype == "fp32":
            out.append("selector.index_dtype=fp32 has no kernel (the kernels keep bf16 or fp8 index keys)")
        if not 16 <= self.index_dim <= MAX_INDEX_DIM or self.index_dim & (self.index_dim - 1):
            out.append(f"selector.index_dim={self.index_dim} is not a power of two in [16, {MAX_INDEX_DIM}]")
        if self.index_heads > MAX_INDEX_HEADS:
            out.append(f"selector.index_heads={self.index_heads} > the kernel's {MAX_INDEX_HEADS}")
        return out

    def select_triton(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor,
                      num_blocks: Tensor) -> Selection:
        from prr.kernels.indexer_score import indexer_scores
        from prr.kernels.topk import topk_select

        b, h = q.shape[:2]
        keys, scales = self.index_cache(cache, layer)
        query, head_weights = self.step_query(cache, layer)
        scores = indexer_scores(query, head_weights, keys, scales, lengths.to(torch.int32))  # [B, T_max]
        # one top-K a row (the same for every KV head), broadcast to the engine's [B, Hkv, C]
        indices, counts = topk_select(scores.unsqueeze(1), self.topk_blocks, num_blocks.to(torch.int32),
                                      sink_blocks=self.sink_blocks, recent_blocks=self.local_blocks + int(self.force_newest))
        blocks = BlockSet(indices.expand(b, h, indices.shape[-1]).contiguous(), counts.expand(b, h).contiguous())
        # (scores per KV head as the predictors' kernels read them: contiguous, as the torch path's)
        return Selection(blocks=blocks, scores=scores.unsqueeze(1).expand(b, h, scores.shape[-1]).contiguous())
