"""`quest` (arXiv 2406.10774): per block, the elementwise max M and min m of its keys;
score U_b(q) = Σ_i max(q_i M_{b,i}, q_i m_{b,i}), an upper bound of q·k for every key of b.
The metadata is refreshed incrementally: only the blocks that received tokens."""

from __future__ import annotations

import torch
from torch import Tensor

from prr.blocks import BlockSet
from prr.cache import PagedKVCache
from prr.selectors.base import Selection, Selector


class QuestSelector(Selector):
    def _slots(self, cache: PagedKVCache, layer: int) -> tuple[Tensor, Tensor]:
        d = (cache.head_dim,)
        key_max = cache.metadata_slot(layer, "quest_key_max", d, torch.float32, float("-inf"))
        key_min = cache.metadata_slot(layer, "quest_key_min", d, torch.float32, float("inf"))
        return key_max, key_min  # [B, Hkv, max_blocks, D] each

    def triton_problems(self) -> list[str]:
        if self.gqa_reduce == "union":
            return ["selector.gqa_reduce=union has no Triton Quest kernel (it reduces inside the kernel); "
                    "use gqa_reduce=max or sum, or runtime.backend=torch"]
        return []

    def update_metadata(self, cache: PagedKVCache, layer: int, start: int, end: int) -> None:
        key_max, key_min = self._slots(cache, layer)
        if self.backend == "triton" and end - start == 1:  # a decode append: the running max/min kernel
            from prr.kernels.quest import quest_update

            positions = torch.full((cache.batch,), start, dtype=torch.int32, device=cache.device)
            quest_update(key_max, key_min, cache.keys[layer][:, :, start], positions, cache.block_size)
            return
        s = cache.block_size
        first, last = start // s, -(-end // s)  # blocks touched by [start, end)
        keys = cache.keys[layer][:, :, first * s : last * s].float()  # [B, Hkv, n*S, D]
        b, h, _, d = keys.shape
        keys = keys.view(b, h, last - first, s, d)
        live = (torch.arange(first * s, last * s, device=keys.device) < end).view(1, 1, last - first, s, 1)
        # Recompute touched blocks from all their live tokens: exact and cheap (one block per decode step).
        key_max[:, :, first:last] = keys.masked_fill(~live, float("-inf")).amax(3)
        key_min[:, :, first:last] = keys.masked_fill(~live, float("inf")).amin(3)

    def select(self, q: Tensor, cache: PagedKVCache, layer: int, length: int | None = None) -> Selection:
        if self.backend != "triton":
            return super().select(q, cache, layer, length)
        from prr.kernels.quest import quest_score
        from prr.kernels.topk import topk_select

        length = cache.length(layer) if length is None else length
        num_blocks = cache.num_blocks(layer, length)
        b, h, g, d = q.shape
        key_max, key_min = self._slots(cache, layer)
        rows = torch.full((b,), num_blocks, dtype=torch.int32, device=q.device)
        scores = quest_score(q.reshape(b, h * g, d), key_max, key_min, rows, gqa_reduce=self.gqa_reduce)  # [B, Hkv, NB]
        indices, counts = topk_select(scores, self.topk_blocks, rows, sink_blocks=self.sink_blocks,
                                      recent_blocks=self.local_blocks + int(self.force_newest))
        return Selection(blocks=BlockSet(indices.long(), counts.long()), scores=scores)

    def head_scores(self, q: Tensor, cache: PagedKVCache, layer: int, length: int) -> Tensor:
        # q: [B, Hkv, G, D] -> upper bounds [B, Hkv, G, max_blocks] (unscaled q·k units)
        key_max, key_min = self._slots(cache, layer)
        q = q.float().unsqueeze(3)  # [B, Hkv, G, 1, D]
        upper = torch.maximum(q * key_max.unsqueeze(2), q * key_min.unsqueeze(2)).sum(-1)
        # Blocks never written hold ±inf metadata; the base class masks them out by length.
        return torch.nan_to_num(upper, nan=float("-inf"))
