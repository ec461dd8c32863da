"""Launcher for the batch-1 q|k|v projection with RoPE and the KV-cache append in one launch
(checks, grid, tile sizes); the kernel is in `prr.kernels.qkv_append_jit`. It equals

    qkv = dense_gemv(x, weight, bias, norm_weight=norm_weight, eps=eps)   # [1, (Hq + 2 Hkv) D]
    q, k, v = qkv.view(1, Hq + 2 Hkv, D).split([Hq, Hkv, Hkv], 1)
    q_rot = cache_append.append_token(k_cache, v_cache, k, v, positions, key_max, key_min,
                                      block_size, rope=(cos, sin, q))

with `weight_perm = weight[rope_pair_permutation(Hq, Hkv, D)]` (and the bias likewise): a
one-off row permutation that puts the two dims RoPE rotates together (d, d + D/2) on adjacent
rows, so each program's tile holds whole pairs (see the kernel's docstring).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from .cache_append import check_append_metadata
from .pdl import launch_kwargs
from .qkv_append_jit import _qkv_rope_append_kernel

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# (BLOCK_N, BLOCK_K, num_warps) per (out_features, in_features, head_dim): the q|k|v GEMV's tuned
# tile of the Llama-3.1-8B shape (dense_gemv.TUNED_TILES; 16 rows divide D = 128).
TUNED_TILES = {(6144, 4096, 128): (16, 512, 4)}
MAX_BLOCK_N = 16  # other shapes: the largest power of two <= this dividing D


def rope_pair_permutation(num_q_heads: int, num_kv_heads: int, head_dim: int) -> Tensor:
    """-> perm [(Hq + 2 Hkv) D] int64 row indices of the fused [q | k | v] weight: within each q
    and k head the rows become [0, D/2, 1, D/2 + 1, ..., D/2 - 1, D - 1] (row 2j is dim j, row
    2j + 1 dim j + D/2: RoPE's pair); v rows stay in order. Apply as weight[perm], bias[perm]."""
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"RoPE pairs dims d and d + D/2: head_dim must be even and >= 2; got D={head_dim}")
    if num_q_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"need >= 1 query and KV head; got num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads}")
    half = head_dim // 2
    pairs = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(head_dim)  # [D]
    rotated = num_q_heads + num_kv_heads
    q_k = (torch.arange(rotated)[:, None] * head_dim + pairs[None, :]).reshape(-1)
    v = torch.arange(rotated * head_dim, (rotated + num_kv_heads) * head_dim)
    return torch.cat([q_k, v])


