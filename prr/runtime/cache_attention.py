"""Attention of a decode query over listed blocks of one layer of a paged KV cache, on the
step's op backend: what speculation (per block), repair (split partials), serial DSA and dense
attention (the layer's output) and the dense-reference metrics all run."""

from __future__ import annotations

import copy
import math

import torch
from torch import Tensor

from prr.cache import PagedKVCache
from prr.runtime.static_plan import StaticPlan


class CacheAttention:
    """Attention over `cache` with the launch choices of `plan` (fuse_merge, speculation_tokens_per_program)."""

    def __init__(self, ops, cache: PagedKVCache, plan: StaticPlan) -> None:
        self.ops, self.cache, self.plan = ops, cache, plan
        self.scale = 1.0 / math.sqrt(cache.head_dim)
        b, h, nb = cache.batch, cache.num_kv_heads, cache.max_blocks
        self.all_blocks = torch.arange(nb, dtype=torch.int32, device=cache.keys[0].device).expand(b, h, nb).contiguous()
        # fuse_merge's and fused_repair's, main stream (their kernels run one after the other there)
        self.merge_arrivals = torch.zeros(b * h, dtype=torch.int32, device=cache.keys[0].device)

    def with_plan(self, plan: StaticPlan) -> CacheAttention:
        view = copy.copy(self)
        view.plan = plan
        return view

    def attend(self, layer: int, q: Tensor, idx: Tensor, cnt: Tensor, lengths: Tensor, per_block: bool = False,
               merge_splits: bool = True, final: bool = False):
        """Attention of q [B, Hq, D] over the blocks idx [B, Hkv, C] (counts cnt [B, Hkv]) of this
        layer's cache, lengths [B] tokens -> (out [B, Hq, D], lse [B, Hq]) fp32, or with per_block
        one state per block ([B, Hq, C, D], [B, Hq, C]), or with merge_splits=False the kernel's
        unmerged split partials (prr.kernels.sparse_decode).
        final: this is the layer's output (main stream): merged in the model dtype (no cast
        launch before the output projection), in the split kernel when plan.fuse_merge (its
        arrival workspace serves one stream). per_block (speculation): programs of
        plan.speculation_tokens_per_program tokens each."""
        fused = final and self.fuses_merge(idx)
        return self.ops.sparse_decode(q, self.cache.keys[layer], self.cache.values[layer], idx, cnt, lengths,
                                      self.plan.block_size, self.scale, per_block=per_block,
                                      merge_splits=merge_splits, fuse_merge=fused,
                                      out_dtype=self.cache.dtype if final else torch.float32,
                                      arrivals=self.merge_arrivals if fused else None,
                                      tokens_per_split=self.plan.speculation_tokens_per_program
                                      if per_block else None)

    def fuses_merge(self, idx: Tensor) -> bool:
        """Whether a layer's output attention over idx [B, Hkv, C] merges its splits in the
        split kernel (plan.fuse_merge)."""
        if self.plan.fuse_merge == "one_wave":
            c = self.cache
            return self.ops.sparse_decode_one_wave(idx.shape[-1], c.batch, c.num_kv_heads, self.plan.block_size,
                                                   c.keys[0].device, head_dim=c.head_dim, cache_dtype=c.dtype)
        return bool(self.plan.fuse_merge)

    def dense(self, layer: int, q: Tensor, lengths: Tensor, num_blocks: Tensor) -> Tensor:
        """Attention over every block of the context (num_blocks [B]) -> [B, Hq, D] in the model dtype."""
        b, h = self.all_blocks.shape[:2]
        counts = num_blocks.view(b, 1).expand(b, h).contiguous()
        return self.attend(layer, q, self.all_blocks, counts, lengths, final=True)[0]
