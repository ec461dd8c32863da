"""Triton kernel for a decode step's lightning-indexer inputs from one projection of each row's
normed hidden state (the query heads rotated, the head weights, the index key normed, rotated and
appended). Launcher: `prr.kernels.indexer_step.indexer_step_inputs`; reference:
`prr.kernels.reference_indexer.indexer_step_reference`.

Grid (B, H_I + 1): program h < H_I rotates query head h and copies head weight h; program H_I
LayerNorms the key, rotates it and stores it in the index-key cache (bf16, or fp8 quantized per
token: kernels/indexer_keys_jit.py's store). All arithmetic in fp32. One launch where the torch path
takes about thirty (RoPE's slices, casts and cats, the LayerNorm, the copies).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .indexer_keys_jit import _store_index_key
from .pdl import pdl_prologue


@triton.jit
def _rotation(offs, position, inv_freq_ptr, ROPE_DIM: tl.constexpr):
    """Per lane of a d_I vector: (partner lane, sign, cos, sin, rotated?) of rotate-half RoPE on
    the leading ROPE_DIM lanes at `position` (the angle position · inv_freq[i mod ROPE_DIM/2], one
    fp32 product, as reference_indexer.index_rope_angles)."""
    half = ROPE_DIM // 2
    rotated = offs < ROPE_DIM
    low = offs < half
    partner = tl.where(low, offs + half, offs - half)
    freq = tl.load(inv_freq_ptr + tl.where(low, offs, offs - half), mask=rotated, other=0.0)
    angle = position.to(tl.float32) * freq
    sign = tl.where(low, -1.0, 1.0)
    return partner, sign, tl.cos(angle), tl.sin(angle), rotated


@triton.jit
def _indexer_step_kernel(
    projection_ptr,  # [B, H_I*d_I + d_I + H_I] fp16/bf16/fp32: x [W_q; W_k; W_w]ᵀ
    positions_ptr,  # [B] int32/int64: each row's decode position
    inv_freq_ptr,  # [ROPE_DIM // 2] fp32
    norm_weight_ptr, norm_bias_ptr,  # [d_I] the key's LayerNorm
    query_ptr,  # [B, H_I, d_I] fp32 out
    head_weights_ptr,  # [B, H_I] fp32 out
    key_cache_ptr,  # [B, T_max, d_I] bf16 or float8e4nv
    key_scales_ptr,  # [B, T_max] fp32 (FP8)
    max_tokens, eps,
    stride_pb, stride_qb, stride_qh, stride_wb,
    stride_cb, stride_ct, stride_cd, stride_sb, stride_st,
    INDEX_HEADS: tl.constexpr, INDEX_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
    FP8: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    batch = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    position = tl.load(positions_ptr + batch).to(tl.int64)
    offs = tl.arange(0, INDEX_DIM)
    partner, sign, cos, sin, rotated = _rotation(offs, position, inv_freq_ptr, ROPE_DIM)
    row = projection_ptr + batch * stride_pb
    if head < INDEX_HEADS:
        q = tl.load(row + head * INDEX_DIM + offs).to(tl.float32)
        q_partner = tl.load(row + head * INDEX_DIM + partner, mask=rotated, other=0.0).to(tl.float32)
        q = tl.where(rotated, q * cos + (sign * q_partner) * sin, q)
        tl.store(query_ptr + batch * stride_qb + head * stride_qh + offs, q)
        weight = tl.load(row + INDEX_HEADS * INDEX_DIM + INDEX_DIM + head).to(tl.float32)
        tl.store(head_weights_ptr + batch * stride_wb + head, weight)
    else:
        key = row + INDEX_HEADS * INDEX_DIM
        k = tl.load(key + offs).to(tl.float32)
        # (/ d_I as a product by 1 / d_I: exact for a power of two, where Triton's `/` is an approximate division)
        mean = tl.sum(k, axis=0) * (1.0 / INDEX_DIM)
        variance = tl.sum((k - mean) * (k - mean), axis=0) * (1.0 / INDEX_DIM)  # biased, as F.layer_norm's
        rstd = tl.math.div_rn(1.0, tl.sqrt_rn(variance + eps))  # correctly rounded, as torch's 1 / sqrt (`/` may approximate)
        normed = (k - mean) * rstd * tl.load(norm_weight_ptr + offs).to(tl.float32) + \
            tl.load(norm_bias_ptr + offs).to(tl.float32)
        k_partner = tl.load(key + partner, mask=rotated, other=0.0).to(tl.float32)
        normed_partner = (k_partner - mean) * rstd * tl.load(norm_weight_ptr + partner, mask=rotated, other=0.0).to(
            tl.float32) + tl.load(norm_bias_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
        k = tl.where(rotated, normed * cos + (sign * normed_partner) * sin, normed)
        _store_index_key(key_cache_ptr, key_scales_ptr, k, batch, position, max_tokens, INDEX_DIM,
                         stride_cb, stride_ct, stride_cd, stride_sb, stride_st, FP8, INDEX_DIM)
