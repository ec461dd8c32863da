"""Triton kernel for the batch-1 q|k|v projection with RoPE and the decode append in its
epilogue: one launch where the GEMV (prr.kernels.dense_gemv) and the append
(prr.kernels.cache_append.append_token(rope=...)) were two (at batch 1 a launch costs more
than the bytes the append moves). Launcher: `prr.kernels.qkv_append`.

RoPE (HF rotate_half) pairs dim d with d + D/2 of a head. The launcher's weight has the q and
k rows of every head in pair order [0, D/2, 1, D/2 + 1, ..., D/2 - 1, D - 1]
(`rope_pair_permutation`), so a tile of BLOCK_N rows (even, dividing D) holds whole pairs of
one head: adjacent outputs (2j, 2j + 1) are dims (j0 + j, j0 + j + D/2), rotated in registers
and stored at their own dims. V rows keep their order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .dense_gemv_jit import _gemv_tile
from .quest_jit import _quest_update_one


@triton.jit
def _qkv_rope_append_kernel(
    x_ptr,  # [1, K] the residual stream (model dtype), last dim contiguous
    norm_w_ptr,  # [K] RMSNorm weight (NORM)
    w_ptr,  # [(Hq + 2 Hkv) D, K] q|k|v weight, q and k rows pair-ordered per head (rope_pair_permutation)
    bias_ptr,  # [(Hq + 2 Hkv) D] permuted the same way (HAS_BIAS)
    q_out_ptr,  # [1, Hq, D] contiguous: the rotated queries (model dtype)
    k_cache_ptr,  # [1, Hkv, T_max, D] model dtype, last dim contiguous
    v_cache_ptr,  # [1, Hkv, T_max, D] k_cache's strides
    positions_ptr,  # [1] int32/int64: the position written (outside [0, T_max): nothing written)
    key_max_ptr,  # [1, Hkv, NB_max, D] Quest metadata (HAS_META), last dim contiguous, updated in place
    key_min_ptr,  # [1, Hkv, NB_max, D] key_max's dtype and strides
    cos_ptr,  # [T_cos >= T_max, D] RoPE table rows by position, last dim contiguous
    sin_ptr,  # [T_cos, D] cos's strides
    K,  # hidden size (input features)
    eps,  # RMSNorm epsilon
    stride_wn,
    num_q_heads,  # Hq
    num_kv_heads,  # Hkv
    max_tokens,  # T_max
    max_blocks,  # NB_max
    stride_ch, stride_ct,  # cache strides of a KV head and of a token
    stride_mh, stride_mn,  # metadata strides of a KV head and of a block
    stride_rope,  # cos / sin row stride
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_META: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks on x along K
    HEAD_DIM: tl.constexpr,  # D (even)
    BLOCK_N: tl.constexpr,  # weight rows per program: a power of two, even, dividing D
    BLOCK_K: tl.constexpr,  # input features per loop iteration
    BLOCK_SIZE: tl.constexpr,  # tokens per metadata block (a power of two)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    # grid: ((Hq + 2 Hkv) D / BLOCK_N,): each program one tile of one head of q, k or v.
    row0 = tl.program_id(0) * BLOCK_N
    offs_n = row0 + tl.arange(0, BLOCK_N)
    # every row is live: BLOCK_N divides D, and N_w is a multiple of D
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    y, _, rstd = _gemv_tile(x_ptr, norm_w_ptr, w_rows, w_rows, offs_n >= 0, K, eps,
                            NORM, False, EVEN_K, BLOCK_N, BLOCK_K, PDL)  # [BLOCK_N] fp32 (W · x)
    y = y * rstd
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n).to(tl.float32)
    out_ty = q_out_ptr.dtype.element_ty
    head = row0 // HEAD_DIM  # of the Hq + 2 Hkv heads: q, then k, then v
    d0 = row0 % HEAD_DIM  # this tile's first row within the head
    # After the PDL wait (in the loop's prologue): the position may come from the previous step.
    position = tl.load(positions_ptr).to(tl.int64)
    # Positions outside [0, T_max) write nothing. (Scalar conditions become lane limits: the
    # CPU interpreter mishandles scalar & tensor masks.)
    lanes_in = tl.where(position >= 0, tl.where(position < max_tokens, BLOCK_N, 0), 0)
    HALF_N: tl.constexpr = BLOCK_N // 2
    HALF_D: tl.constexpr = HEAD_DIM // 2
    if head < num_q_heads + num_kv_heads:  # q or k: rotate the tile's pairs
        # The reference rounds the projection to the model dtype, rotates in fp32, rounds once.
        a, b = tl.split(tl.reshape(y.to(out_ty).to(tl.float32), [HALF_N, 2]))  # dims (j, j + D/2)
        dims = d0 // 2 + tl.arange(0, HALF_N)  # [HALF_N] the first halves' dims
        live = tl.arange(0, HALF_N) < lanes_in // 2
        rope_row = position * stride_rope
        c_a = tl.load(cos_ptr + rope_row + dims, mask=live, other=0.0).to(tl.float32)
        s_a = tl.load(sin_ptr + rope_row + dims, mask=live, other=0.0).to(tl.float32)
        c_b = tl.load(cos_ptr + rope_row + dims + HALF_D, mask=live, other=0.0).to(tl.float32)
        s_b = tl.load(sin_ptr + rope_row + dims + HALF_D, mask=live, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] (prr.model.rope.apply_rope)
        rot_a = a * c_a + (-b) * s_a
        rot_b = b * c_b + a * s_b
        if head < num_q_heads:  # (an out-of-range position gives q = 0, as append_token does)
            q_at = q_out_ptr + head * HEAD_DIM + dims
            tl.store(q_at, rot_a.to(out_ty))
            tl.store(q_at + HALF_D, rot_b.to(out_ty))
        else:
            kv_head = (head - num_q_heads).to(tl.int64)
            k_at = k_cache_ptr + kv_head * stride_ch + position * stride_ct + dims
            key_a = rot_a.to(k_cache_ptr.dtype.element_ty)
            key_b = rot_b.to(k_cache_ptr.dtype.element_ty)
            tl.store(k_at, key_a, mask=live)
            tl.store(k_at + HALF_D, key_b, mask=live)
            if HAS_META:
                # The key as the cache holds it (the metadata equals a rebuild from the cache);
                # each half updates its own dims of block position // BLOCK_SIZE.
                meta_base = kv_head * stride_mh + d0 // 2
                _quest_update_one(key_max_ptr, key_min_ptr, key_a.to(tl.float32), position, meta_base, max_blocks,
                                  HALF_N, stride_mn, 1, BLOCK_SIZE, HALF_N)
                _quest_update_one(key_max_ptr, key_min_ptr, key_b.to(tl.float32), position, meta_base + HALF_D,
                                  max_blocks, HALF_N, stride_mn, 1, BLOCK_SIZE, HALF_N)
    else:  # v: rows in dim order
        kv_head = (head - num_q_heads - num_kv_heads).to(tl.int64)
        v_at = v_cache_ptr + kv_head * stride_ch + position * stride_ct + d0 + tl.arange(0, BLOCK_N)
        tl.store(v_at, y.to(v_cache_ptr.dtype.element_ty), mask=tl.arange(0, BLOCK_N) < lanes_in)
