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
  At prefill, the blocks older than the window are finalised by the first selection (the
  first replayed prompt-tail position), i.e. with that query.
- blocks not finalised yet (inside the window, or a partially filled newest block) are
  scored with the mean of their live keys; they are normally forced anyway;
- `per_head=false` (default, as in InfLLM): one score per block for the whole layer,
  Σ over every query head of ⟨q_h, mean representative key of its KV head⟩, so every KV
  head selects the same blocks; `per_head=true`: scores per query head, reduced over each
  GQA group by `gqa_reduce` (with `sum`, Σ over the group's heads).

Metadata, maintained incrementally: slot `infllm_repr` [B, Hkv, max_blocks, D] fp32 (mean
representative key, or mean live key until finalised) and `infllm_finalised`, a CPU int64
scalar in the layer's metadata dict: blocks [0, n) are final (they finalise in order, so a
count suffices; reading it never syncs with a GPU). Finalising is idempotent for a given
length: a second selection at the same step (the oracle's untimed look) changes nothing.
No Triton kernels: selection runs in torch under every backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

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
        slots = cache.metadata[layer]
        if FINALISED not in slots:
            slots[FINALISED] = torch.zeros((), dtype=torch.int64)  # on the CPU on purpose
        return slots[FINALISED]

    def update_metadata(self, cache: PagedKVCache, layer: int, start: int, end: int) -> None:
        if self.is_dense_layer(layer):
            return
        repr_keys = self._slot(cache, layer)
        s = cache.block_size
        first = max(start // s, int(self._finalised(cache, layer)))  # final blocks are never rewritten
        last = -(-end // s)
        if first >= last:
            return
        keys = cache.keys[layer][:, :, first * s : last * s].float()  # [B, Hkv, n*S, D]
        b, h, _, d = keys.shape
        keys = keys.view(b, h, last - first, s, d)
        live = (torch.arange(first * s, last * s, device=keys.device) < end).view(1, 1, last - first, s, 1)
        # Provisional summary of unfinalised blocks: the mean of their live keys.
        repr_keys[:, :, first:last] = (keys * live).sum(3) / live.sum(3).clamp(min=1)

    def _finalise(self, q: Tensor, cache: PagedKVCache, layer: int, length: int) -> None:
        """Blocks that have left the local window by `length` get their representatives from q."""
        s = cache.block_size
        num_blocks = cache.num_blocks(layer, length)
        window = self.local_blocks + int(self.force_newest)
        target = min(length // s, num_blocks - window)  # full blocks older than the window
        counter = self._finalised(cache, layer)
        first = int(counter)
        if target <= first:
            return
        keys = cache.keys[layer][:, :, first * s : target * s].float()  # [B, Hkv, n*S, D]
        b, h, _, d = keys.shape
        token_scores = (q.float() @ keys.transpose(-1, -2)).sum(2)  # Σ over the group: [B, Hkv, n*S]
        if not self.per_head:
            token_scores = token_scores.sum(1, keepdim=True).expand(b, h, -1)  # one set per layer
        r = min(self.representatives, s)
        top = token_scores.reshape(b, h, target - first, s).topk(r, dim=-1).indices  # [B, Hkv, n, r]
        keys = keys.view(b, h, target - first, s, d)
        chosen = torch.gather(keys, 3, top.unsqueeze(-1).expand(b, h, target - first, r, d))
        self._slot(cache, layer)[:, :, first:target] = chosen.mean(3)
        counter.fill_(target)

    # --- scores ------------------------------------------------------------------------------
    def head_scores(self, q: Tensor, cache: PagedKVCache, layer: int, length: int) -> Tensor:
        # q: [B, Hkv, G, D] -> [B, Hkv, G, max_blocks]: ⟨q_h, mean representative key⟩
        self._finalise(q, cache, layer, length)
        scores = q.float() @ self._slot(cache, layer).transpose(-1, -2)  # [B, Hkv, G, NB]
        if not self.per_head:
            scores = scores.sum((1, 2), keepdim=True).expand_as(scores)  # Σ over every head of the layer
        return scores
