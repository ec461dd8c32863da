"""`dense`: every block of the context. The accuracy reference; also the selector for
studying dense decoding through the same pipeline."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from prr.blocks import BlockSet
from prr.cache import PagedKVCache
from prr.selectors.base import Selection, Selector


class DenseSelector(Selector):
    def __init__(self, gqa_reduce: str = "max", dense_layers: Sequence[int] = ()) -> None:
        # topk is irrelevant: every block is selected.
        super().__init__(topk_blocks=1, sink_blocks=0, local_blocks=0, force_newest=False,
                         gqa_reduce=gqa_reduce, dense_layers=dense_layers)

    def capacity(self, group_size: int, max_blocks: int) -> int:
        return max_blocks

    def selected_blocks(self, num_blocks: int) -> int:
        return num_blocks

    def head_scores(self, q: Tensor, cache: PagedKVCache, layer: int, length: int) -> Tensor:
        b, h, g, _ = q.shape
        return torch.zeros(b, h, g, cache.max_blocks, device=q.device)

    def select(self, q: Tensor, cache: PagedKVCache, layer: int, length: int | None = None) -> Selection:
        length = cache.length(layer) if length is None else length
        num_blocks = cache.num_blocks(layer, length)
        inside = torch.arange(cache.max_blocks, device=q.device) < num_blocks
        mask = inside.expand(q.shape[0], q.shape[1], -1)
        scores = torch.zeros(mask.shape, device=q.device).masked_fill(~mask, float("-inf"))
        return Selection(blocks=BlockSet.from_mask(mask, cache.max_blocks), scores=scores)
