"""Torch reference attention over KV blocks: dense, over a block set, and per block.

All functions take grouped queries q: [B, Hkv, G, D] (G = query heads per KV head, GQA)
and return fp32 AttentionStates over [B, Hkv, G]. They are the references the Triton
kernels are tested against, and the `torch` backend of the runtime.
"""

from __future__ import annotations

import torch
from torch import Tensor

from prr.attention_state import AttentionState, merge_many
from prr.blocks import BlockSet
from prr.cache import PagedKVCache


def block_partials(
    q: Tensor, cache: PagedKVCache, layer: int, blocks: BlockSet, length: int, scale: float
) -> AttentionState:
    """One partial state per listed block.

    q: [B, Hkv, G, D] -> out [B, Hkv, G, C, D], lse [B, Hkv, G, C] (C = blocks.capacity).
    Padding entries and tokens at positions >= length get lse = -inf, out = 0.
    """
    keys, values = cache.block_view(layer)  # [B, Hkv, NB, S, D]
    b, h, _, s, d = keys.shape
    c = blocks.capacity
    index = blocks.indices.view(b, h, c, 1, 1).expand(b, h, c, s, d)
    k = torch.gather(keys, 2, index).float()  # [B, Hkv, C, S, D]
    v = torch.gather(values, 2, index).float()
    # matmul, not einsum: einsum picks a path ~100x slower on CPU for these shapes.
    scores = (q.float().unsqueeze(2) @ k.transpose(-1, -2)) * scale  # [B, Hkv, C, G, S]
    positions = blocks.indices.unsqueeze(-1) * s + torch.arange(s, device=q.device)  # [B, Hkv, C, S]
    live = (positions < length) & blocks.valid().unsqueeze(-1)
    scores = scores.masked_fill(~live.unsqueeze(3), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, C, G]
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe.unsqueeze(-1))  # 0 where masked
    out = probs @ v  # [B, Hkv, C, G, D]
    return AttentionState(out=out.transpose(2, 3), lse=lse.transpose(2, 3))


def attend_blocks(
    q: Tensor, cache: PagedKVCache, layer: int, blocks: BlockSet, length: int, scale: float
) -> AttentionState:
    """Attention over the union of the listed blocks. q: [B, Hkv, G, D] -> [B, Hkv, G, (D)]."""
    partials = block_partials(q, cache, layer, blocks, length, scale)
    return merge_many(partials.out, partials.lse)


def attend_dense(q: Tensor, cache: PagedKVCache, layer: int, length: int, scale: float) -> tuple[AttentionState, Tensor]:
    """Dense attention over the first `length` tokens, and each block's share of it.

    q: [B, Hkv, G, D] -> state over [B, Hkv, G], block_mass [B, Hkv, G, max_blocks]
    (softmax probability summed per block; rows sum to 1).
    """
    k = cache.keys[layer][:, :, :length].float()  # [B, Hkv, T, D]
    v = cache.values[layer][:, :, :length].float()
    scores = (q.float() @ k.transpose(-1, -2)) * scale  # [B, Hkv, G, T]
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))  # [B, Hkv, G, T]
    out = probs @ v  # [B, Hkv, G, D]
    padded = torch.zeros(*probs.shape[:-1], cache.max_tokens, dtype=probs.dtype, device=probs.device)
    padded[..., :length] = probs
    block_mass = padded.view(*probs.shape[:-1], cache.max_blocks, cache.block_size).sum(-1)
    return AttentionState(out=out, lse=lse), block_mass
