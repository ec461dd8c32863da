"""`dense`: every block of the context. The accuracy reference; also the selector for
studying dense decoding through the same pipeline."""

from __future__ import annotations

import torch
from torch import Tensor

from prr.blocks import BlockSet, inside_context
from prr.cache import PagedKVCache
from prr.selectors.base import Selection, Selector, token_counts
from prr.selectors.options import DenseSelectorOptions


class DenseSelector(DenseSelectorOptions, Selector):
    # the constructor is DenseSelectorOptions' (no torch: run.py checks it before importing torch)

    def capacity(self, group_size: int, max_blocks: int) -> int:
        return max_blocks

    def selected_blocks(self, num_blocks: int) -> int:
        return num_blocks

    def head_scores(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor) -> Tensor:
        b, h, g, _ = q.shape
        return torch.zeros(b, h, g, cache.max_blocks, device=q.device)

    def select(self, q: Tensor, cache: PagedKVCache, layer: int, length: int | Tensor | None = None,
               num_blocks: Tensor | None = None) -> Selection:
        b, h = q.shape[:2]
        if num_blocks is None or not isinstance(length, Tensor):  # the caller's counts, else from the lengths
            lengths = token_counts(cache, layer, length, b, q.device)
            num_blocks = (lengths + cache.block_size - 1) // cache.block_size  # [B]
        inside = inside_context(num_blocks, cache.max_blocks).expand(b, h, -1)  # [B, Hkv, NB]
        ids = torch.arange(cache.max_blocks, dtype=torch.int32, device=q.device).expand(b, h, -1)
        count = num_blocks.to(torch.int32).view(b, 1).expand(b, h).contiguous()
        scores = torch.zeros(inside.shape, device=q.device).masked_fill(~inside, float("-inf"))
        return Selection(blocks=BlockSet(torch.where(inside, ids, 0), count), scores=scores)
