"""The attention operations a PRR step needs, behind one interface with two backends:
`torch` (the reference in prr.block_attention / prr.attention_state) and `triton`
(prr.kernels), chosen by the `backend` config group at startup; nothing falls back silently.

All take grouped queries q: [B, Hkv, G, D] and return fp32 AttentionStates.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from prr import attention_state, block_attention
from prr.attention_state import AttentionState
from prr.blocks import BlockSet
from prr.cache import PagedKVCache


class BlockAttentionOps(Protocol):
    name: str

    def partials(self, q: Tensor, cache: PagedKVCache, layer: int, blocks: BlockSet, length: int,
                 scale: float) -> AttentionState:
        """-> one state per listed block: out [B, Hkv, G, C, D], lse [B, Hkv, G, C]."""
        ...

    def attend(self, q: Tensor, cache: PagedKVCache, layer: int, blocks: BlockSet, length: int,
               scale: float) -> AttentionState:
        """-> attention over the union of the listed blocks: out [B, Hkv, G, D], lse [B, Hkv, G]."""
        ...

    def merge_many(self, out: Tensor, lse: Tensor, keep: Tensor | None) -> AttentionState:
        """out [..., N, D], lse [..., N], keep [..., N] bool -> ⊕ of the kept partials."""
        ...


class TorchOps:
    name = "torch"

    def partials(self, q, cache, layer, blocks, length, scale):
        return block_attention.block_partials(q, cache, layer, blocks, length, scale)

    def attend(self, q, cache, layer, blocks, length, scale):
        return block_attention.attend_blocks(q, cache, layer, blocks, length, scale)

    def merge_many(self, out, lse, keep):
        return attention_state.merge_many(out, lse, keep)

