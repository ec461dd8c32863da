"""Launcher for the one-launch decode append (checks, grid); the kernel is in
`prr.kernels.cache_append_jit`. Equals `k_cache[b, :, p_b] = k_new[b]`,
`v_cache[b, :, p_b] = v_new[b]` and, with metadata, `quest.quest_update` of the same key.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from .cache_append_jit import _append_token_kernel
from .pdl import launch_kwargs
from .quest import _check_head_dim, _check_metadata, _check_per_row


def check_append_metadata(key_max: Tensor | None, key_min: Tensor | None, k_cache: Tensor, block_size: int) -> bool:
    """Checks of the Quest metadata an append updates -> whether there is any.
    key_max, key_min: [B, Hkv, NB_max, D] (fp32 or k_cache's dtype), both or neither;
    k_cache: [B, Hkv, T_max, D]; block_size: tokens per block, a power of two."""
    if key_max is None and key_min is None:
        return False
    if key_max is None or key_min is None:
        raise ValueError("pass both key_max and key_min, or neither")
    _check_metadata(key_max, key_min)
    if key_max.dtype not in (torch.float32, k_cache.dtype):
        # Rounding a key's max to a narrower dtype could fall below the key: no longer a bound.
        raise ValueError(f"key_max/key_min dtype {key_max.dtype} must be fp32 or the cache's {k_cache.dtype}")
    if key_max.device != k_cache.device:
        raise ValueError(f"the metadata is on {key_max.device}, the cache on {k_cache.device}; put them on one device")
    batch, num_kv_heads, _, head_dim = k_cache.shape
    if key_max.shape[:2] != (batch, num_kv_heads) or key_max.shape[3] != head_dim:
        raise ValueError(f"key_max must be [B, Hkv, NB_max, D]=[{batch}, {num_kv_heads}, NB_max, {head_dim}]; "
                         f"got {tuple(key_max.shape)}")
    if not isinstance(block_size, int) or block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size} must be a power of two (e.g. 16, 32, 64)")
    return True


def append_token(k_cache: Tensor, v_cache: Tensor, k_new: Tensor, v_new: Tensor, positions: Tensor,
                 key_max: Tensor | None = None, key_min: Tensor | None = None, block_size: int = 16,
                 rope: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor | None:
    """Write this step's K/V into the caches at positions[b], in place, and update the Quest
    metadata of their block when key_max / key_min are given.

    rope = (cos, sin, q): k_new and q [B, Hq, D] are pre-RoPE; both are rotated by the table
    rows cos[positions[b]], sin[positions[b]] (cos, sin: [T >= T_max, D]) as
    prr.model.rope.apply_rope does (in fp32, rounded once), the key before it is stored.
    -> the rotated q [B, Hq, D] in q's dtype (None without rope); a row whose position is
    outside [0, T_max) gets q = 0 (and writes nothing).

    k_cache, v_cache: [B, Hkv, T_max, D] (one dtype, one layout); k_new, v_new: [B, Hkv, D]
    (cast to the cache dtype on store); positions: [B] int32/int64 (positions outside
    [0, T_max) write nothing: never checked on the host, that would sync);
    key_max, key_min: [B, Hkv, NB_max, D] (fp32 or the cache dtype) or both None;
    block_size: tokens per block of the metadata (a power of two).
    """
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(f"k_cache and v_cache must be [B, Hkv, T_max, D] with one layout; got "
                         f"{tuple(k_cache.shape)} {k_cache.stride()} and {tuple(v_cache.shape)} {v_cache.stride()}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share a dtype; got {k_cache.dtype} and {v_cache.dtype}")
    batch, num_kv_heads, max_tokens, head_dim = k_cache.shape
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if t.shape != (batch, num_kv_heads, head_dim):
            raise ValueError(f"{name} must be [B, Hkv, D]=[{batch}, {num_kv_heads}, {head_dim}]; got {tuple(t.shape)}")
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device}, the cache on {k_cache.device}; put them on one device")
    _check_head_dim(head_dim)
    _check_per_row("positions", positions, batch, k_cache.device)
    has_meta = check_append_metadata(key_max, key_min, k_cache, block_size)
    q_out = None
    if rope is not None:
        cos, sin, q = rope
        if q.dim() != 3 or q.shape[0] != batch or q.shape[2] != head_dim or q.shape[1] % max(num_kv_heads, 1):
            raise ValueError(f"rope's q must be [B, Hq, D] with Hq a multiple of Hkv={num_kv_heads}, B={batch}, "
                             f"D={head_dim}; got {tuple(q.shape)}")
        if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim or cos.shape[0] < max_tokens \
                or cos.stride() != sin.stride():
            raise ValueError(f"rope's cos and sin must be one [T >= T_max={max_tokens}, D={head_dim}] layout; got "
                             f"{tuple(cos.shape)} {cos.stride()} and {tuple(sin.shape)} {sin.stride()}")
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim; got {head_dim}")
        for name, t in (("q", q), ("cos", cos), ("sin", sin)):
            if t.device != k_cache.device:
                raise ValueError(f"rope's {name} is on {t.device}, the cache on {k_cache.device}")
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0 or num_kv_heads == 0:
        return q_out
    meta = (key_max, key_min) if has_meta else (k_cache, k_cache)  # never dereferenced without HAS_META
    group = q_out.shape[1] // num_kv_heads if rope is not None else 1
    table = (rope[0], rope[1], rope[2], q_out) if rope is not None else (k_cache, k_cache, k_cache, k_cache)
    _append_token_kernel[(num_kv_heads, batch)](
        k_cache, v_cache, k_new, v_new, positions, *meta, *table,
        max_tokens, meta[0].shape[2] if has_meta else 0, head_dim,
        *k_cache.stride(), *k_new.stride(), *v_new.stride(),
        *(key_max.stride() if has_meta else (0, 0, 0, 0)),
        *(rope[0].stride() if rope is not None else (0, 0)),
        *(rope[2].stride() if rope is not None else (0, 0, 0)),
        HAS_META=has_meta, ROPE=rope is not None, GROUP=group, GROUP_PAD=triton.next_power_of_2(group),
        BLOCK_SIZE=block_size if has_meta else 16,
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1 if head_dim <= 128 else 2,
        **launch_kwargs(k_cache.device),
    )  # fmt: skip
    return q_out
