"""Torch reference for kernels/cache_append.py's `append_token` without metadata (the Quest
metadata update's reference is reference_selection.quest_metadata_reference): the K/V writes
and the fused RoPE of q and k. Static shapes, no host syncs: the graph engine's torch backend
runs it (prr.runtime.engine_ops.TorchOps). Imports nothing from prr and nothing from triton.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE as prr.model.rope.apply_rope, in fp32: x [B, H, D], cos / sin [B, 1, D] fp32 -> [B, H, D] fp32."""
    half = x.shape[-1] // 2
    x = x.float()
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def append_token_reference(k_cache: Tensor, v_cache: Tensor, k_new: Tensor, v_new: Tensor, positions: Tensor,
                           rope: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor | None:
    """k_cache, v_cache [B, Hkv, T_max, D] <- k_new, v_new [B, Hkv, D] at positions [B] (each in
    [0, T_max)), in place, cast to the cache dtype. rope = (cos, sin [T, D], q [B, Hq, D]): q and
    k rotated by their position's row first, in fp32, rounded once.
    -> the rotated q [B, Hq, D] in q's dtype (None without rope)."""
    rows, pos = torch.arange(k_cache.shape[0], device=k_cache.device), positions.long()
    q_rot = None
    if rope is not None:
        cos, sin, q = rope
        c, s = cos[pos].float().unsqueeze(1), sin[pos].float().unsqueeze(1)  # [B, 1, D]
        q_rot, k_new = rotate(q, c, s).to(q.dtype), rotate(k_new, c, s)
    k_cache[rows, :, pos] = k_new.to(k_cache.dtype)
    v_cache[rows, :, pos] = v_new.to(v_cache.dtype)
    return q_rot
