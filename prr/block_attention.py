"""Torch reference attention over KV blocks: dense, over a block set, and per block.

All functions take grouped queries q: [B, Hkv, G, D] (G = query heads per KV head, GQA)
and return fp32 AttentionStates over [B, Hkv, G]. They are the references the Triton
kernels are tested against, and the `torch` backend of the runtime.
"""

from __future__ import annotations

import torch
from torch import Tensor

from prr.attention_state import AttentionState, merge_many
from prr.blocks import BlockSet, block_counts
from prr.cache import PagedKVCache


def token_limits(length: int | Tensor, batch: int, device: torch.device) -> Tensor:
    """Tokens of each row's context, [B, 1, 1, 1] int64 (a host int or a [B] tensor)."""
    return block_counts(length, batch, device).view(batch, 1, 1, 1)


def block_partials(
    q: Tensor, cache: PagedKVCache, layer: int, blocks: BlockSet, length: int | Tensor, scale: float
) -> AttentionState:
    """One partial state per listed block. Static shapes (length: host int or [B] tensor).

    q: [B, Hkv, G, D] -> out [B, Hkv, G, C, D], lse [B, Hkv, G, C] (C = blocks.capacity).
    Padding entries and tokens at positions >= length get lse = -inf, out = 0.
    """
    return partials_over(q, *cache.block_view(layer), blocks, length, scale)


def partials_over(q: Tensor, keys: Tensor, values: Tensor, blocks: BlockSet, length: int | Tensor,
                  scale: float) -> AttentionState:
    """block_partials over one layer's blocked K/V, keys, values: [B, Hkv, NB, S, D] (what the
    graph engine's torch backend holds instead of a cache and a layer)."""
    b, h, _, s, d = keys.shape
    c = blocks.capacity
    index = blocks.indices.long().view(b, h, c, 1, 1).expand(b, h, c, s, d)
    k = torch.gather(keys, 2, index).float()  # [B, Hkv, C, S, D]
    v = torch.gather(values, 2, index).float()
    # matmul, not einsum: einsum picks a path ~100x slower on CPU for these shapes.
    scores = (q.float().unsqueeze(2) @ k.transpose(-1, -2)) * scale  # [B, Hkv, C, G, S]
    positions = blocks.indices.long().unsqueeze(-1) * s + torch.arange(s, device=q.device)  # [B, Hkv, C, S]
    live = (positions < token_limits(length, b, q.device)) & blocks.valid().unsqueeze(-1)
    scores = scores.masked_fill(~live.unsqueeze(3), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, C, G]
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe.unsqueeze(-1))  # 0 where masked
    out = probs @ v  # [B, Hkv, C, G, D]
    return AttentionState(out=out.transpose(2, 3), lse=lse.transpose(2, 3))


def attend_blocks(
    q: Tensor, cache: PagedKVCache, layer: int, blocks: BlockSet, length: int | Tensor, scale: float
) -> AttentionState:
    """Attention over the union of the listed blocks. q: [B, Hkv, G, D] -> [B, Hkv, G, (D)]."""
    partials = block_partials(q, cache, layer, blocks, length, scale)
    return merge_many(partials.out, partials.lse)


def attend_dense(q: Tensor, cache: PagedKVCache, layer: int, length: int | Tensor,
                 scale: float) -> tuple[AttentionState, Tensor]:
    """Dense attention over the first `length` tokens of each row (host int or [B] tensor),
    and each block's share of it. Static shapes: scores over the whole cache, masked.

    q: [B, Hkv, G, D] -> state over [B, Hkv, G], block_mass [B, Hkv, G, max_blocks]
    (softmax probability summed per block; rows sum to 1).
    """
    k = cache.keys[layer].float()  # [B, Hkv, T_max, D]
    v = cache.values[layer].float()
    scores = (q.float() @ k.transpose(-1, -2)) * scale  # [B, Hkv, G, T_max]
    live = torch.arange(cache.max_tokens, device=q.device) < token_limits(length, q.shape[0], q.device)
    scores = scores.masked_fill(~live, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))  # [B, Hkv, G, T_max]; 0 past each row's length
    out = probs @ v  # [B, Hkv, G, D]
    block_mass = probs.view(*probs.shape[:-1], cache.max_blocks, cache.block_size).sum(-1)
    return AttentionState(out=out, lse=lse), block_mass


def relative_error(x: Tensor, ref: Tensor) -> Tensor:
    """x, ref: [B, Hkv, G, D] -> [B, Hkv]: ‖x − ref‖ / ‖ref‖ over each KV head's group."""
    num = (x.float() - ref.float()).flatten(2).norm(dim=-1)
    return num / ref.float().flatten(2).norm(dim=-1).clamp(min=1e-30)
