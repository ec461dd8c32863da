"""`quest` (arXiv 2406.10774): per block, the elementwise max M and min m of its keys;
score U_b(q) = Σ_i max(q_i M_{b,i}, q_i m_{b,i}), an upper bound of q·k for every key of b.
The metadata is refreshed incrementally: only the block that received the token.

As the paper, per head: the bound, its incremental upkeep, top-K pages. Departures (docs/design.md's
paper-vs-prr table): pages are `runtime.block_size` tokens (the paper's default 16 too); a GQA
group's query heads share their KV head's selection, their bounds reduced by `gqa_reduce`
(max | sum, or the union of per-head top-K; Quest's kernels assume one query head per KV head);
the sink blocks and the newest block are forced (`sink_blocks`, `force_newest`; the paper's rule as
written is top-K over every page); dense layers are configured (`dense_layers`, [0, 1] by
default, as the paper's).

One definition, two op backends: torch ops (`head_scores` + the base class's reduce / force /
top-K) and the Triton kernels (`quest_score` + `topk_select`, `quest_update`), tested equal.
M and m are stored in the cache's dtype: a max or min of keys is exact in it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from prr.blocks import BlockSet
from prr.cache import PagedKVCache
from prr.selectors.base import Selection, Selector

KEY_MAX, KEY_MIN = "quest_key_max", "quest_key_min"


class QuestSelector(Selector):
    metadata_in_append_kernel = True
    bulk_metadata_equals_stepwise = True  # a block's key max / min: the same however it grew
    def metadata(self, cache: PagedKVCache, layer: int) -> tuple[Tensor, Tensor]:
        """(key_max, key_min) [B, Hkv, max_blocks, D] in the cache dtype; ±inf in blocks never
        written. Public: fused kernels that append a token (prr.kernels.qkv_append) update them."""
        d = (cache.head_dim,)
        key_max = cache.metadata_slot(layer, KEY_MAX, d, cache.dtype, float("-inf"))
        key_min = cache.metadata_slot(layer, KEY_MIN, d, cache.dtype, float("inf"))
        return key_max, key_min

    def triton_problems(self) -> list[str]:
        if self.gqa_reduce == "union":
            return ["selector.gqa_reduce=union has no Triton Quest kernel (it reduces inside the kernel); "
                    "use gqa_reduce=max or sum, or runtime.backend=torch"]
        return []

    def update_metadata(self, cache: PagedKVCache, layer: int, start: int, end: int) -> None:
        key_max, key_min = self.metadata(cache, layer)
        s = cache.block_size
        first, last = start // s, -(-end // s)  # blocks touched by [start, end)
        keys = cache.keys[layer][:, :, first * s : last * s]  # [B, Hkv, n*S, D]
        b, h, _, d = keys.shape
        keys = keys.view(b, h, last - first, s, d)
        live = (torch.arange(first * s, last * s, device=keys.device) < end).view(1, 1, last - first, s, 1)
        # Recompute touched blocks from all their live tokens.
        key_max[:, :, first:last] = keys.masked_fill(~live, float("-inf")).amax(3)
        key_min[:, :, first:last] = keys.masked_fill(~live, float("inf")).amin(3)

    def append_metadata(self, cache: PagedKVCache, layer: int, positions: Tensor) -> None:
        key_max, key_min = self.metadata(cache, layer)
        b, h, d = cache.batch, cache.num_kv_heads, cache.head_dim
        pos = positions.view(b, 1, 1, 1).long().expand(b, h, 1, d)
        k_new = torch.gather(cache.keys[layer], 2, pos).squeeze(2)  # [B, Hkv, D] as the cache stores it
        if self.backend == "triton":  # the running max / min kernel
            from prr.kernels.quest import quest_update

            quest_update(key_max, key_min, k_new, positions.to(torch.int32), cache.block_size)
            return
        block = (pos // cache.block_size)  # [B, Hkv, 1, D]
        first = (positions.view(b, 1, 1, 1).long() % cache.block_size) == 0  # a new block starts from the token
        old_max, old_min = torch.gather(key_max, 2, block), torch.gather(key_min, 2, block)
        k_new = k_new.unsqueeze(2)
        key_max.scatter_(2, block, torch.where(first, k_new, torch.maximum(old_max, k_new)))
        key_min.scatter_(2, block, torch.where(first, k_new, torch.minimum(old_min, k_new)))

    def select_triton(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor,
                      num_blocks: Tensor) -> Selection:
        from prr.kernels.quest import quest_score
        from prr.kernels.topk import topk_select

        b, h, g, d = q.shape
        key_max, key_min = self.metadata(cache, layer)
        rows = num_blocks.to(torch.int32)
        scores = quest_score(q.reshape(b, h * g, d), key_max, key_min, rows, gqa_reduce=self.gqa_reduce)  # [B, Hkv, NB]
        indices, counts = topk_select(scores, self.topk_blocks, rows, sink_blocks=self.sink_blocks,
                                      recent_blocks=self.local_blocks + int(self.force_newest))
        return Selection(blocks=BlockSet(indices, counts), scores=scores)

    def head_scores(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor) -> Tensor:
        # q: [B, Hkv, G, D] -> upper bounds [B, Hkv, G, max_blocks] (unscaled q·k units)
        key_max, key_min = self.metadata(cache, layer)
        q = q.float().unsqueeze(3)  # [B, Hkv, G, 1, D]
        upper = torch.maximum(q * key_max.float().unsqueeze(2), q * key_min.float().unsqueeze(2)).sum(-1)
        # Blocks never written hold ±inf metadata; the base class masks them out by length.
        return torch.nan_to_num(upper, nan=float("-inf"))
