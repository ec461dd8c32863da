"""`exact`: the true top-K blocks by attention mass (from dense scores). The selector
oracle: no cheaper selector can carry more attention mass with the same K."""

from __future__ import annotations

import math

from torch import Tensor

from prr.block_attention import attend_dense
from prr.cache import PagedKVCache
from prr.selectors.base import Selector


class ExactSelector(Selector):
    def head_scores(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor) -> Tensor:
        # q: [B, Hkv, G, D] -> attention mass per block [B, Hkv, G, max_blocks]
        _, block_mass = attend_dense(q, cache, layer, lengths, 1.0 / math.sqrt(q.shape[-1]))
        return block_mass
