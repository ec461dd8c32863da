"""`exact`: the true top-K blocks by attention mass (from dense scores). The selector
oracle: no cheaper selector can carry more attention mass with the same K.

One definition, two op backends: torch ops (`head_scores`, the softmax of scale·q·k over the
whole context summed per block, + the base class's reduce / force / top-K) and the Triton
kernels (`prr.kernels.exact.exact_scores`: a q·K pass storing every block's lse and a pass
turning them into masses, GQA-reduced; then `topk_select`), tested equal. Ties: both take the
higher mass, then the lower block id. The two compute a block's mass in a different order (the
kernel as exp(lse_block − lse_row)), so masses within a few fp32 ulps of each other may rank
differently, and blocks whose mass underflows fp32 (below ~1e-38: the kernel's exp2 may flush
subnormals to 0 on a GPU) tie at 0 there, lowest id first.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from prr.block_attention import attend_dense
from prr.blocks import BlockSet
from prr.cache import PagedKVCache
from prr.selectors.base import Selection, Selector


class ExactSelector(Selector):
    bulk_metadata_equals_stepwise = True  # no metadata: every key scored at each step

    def head_scores(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor) -> Tensor:
        # q: [B, Hkv, G, D] -> attention mass per block [B, Hkv, G, max_blocks]
        _, block_mass = attend_dense(q, cache, layer, lengths, 1.0 / math.sqrt(q.shape[-1]))
        return block_mass

    def triton_problems(self) -> list[str]:
        if self.gqa_reduce == "union":
            return ["selector.gqa_reduce=union has no Triton exact kernel (it reduces inside the kernel); "
                    "use gqa_reduce=max or sum, or runtime.backend=torch"]
        return []

    def select_triton(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor,
                      num_blocks: Tensor) -> Selection:
        from prr.kernels.exact import exact_scores
        from prr.kernels.topk import topk_select

        b, h, g, d = q.shape
        rows = num_blocks.to(torch.int32)  # [B]
        scores = exact_scores(q.reshape(b, h * g, d), cache.keys[layer], lengths, rows, cache.block_size,
                              1.0 / math.sqrt(d), self.gqa_reduce)  # [B, Hkv, NB]
        indices, counts = topk_select(scores, self.topk_blocks, rows, sink_blocks=self.sink_blocks,
                                      recent_blocks=self.local_blocks + int(self.force_newest))
        return Selection(blocks=BlockSet(indices, counts), scores=scores)
