"""Torch references and seeded input generators for kernels/sparse_decode.py.

References compute in float64 (or a chosen dtype) with the repo's conventions
(kernels/reference_merge.py, which prr.attention_state wraps): lse = natural log of Σ exp(scale · q·k), empty key set ->
lse = -inf, out = 0. They take the kernels' exact argument layout, including ragged
per-row lengths, so tests and benchmarks compare like with like. `sparse_decode_reference` at
compute_dtype=float32 is also the graph engine's torch backend (prr.runtime.engine_ops.TorchOps):
static shapes, no host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .reference_merge import lse_merge_many


@dataclass
class SparseDecodeInputs:
    q: Tensor  # [B, Hq, D]
    k_cache: Tensor  # [B, Hkv, T_max, D]
    v_cache: Tensor  # [B, Hkv, T_max, D]
    block_ids: Tensor  # [B, Hkv, C] int32/int64; entries >= block_counts are padding (valid-looking block ids)
    block_counts: Tensor  # [B, Hkv] int
    lengths: Tensor  # [B] int32
    block_size: int
    scale: float

    def args(self) -> tuple:
        """Positional arguments of sparse_decode / sparse_decode_reference (without per_block)."""
        return (self.q, self.k_cache, self.v_cache, self.block_ids, self.block_counts, self.lengths,
                self.block_size, self.scale)  # fmt: skip


def random_decode_qkv(
    g_data: torch.Generator, lengths: list[int], max_tokens: int, num_q_heads: int, num_kv_heads: int,
    head_dim: int, dtype: torch.dtype, garbage: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The random tensors of one decode step, drawn from g_data on its device in the order k, v, q
    (the input generators of the block and token kernels share it): q [B, Hq, D], k_cache and
    v_cache [B, Hkv, max_tokens, D] in dtype, B = len(lengths); K has std 1.5, V and q std 1; cache
    slots at or past a row's length are scaled by `garbage`, so a kernel that reads them is caught."""
    device = g_data.device
    batch = len(lengths)
    shape = (batch, num_kv_heads, max_tokens, head_dim)
    positions = torch.arange(max_tokens, device=device)
    dead = positions.view(1, 1, -1, 1) >= torch.tensor(lengths, device=device).view(-1, 1, 1, 1)
    cache_scale = torch.where(dead, garbage, 1.0)  # [B, 1, T_max, 1]
    k = (torch.randn(shape, generator=g_data, device=device) * 1.5 * cache_scale).to(dtype)
    v = (torch.randn(shape, generator=g_data, device=device) * cache_scale).to(dtype)
    q = torch.randn(batch, num_q_heads, head_dim, generator=g_data, device=device).to(dtype)
    return q, k, v


