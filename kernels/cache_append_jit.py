"""Triton kernel appending one decode token to the KV cache, and (optionally) to the Quest
metadata of its block, in one launch (two cache copies and a metadata update are three
launches otherwise: at batch 1 each costs more than the bytes it moves); with ROPE it also
rotates this step's key and its GQA group's queries (RoPE would be one more launch).
Launcher: `prr.kernels.cache_append`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_prologue
from .quest_jit import _quest_update_one


@triton.jit
def _append_token_kernel(
    k_cache_ptr,  # [B, Hkv, T_max, D]
    v_cache_ptr,  # [B, Hkv, T_max, D], k_cache's strides
    k_new_ptr,  # [B, Hkv, D] this step's key (post-RoPE)
    v_new_ptr,  # [B, Hkv, D] this step's value
    positions_ptr,  # [B] int32/int64: the token position written in each row
    key_max_ptr,  # [B, Hkv, NB_max, D] Quest metadata (HAS_META), updated in place
    key_min_ptr,  # [B, Hkv, NB_max, D] key_max's dtype and strides
    cos_ptr,  # [T_cos, D] RoPE table rows by position (ROPE)
    sin_ptr,  # [T_cos, D] cos's strides
    q_ptr,  # [B, Hq, D] this step's queries before RoPE (ROPE)
    q_out_ptr,  # [B, Hq, D] contiguous: the rotated queries (ROPE)
    max_tokens,  # T_max
    max_blocks,  # NB_max
    head_dim,  # D
    stride_cb, stride_ch, stride_ct, stride_cd,
    stride_kb, stride_kh, stride_kd,
    stride_vb, stride_vh, stride_vd,
    stride_mb, stride_mh, stride_mn, stride_md,
    stride_ct_rope, stride_cd_rope,
    stride_qb, stride_qh, stride_qd,
    HAS_META: tl.constexpr,
    ROPE: tl.constexpr,  # k_new and q are pre-RoPE: rotate both by the table rows at positions[b]
    GROUP: tl.constexpr,  # query heads per KV head (ROPE)
    GROUP_PAD: tl.constexpr,  # next power of two >= GROUP
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (a power of two)
    BLOCK_D: tl.constexpr,  # next power of two >= D
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    position = tl.load(positions_ptr + batch).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    live_d = offs_d < head_dim
    k = tl.load(k_new_ptr + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh + offs_d * stride_kd,
                mask=live_d, other=0.0)
    v = tl.load(v_new_ptr + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh + offs_d * stride_vd,
                mask=live_d, other=0.0)
    # Positions outside [0, T_max) write nothing (the caller's error; never checked on the host).
    in_cache = offs_d < tl.where(position >= 0, tl.where(position < max_tokens, head_dim, 0), 0)
    if ROPE:
        # x * cos + rotate_half(x) * sin in fp32, rotate_half(x) = [-x2, x1] (prr.model.rope.apply_rope)
        half = head_dim // 2
        partner = tl.where(offs_d < half, offs_d + half, offs_d - half)
        sign = tl.where(offs_d < half, -1.0, 1.0)
        c = tl.load(cos_ptr + position * stride_ct_rope + offs_d * stride_cd_rope, mask=in_cache, other=0.0)
        s = tl.load(sin_ptr + position * stride_ct_rope + offs_d * stride_cd_rope, mask=in_cache, other=0.0)
        c, s = c.to(tl.float32), s.to(tl.float32)
        k_partner = tl.load(k_new_ptr + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
                            + partner * stride_kd, mask=live_d, other=0.0).to(tl.float32)
        k = k.to(tl.float32) * c + (sign * k_partner) * s
        heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
        live_q = (tl.arange(0, GROUP_PAD) < GROUP)[:, None] & live_d[None, :]
        q_row = q_ptr + batch.to(tl.int64) * stride_qb + heads[:, None].to(tl.int64) * stride_qh
        q = tl.load(q_row + offs_d[None, :] * stride_qd, mask=live_q, other=0.0).to(tl.float32)
        q_partner = tl.load(q_row + partner[None, :] * stride_qd, mask=live_q, other=0.0).to(tl.float32)
        q = q * c[None, :] + (sign[None, :] * q_partner) * s[None, :]
        q_out = q_out_ptr + (batch.to(tl.int64) * tl.num_programs(0) * GROUP + heads[:, None]) * head_dim
        tl.store(q_out + offs_d[None, :], q, mask=live_q)
    slot = batch.to(tl.int64) * stride_cb + kv_head.to(tl.int64) * stride_ch + position * stride_ct + offs_d * stride_cd
    tl.store(k_cache_ptr + slot, k, mask=in_cache)
    tl.store(v_cache_ptr + slot, v, mask=in_cache)
    if HAS_META:
        # The key as the cache holds it, so the metadata equals a rebuild from the cache.
        k_cached = k.to(k_cache_ptr.dtype.element_ty).to(tl.float32)
        meta_base = batch.to(tl.int64) * stride_mb + kv_head.to(tl.int64) * stride_mh
        _quest_update_one(key_max_ptr, key_min_ptr, k_cached, position, meta_base, max_blocks, head_dim,
                          stride_mn, stride_md, BLOCK_SIZE, BLOCK_D)
