"""Torch reference and seeded input generator for kernels/token_sparse_decode.py.

A token list is a block list at block size 1, so the reference is the block reference
(`sparse_decode_reference`, float64 by default) over the list, with a list shared by all KV heads
([B, 1, C]) expanded to every head first. Same conventions: lse = natural log of Σ exp(scale · q·k),
empty set -> lse = -inf, out = 0; ids < 0 or >= lengths[b] and entries >= the count are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .reference_sparse_decode import SparseDecodeInputs, random_decode_qkv, sparse_decode_reference


@dataclass
class TokenSparseDecodeInputs:
    q: Tensor  # [B, Hq, D]
    k_cache: Tensor  # [B, Hkv, T_max, D]
    v_cache: Tensor  # [B, Hkv, T_max, D]
    token_ids: Tensor  # [B, Hkv, C] or [B, 1, C] (shared); entries >= token_counts are padding
    token_counts: Tensor  # [B, Hkv] or [B, 1]
    lengths: Tensor  # [B] int32
    scale: float

    def args(self) -> tuple:
        """Positional arguments of token_sparse_decode / token_sparse_decode_reference."""
        return (self.q, self.k_cache, self.v_cache, self.token_ids, self.token_counts, self.lengths, self.scale)


def token_sparse_decode_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    token_ids: Tensor,
    token_counts: Tensor,
    lengths: Tensor,
    scale: float,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[Tensor, Tensor]:
    """Reference for kernels.token_sparse_decode.token_sparse_decode (same arguments and shapes)
    -> (out [B, Hq, D], lse [B, Hq]) in compute_dtype."""
    batch, num_kv_heads = k_cache.shape[:2]
    capacity = token_ids.shape[-1]
    ids = token_ids.expand(batch, num_kv_heads, capacity)  # [B, Hkv, C]; a shared list to every head
    counts = token_counts.expand(batch, num_kv_heads)
    return sparse_decode_reference(q, k_cache, v_cache, ids, counts, lengths, 1, scale, compute_dtype=compute_dtype)


def token_scores_reference(
    q: Tensor,
    k_cache: Tensor,
    token_ids: Tensor,
    token_counts: Tensor,
    lengths: Tensor,
    scale: float,
    compute_dtype: torch.dtype = torch.float64,
) -> Tensor:
    """Reference for kernels.token_sparse_decode.token_scores (same arguments and shape): the lse of
    each listed token's one-token state (the block reference per_block at block size 1)
    -> scores [B, Hq, C] in compute_dtype, -inf for entries past the count and dead ids."""
    batch, num_kv_heads = k_cache.shape[:2]
    capacity = token_ids.shape[-1]
    ids = token_ids.expand(batch, num_kv_heads, capacity)
    counts = token_counts.expand(batch, num_kv_heads)
    return sparse_decode_reference(q, k_cache, k_cache, ids, counts, lengths, 1, scale, per_block=True,
                                   compute_dtype=compute_dtype)[1]


def token_states_reference(v_cache: Tensor, token_ids: Tensor, num_q_heads: int) -> Tensor:
    """The value half of listed tokens' one-token states, as the repair reads them from the cache:
    v_cache [B, Hkv, T_max, D], token_ids [B, Hkv, C] -> [B, Hq, C, D] fp32 (query head h takes
    KV head h // (Hq / Hkv); entries past a count or dead hold some row: their scores are -inf)."""
    batch, num_kv_heads, t_max, head_dim = v_cache.shape
    ids = token_ids.long().clamp(0, max(t_max - 1, 0))  # padding may hold any id
    rows = torch.gather(v_cache.float(), 2, ids.unsqueeze(-1).expand(*ids.shape, head_dim))  # [B, Hkv, C, D]
    return rows.repeat_interleave(num_q_heads // num_kv_heads, dim=1)


def tokens_of_blocks(block_ids: Tensor, block_counts: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """A block list as the token list of its blocks, in list order: block_ids [B, Hkv, C],
    block_counts [B, Hkv] -> (token_ids [B, Hkv, C * block_size] of block_ids' dtype, token_counts
    [B, Hkv] = block_counts * block_size, clamped to the capacity as the kernels clamp counts)."""
    offsets = torch.arange(block_size, device=block_ids.device, dtype=block_ids.dtype)
    tokens = (block_ids.unsqueeze(-1) * block_size + offsets).flatten(-2)
    capacity = block_ids.shape[-1]
    return tokens, block_counts.long().clamp(0, capacity) * block_size


def token_inputs_of_blocks(inputs: SparseDecodeInputs) -> TokenSparseDecodeInputs:
    """The block kernel's inputs as token-kernel inputs naming the same tokens in the same order."""
    ids, counts = tokens_of_blocks(inputs.block_ids, inputs.block_counts, inputs.block_size)
    return TokenSparseDecodeInputs(inputs.q, inputs.k_cache, inputs.v_cache, ids, counts, inputs.lengths, inputs.scale)


def random_token_sparse_decode_inputs(
    seed: int,
    lengths: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    topk_tokens: int,
    capacity: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    ids_dtype: torch.dtype = torch.int32,
    shared: bool = False,
    empty_rows: tuple[tuple[int, int], ...] = (),
    beyond_length: int = 0,
    extra_tokens: int = 0,
    garbage: float = 50.0,
) -> TokenSparseDecodeInputs:
    """Fresh random inputs for one token-list decode step.

    lengths: tokens per batch row (ragged). Each list (per (b, h), or per b when `shared`: token_ids
    [B, 1, C]) holds min(topk_tokens, lengths[b], capacity) distinct random live tokens in random
    order, the newest always among them, then padding up to `capacity` (default topk_tokens) with
    valid-looking live token ids, so a kernel that reads padding gives a wrong answer. The last
    `beyond_length` listed entries (within the count) are distinct ids in [lengths[b], T_max), which
    the kernel must skip; the cache has extra_tokens + beyond_length slots past the longest row.
    Lists in `empty_rows` ((b, h) pairs; h = 0 when shared) are empty. Cache slots past a row's
    length hold `garbage`-scaled values, so reading them is caught too.
    """
    g = torch.Generator().manual_seed(seed)  # the lists (CPU)
    device = torch.device(device)
    g_data = torch.Generator(device=device).manual_seed(seed + 1)  # tensors, made where they live
    batch = len(lengths)
    capacity = topk_tokens if capacity is None else capacity
    max_tokens = max(1, max(lengths) + extra_tokens + beyond_length)
    q, k, v = random_decode_qkv(g_data, lengths, max_tokens, num_q_heads, num_kv_heads, head_dim, dtype, garbage)

    list_heads = 1 if shared else num_kv_heads
    ids = torch.zeros(batch, list_heads, capacity, dtype=torch.int64)
    counts = torch.zeros(batch, list_heads, dtype=torch.int64)
    for b, length in enumerate(lengths):
        for h in range(list_heads):
            count = 0 if (b, h) in empty_rows else min(topk_tokens, length + beyond_length, capacity)
            dead_ids = min(beyond_length, count, max_tokens - length)
            chosen = torch.randperm(length, generator=g)[: count - dead_ids]
            if len(chosen) and not bool((chosen == length - 1).any()):
                chosen[torch.randint(len(chosen), (1,), generator=g)] = length - 1
            past_end = length + torch.randperm(max_tokens - length, generator=g)[:dead_ids]
            pad = torch.randint(max(1, length), (capacity - count,), generator=g)
            ids[b, h] = torch.cat([chosen, past_end, pad])
            counts[b, h] = count
    return TokenSparseDecodeInputs(
        q=q,
        k_cache=k,
        v_cache=v,
        token_ids=ids.to(dtype=ids_dtype, device=device),
        token_counts=counts.to(device=device),
        lengths=torch.tensor(lengths, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
    )