def random_sparse_decode_inputs(
    seed: int,
    lengths: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    topk_blocks: int,
    capacity: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    ids_dtype: torch.dtype = torch.int32,
    empty_rows: tuple[tuple[int, int], ...] = (),
    include_newest: bool = True,
    extra_tokens: int = 0,
    garbage: float = 50.0,
) -> SparseDecodeInputs:
    """Fresh random inputs for one sparse decode step.

    lengths: tokens per batch row (ragged). Each (b, h) lists min(topk_blocks, blocks of
    row b) distinct blocks in random order (the newest, possibly partial block always
    among them when include_newest), padded to `capacity` (default topk_blocks) with
    valid-looking block ids, so a kernel that reads padding gives a wrong answer.
    Rows in `empty_rows` ((b, h) pairs) list nothing. Cache slots past a row's length hold
    `garbage`-scaled values, so a kernel that reads them is caught too.
    """
    g = torch.Generator().manual_seed(seed)  # block lists (CPU)
    device = torch.device(device)
    g_data = torch.Generator(device=device).manual_seed(seed + 1)  # tensors, made where they live
    batch = len(lengths)
    capacity = topk_blocks if capacity is None else capacity
    max_blocks = -(-(max(lengths) + extra_tokens) // block_size)
    max_tokens = max(1, max_blocks) * block_size
    q, k, v = random_decode_qkv(g_data, lengths, max_tokens, num_q_heads, num_kv_heads, head_dim, dtype, garbage)

    ids = torch.zeros(batch, num_kv_heads, capacity, dtype=torch.int64)
    counts = torch.zeros(batch, num_kv_heads, dtype=torch.int64)
    for b, length in enumerate(lengths):
        row_blocks = -(-length // block_size)
        for h in range(num_kv_heads):
            order = torch.randperm(row_blocks, generator=g) if row_blocks else torch.zeros(0, dtype=torch.int64)
            count = 0 if (b, h) in empty_rows else min(topk_blocks, row_blocks, capacity)
            chosen = order[:count]
            if include_newest and count and not bool((chosen == row_blocks - 1).any()):
                chosen[torch.randint(count, (1,), generator=g)] = row_blocks - 1
            pad = torch.randint(max(1, row_blocks), (capacity - count,), generator=g)
            ids[b, h] = torch.cat([chosen, pad])
            counts[b, h] = count
    return SparseDecodeInputs(
        q=q,
        k_cache=k,
        v_cache=v,
        block_ids=ids.to(dtype=ids_dtype, device=device),
        block_counts=counts.to(device=device),
        lengths=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_size=block_size,
        scale=head_dim**-0.5,
    )


def sparse_decode_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_ids: Tensor,
    block_counts: Tensor,
    lengths: Tensor,
    block_size: int,
    scale: float,
    per_block: bool = False,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[Tensor, Tensor]:
    """Reference for kernels.sparse_decode.sparse_decode (same arguments and shapes).

    -> per_block=False: (out [B, Hq, D], lse [B, Hq]); True: (out [B, Hq, C, D], lse [B, Hq, C]),
    in compute_dtype.
    """
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, max_tokens, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    capacity = block_ids.shape[-1]
    device = q.device
    valid = torch.arange(capacity, device=device) < block_counts.to(device).unsqueeze(-1)  # [B, Hkv, C]
    ids = torch.where(valid, block_ids.long(), torch.zeros_like(block_ids, dtype=torch.long))
    tokens = ids.unsqueeze(-1) * block_size + torch.arange(block_size, device=device)  # [B, Hkv, C, S]
    live = valid.unsqueeze(-1) & (tokens >= 0) & (tokens < lengths.long().view(-1, 1, 1, 1)) & (tokens < max_tokens)
    index = tokens.clamp(0, max_tokens - 1).reshape(batch, num_kv_heads, capacity * block_size, 1)
    index = index.expand(-1, -1, -1, head_dim)
    shape = (batch, num_kv_heads, capacity, block_size, head_dim)
    k = torch.gather(k_cache, 2, index).view(shape).to(compute_dtype)
    v = torch.gather(v_cache, 2, index).view(shape).to(compute_dtype)
    qg = q.to(compute_dtype).view(batch, num_kv_heads, 1, group, head_dim)
    scores = (qg @ k.transpose(-1, -2)) * scale  # [B, Hkv, C, G, S]
    scores = scores.masked_fill(~live.unsqueeze(3), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, C, G]
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = torch.exp(scores - safe.unsqueeze(-1)) @ v  # [B, Hkv, C, G, D]
    out = out.permute(0, 1, 3, 2, 4)  # [B, Hkv, G, C, D]
    lse = lse.permute(0, 1, 3, 2)  # [B, Hkv, G, C]
    if per_block:
        return out.reshape(batch, num_q_heads, capacity, head_dim), lse.reshape(batch, num_q_heads, capacity)
    merged_out, merged_lse = lse_merge_many(out, lse)
    return merged_out.reshape(batch, num_q_heads, head_dim), merged_lse.reshape(batch, num_q_heads)


def merge_partials_reference(
    out: Tensor, lse: Tensor, keep: Tensor | None = None, compute_dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor]:
    """Reference for kernels.sparse_decode.merge_partials: out [..., N, D], lse [..., N] -> ([..., D], [...])."""
    return lse_merge_many(out.to(compute_dtype), lse.to(compute_dtype), keep)


def random_partials(
    seed: int, lead: tuple[int, ...], num_partials: int, head_dim: int, empty_fraction: float = 0.25,
    device: torch.device | str = "cpu",
) -> tuple[Tensor, Tensor, Tensor]:
    """Random partial states and a keep-mask: out [*lead, N, D] fp32, lse [*lead, N] fp32
    (a fraction are empty: lse = -inf, out = 0), keep [*lead, N] bool."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(*lead, num_partials, head_dim, generator=g)
    lse = torch.randn(*lead, num_partials, generator=g) * 4 + 3
    empty = torch.rand(*lead, num_partials, generator=g) < empty_fraction
    lse = lse.masked_fill(empty, float("-inf"))
    out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    keep = torch.rand(*lead, num_partials, generator=g) < 0.6
    return out.to(device), lse.to(device), keep.to(device)


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64 over finite entries; inf if any NaN, or if
    the two disagree on which entries are ±inf (or on their sign)."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        raise ValueError(f"shape mismatch: {list(a.shape)} vs {list(e.shape)}")
    if torch.isnan(a).any() or torch.isnan(e).any():
        return float("inf")
    a_inf, e_inf = torch.isinf(a), torch.isinf(e)
    if not torch.equal(a_inf, e_inf) or not torch.equal(a[a_inf], e[e_inf]):
        return float("inf")
    finite = ~e_inf
    diff = torch.linalg.vector_norm(a[finite] - e[finite]).item()
    norm = torch.linalg.vector_norm(e[finite]).item()
    if norm == 0.0:
        return diff
    return diff / norm