def default_tiles(out_features: int, in_features: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): the tuned entry, else the largest power of two <= 16
    dividing D rows (D even) and a K tile no wider than the input (at most 512)."""
    tuned = TUNED_TILES.get((out_features, in_features, head_dim))
    if tuned is not None:
        return tuned
    block_n = MAX_BLOCK_N
    while head_dim % block_n:
        block_n //= 2
    return block_n, min(512, triton.next_power_of_2(max(in_features, 16))), 4


def _same_device(device: torch.device, **tensors: Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device}, x on {device}; put them on one device")


def qkv_rope_append(x: Tensor, weight_perm: Tensor, bias_perm: Tensor | None, norm_weight: Tensor | None, eps: float,
                    k_cache: Tensor, v_cache: Tensor, positions: Tensor, cos: Tensor, sin: Tensor,
                    key_max: Tensor | None, key_min: Tensor | None, block_size: int, num_q_heads: int,
                    num_kv_heads: int, tiles: tuple[int, int, int] | None = None) -> Tensor:
    """One decode step's q|k|v projection of one row, RoPE, and the append, in one launch.

    x: [1, H] residual stream (fp16/bf16/fp32, last dim contiguous);
    weight_perm: [(Hq + 2 Hkv) D, H] in x's dtype, the fused [q | k | v] weight with its rows
    permuted by `rope_pair_permutation(Hq, Hkv, D)`; bias_perm: [(Hq + 2 Hkv) D] likewise, or None;
    norm_weight: [H] RMSNorm weight applied to x first (None: x as it is); eps: its epsilon;
    k_cache, v_cache: [1, Hkv, T_max, D] in x's dtype (one layout, last dim contiguous): this
    step's rotated key and value are written at positions[0] (outside [0, T_max): nothing
    written, and q_rot = 0; never checked on the host, that would sync);
    positions: [1] int32/int64 on x's device;
    cos, sin: [T >= T_max, D] RoPE table (one layout, last dim contiguous);
    key_max, key_min: [1, Hkv, NB_max, D] Quest metadata (fp32 or the cache's dtype, last dim
    contiguous) updated with the stored key, or both None; block_size: tokens per metadata block
    (a power of two);
    tiles: (BLOCK_N, BLOCK_K, num_warps) instead of `default_tiles` (BLOCK_N a power of two >= 2
    dividing D; BLOCK_K a power of two).
    -> q_rot [1, Hq, D] in x's dtype: the rotated queries.
    """
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"x must be one row [1, H] (batch 1); got {tuple(x.shape)}: for batch > 1 run "
                         "dense_gemv then cache_append.append_token(rope=...)")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x must be one of {SUPPORTED_DTYPES}; got {x.dtype}")
    if num_q_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"need >= 1 query and KV head; got num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(f"k_cache and v_cache must be [1, Hkv, T_max, D] with one layout; got "
                         f"{tuple(k_cache.shape)} {k_cache.stride()} and {tuple(v_cache.shape)} {v_cache.stride()}")
    batch, cache_heads, max_tokens, head_dim = k_cache.shape
    if batch != 1 or cache_heads != num_kv_heads:
        raise ValueError(f"the caches must be [1, Hkv={num_kv_heads}, T_max, D]; got {tuple(k_cache.shape)}")
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"RoPE pairs dims d and d + D/2: head_dim must be even and >= 2; got D={head_dim}")
    hidden = x.shape[1]
    rows = (num_q_heads + 2 * num_kv_heads) * head_dim
    if weight_perm.shape != (rows, hidden):
        raise ValueError(f"weight_perm must be [(Hq + 2 Hkv) D, H]=[{rows}, {hidden}] (Hq={num_q_heads}, "
                         f"Hkv={num_kv_heads}, D={head_dim}); got {tuple(weight_perm.shape)}")
    for name, t in (("weight_perm", weight_perm), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != x.dtype:
            raise ValueError(f"{name} must be in x's dtype {x.dtype}; got {t.dtype}")
    for name, t, shape in (("bias_perm", bias_perm, (rows,)), ("norm_weight", norm_weight, (hidden,))):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}; got {tuple(t.shape)}")
    for name, t in (("bias_perm", bias_perm), ("norm_weight", norm_weight), ("cos", cos), ("sin", sin)):
        if t is not None and t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} must be one of {SUPPORTED_DTYPES} (read as fp32); got {t.dtype}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim or cos.shape[0] < max_tokens \
            or cos.stride() != sin.stride():
        raise ValueError(f"cos and sin must be one [T >= T_max={max_tokens}, D={head_dim}] layout; got "
                         f"{tuple(cos.shape)} {cos.stride()} and {tuple(sin.shape)} {sin.stride()}")
    if positions.shape != (1,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be an int32/int64 tensor of shape [1]; got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    has_meta = check_append_metadata(key_max, key_min, k_cache, block_size)
    _same_device(x.device, weight_perm=weight_perm, bias_perm=bias_perm, norm_weight=norm_weight, k_cache=k_cache,
                 v_cache=v_cache, positions=positions, cos=cos, sin=sin, key_max=key_max, key_min=key_min)
    # The kernel indexes these last dims with unit stride (the ones Triton would specialise anyway).
    for name, t in (("x", x), ("weight_perm", weight_perm), ("bias_perm", bias_perm), ("norm_weight", norm_weight),
                    ("k_cache", k_cache), ("cos", cos), ("key_max", key_max)):
        if t is not None and t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim; got strides {t.stride()}")
    if hidden == 0:
        raise ValueError("hidden size H must be >= 1")
    block_n, block_k, num_warps = tiles or default_tiles(rows, hidden, head_dim)
    if block_n < 2 or block_n & (block_n - 1) or head_dim % block_n:
        raise ValueError(f"BLOCK_N={block_n} must be a power of two >= 2 dividing head_dim={head_dim} (its tiles "
                         f"hold whole RoPE pairs of one head): pass tiles=(BLOCK_N, BLOCK_K, warps) with e.g. "
                         f"BLOCK_N={default_tiles(0, 0, head_dim)[0]}")
    if block_k < 1 or block_k & (block_k - 1):
        raise ValueError(f"BLOCK_K={block_k} must be a power of two")
    q_rot = torch.empty(1, num_q_heads, head_dim, dtype=x.dtype, device=x.device)
    meta = (key_max, key_min) if has_meta else (k_cache, k_cache)  # never dereferenced without HAS_META
    _qkv_rope_append_kernel[(rows // block_n,)](
        x, norm_weight if norm_weight is not None else x, weight_perm,
        bias_perm if bias_perm is not None else weight_perm, q_rot,
        k_cache, v_cache, positions, *meta, cos, sin,
        hidden, float(eps), weight_perm.stride(0), num_q_heads, num_kv_heads,
        max_tokens, key_max.shape[2] if has_meta else 0,
        k_cache.stride(1), k_cache.stride(2),
        key_max.stride(1) if has_meta else 0, key_max.stride(2) if has_meta else 0,
        cos.stride(0),
        NORM=norm_weight is not None, HAS_BIAS=bias_perm is not None, HAS_META=has_meta,
        EVEN_K=hidden % block_k == 0, HEAD_DIM=head_dim, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_SIZE=block_size if has_meta else 16, num_warps=num_warps, **launch_kwargs(x.device),
    )  # fmt: skip
    return q_rot
