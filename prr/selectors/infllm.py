"""`infllm` (arXiv 2402.04617) in prr's block framework.

InfLLM keeps the initial tokens (attention sinks) and a local window always attended, and
retrieves older context in blocks, each summarised by r representative tokens: those that
received the most attention while they were inside the local window. Block score =
Σ_heads ⟨q_h, mean representative key of the block⟩; the top-k blocks are attended.

Mapping onto prr:
- blocks are the cache's pages (`runtime.block_size` tokens, not InfLLM's 128);
- initial tokens = `sink_blocks`, local window = `local_blocks` + the newest block
  (`force_newest`): all forced by the base class, so they are in every selection;
- representatives (`representatives` = r, default 4; at most block_size): the runtime does
  not hand selectors the queries of past steps, so "received the most attention while
  inside the local window" is approximated with **the query of the step at which the
  block is finalised**: the first selection after the block has left the local window
  (it is full and older than the last `local_blocks + force_newest` blocks). Its r tokens
  with the largest q·k (summed over the KV head's query heads with `per_head=true`; over
  all query heads of the layer with `per_head=false`, one set of positions shared by every
  KV head) become the representatives, and their mean key is stored. InfLLM's own score
  averages q·k over the local window's queries; ours uses one of them (the newest).
  At prefill, the blocks older than the window are finalised with the query of the first
  replayed prompt-tail position (`catch_up`).
- blocks not finalised yet (inside the window, or a partially filled newest block) are
  scored with the mean of their live keys; they are normally forced anyway;
- `per_head=false` (default, as in InfLLM): one score per block for the whole layer,
  Σ over every query head of ⟨q_h, mean representative key of its KV head⟩, so every KV
  head selects the same blocks; `per_head=true`: scores per query head, reduced over each
  GQA group by `gqa_reduce` (with `sum`, Σ over the group's heads).

Metadata, maintained incrementally with static shapes (the same code runs eagerly and in the
captured CUDA-graph step): slot `infllm_repr` [B, Hkv, max_blocks, D] fp32 (mean
representative key, or mean live key until finalised) and `infllm_finalised` [B] int64 on
the device: blocks [0, n) of each row are final (they finalise in order, so a count
suffices). A selection finalises at most the one block that left the window with its
token; the prefill's backlog is finalised by `catch_up`, called by the runtime before the
first replayed prompt-tail selection with that selection's query. Finalising is idempotent
for a given length: a second selection at the same step (the oracle's look) changes nothing.
No Triton kernels: selection runs in torch ops under every backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from prr.blocks import block_counts
from prr.cache import PagedKVCache
from prr.selectors.base import Selector

REPR_SLOT = "infllm_repr"
FINALISED = "infllm_finalised"


class InfLLMSelector(Selector):
    def __init__(
        self,
        topk_blocks: int,
        sink_blocks: int = 1,
        local_blocks: int = 4,
        force_newest: bool = True,
        gqa_reduce: str = "sum",
        dense_layers: Sequence[int] = (),
        representatives: int = 4,
        per_head: bool = False,
    ) -> None:
        super().__init__(topk_blocks, sink_blocks, local_blocks, force_newest, gqa_reduce, dense_layers)
        if isinstance(representatives, bool) or not isinstance(representatives, int) or representatives < 1:
            raise ValueError(f"selector.representatives={representatives!r} must be a positive integer "
                             "(tokens per block, at most runtime.block_size)")
        if not isinstance(per_head, bool):
            raise ValueError(f"selector.per_head={per_head!r} is not one of [True, False]")
        self.representatives = representatives
        self.per_head = per_head

    # --- metadata --------------------------------------------------------------------------
    def _slot(self, cache: PagedKVCache, layer: int) -> Tensor:
        return cache.metadata_slot(layer, REPR_SLOT, (cache.head_dim,), torch.float32)  # [B, Hkv, NB, D]

    def _finalised(self, cache: PagedKVCache, layer: int) -> Tensor:
        """[B] int64 on the cache's device: blocks [0, n) of each row are final."""
        return cache.state_slot(layer, FINALISED, (cache.batch,), torch.int64)

    def _provisional(self, cache: PagedKVCache, layer: int, first: Tensor, count: int, end: Tensor) -> None:
        """Blocks first + [0, count) of each row (first: [B] int64) that are not final yet get
        the mean of their live keys (positions < end [B]). Static shapes."""
        s, b, h, d = cache.block_size, cache.batch, cache.num_kv_heads, cache.head_dim
        blocks = (first.view(b, 1) + torch.arange(count, device=cache.device)).clamp(max=cache.max_blocks - 1)  # [B, n]
        tokens = (blocks.unsqueeze(-1) * s + torch.arange(s, device=cache.device)).view(b, 1, count * s, 1)
        keys = torch.gather(cache.keys[layer], 2, tokens.expand(b, h, count * s, d)).float().view(b, h, count, s, d)
        live = (tokens.view(b, 1, count, s, 1) < end.view(b, 1, 1, 1, 1))
        mean = (keys * live).sum(3) / live.sum(3).clamp(min=1)  # [B, Hkv, n, D]
        repr_keys = self._slot(cache, layer)
        index = blocks.view(b, 1, count, 1).expand(b, h, count, d)
        final = (blocks < self._finalised(cache, layer).view(b, 1)).view(b, 1, count, 1)  # final blocks stay
        repr_keys.scatter_(2, index, torch.where(final, torch.gather(repr_keys, 2, index), mean))

    def update_metadata(self, cache: PagedKVCache, layer: int, start: int, end: int) -> None:
        if self.is_dense_layer(layer) or end <= start:
            return
        s = cache.block_size
        first, last = start // s, -(-end // s)
        rows = torch.full((cache.batch,), first, dtype=torch.int64, device=cache.device)
        self._provisional(cache, layer, rows, last - first, torch.full_like(rows, end))

    def append_metadata(self, cache: PagedKVCache, layer: int, positions: Tensor) -> None:
        if self.is_dense_layer(layer):
            return
        positions = positions.long()
        self._provisional(cache, layer, positions // cache.block_size, 1, positions + 1)

    def _finalise(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor, first: Tensor, count: int) -> None:
        """Blocks first + [0, count) (first: [B] int64) of each row that have left the local
        window by `lengths` [B] and are not final yet get their representatives from
        q [B, Hkv, G, D]. Static shapes: a selection looks at one block, the oldest not final
        (the window moves by at most one block per token); `catch_up` passes the prefill's
        backlog (all blocks from 0)."""
        s, b, h, d = cache.block_size, cache.batch, cache.num_kv_heads, cache.head_dim
        lengths = block_counts(lengths, b, cache.device)
        num_blocks = (lengths + s - 1) // s
        window = self.local_blocks + int(self.force_newest)
        target = torch.minimum(lengths // s, num_blocks - window)  # [B] full blocks older than the window
        done = self._finalised(cache, layer)
        blocks = first.view(b, 1) + torch.arange(count, device=cache.device)  # [B, n] candidates, distinct
        todo = (blocks >= done.view(b, 1)) & (blocks < target.view(b, 1))
        blocks = blocks.clamp(max=cache.max_blocks - 1)
        tokens = (blocks.unsqueeze(-1) * s + torch.arange(s, device=cache.device)).view(b, 1, count * s, 1)
        keys = torch.gather(cache.keys[layer], 2, tokens.expand(b, h, count * s, d)).float()  # [B, Hkv, n*S, D]
        token_scores = (q.float() @ keys.transpose(-1, -2)).sum(2)  # Σ over the group: [B, Hkv, n*S]
        if not self.per_head:
            token_scores = token_scores.sum(1, keepdim=True).expand(b, h, -1)  # one set per layer
        r = min(self.representatives, s)
        top = token_scores.reshape(b, h, count, s).topk(r, dim=-1).indices  # [B, Hkv, n, r]
        keys = keys.view(b, h, count, s, d)
        chosen = torch.gather(keys, 3, top.unsqueeze(-1).expand(b, h, count, r, d)).mean(3)  # [B, Hkv, n, D]
        repr_keys = self._slot(cache, layer)
        index = blocks.view(b, 1, count, 1).expand(b, h, count, d)
        write = todo.view(b, 1, count, 1)
        repr_keys.scatter_(2, index, torch.where(write, chosen, torch.gather(repr_keys, 2, index)))
        done.copy_(torch.maximum(done, torch.minimum(first + count, target)))

    def catch_up(self, q: Tensor, cache: PagedKVCache, layer: int, length: int) -> None:
        """Finalise every block older than the window at `length` with q (the prefill's backlog)."""
        if self.is_dense_layer(layer):
            return
        backlog = cache.num_blocks(layer, length)
        if backlog:
            rows = torch.full((cache.batch,), length, device=cache.device)
            self._finalise(q, cache, layer, rows, torch.zeros_like(rows), backlog)

    # --- scores ------------------------------------------------------------------------------
    def head_scores(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor) -> Tensor:
        # q: [B, Hkv, G, D] -> [B, Hkv, G, max_blocks]: ⟨q_h, mean representative key⟩
        self._finalise(q, cache, layer, lengths, self._finalised(cache, layer), 1)
        scores = q.float() @ self._slot(cache, layer).transpose(-1, -2)  # [B, Hkv, G, NB]
        if not self.per_head:
            scores = scores.sum((1, 2), keepdim=True).expand_as(scores)  # Σ over every head of the layer
        return scores
