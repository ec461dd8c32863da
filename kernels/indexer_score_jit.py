"""Triton kernel for the lightning indexer's scores over the index-key cache (bf16 or fp8 keys).
Launcher: `prr.kernels.indexer_score`; reference:
`prr.kernels.reference_indexer.indexer_scores_reference`.

score[b, t] = Σ_h w[b, h] · ReLU(scale[b, t] · (q[b, h] · k[b, t])) for t < lengths[b], -inf beyond.
At batch 1 a row is split over many programs (grid: (splits, B)); program s of row b takes the
row's token tiles s, s + splits, ... and for each one does a [BLOCK_T, d_I] x [d_I, H_I]
tensor-core dot against all index heads at once, the ReLU and the weighted sum over heads. q and w
are loaded once per program; the tile loop is software-pipelined (NUM_STAGES), so the key reads
stream. The scores are byte-bound: d_I · elem (+ 4 for fp8's scale) bytes read and 4 written a token.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .indexer_keys_jit import _round_to_bf16_grid
from .pdl import pdl_prologue


@triton.jit
def _dot_operand(x, DOT_FP32: tl.constexpr):
    """A bf16-valued tile as a dot operand: bf16 (tensor cores), or fp32 holding the same values
    under the interpreter (whose bf16 dot is wrong); products are exact in fp32 either way."""
    if DOT_FP32:
        return x.to(tl.float32)
    return x.to(tl.bfloat16)


@triton.jit
def _indexer_score_kernel(
    q_ptr,  # [B, H_I, D] bf16/fp32 index queries
    weights_ptr,  # [B, H_I] fp32 head weights
    keys_ptr,  # [B, T_max, D] bf16 or float8e4nv index keys
    scales_ptr,  # [B, T_max] fp32 per-token scales (FP8)
    lengths_ptr,  # [B] int32/int64 valid tokens per row
    out_ptr,  # [B, T_max] fp32 scores, -inf from lengths[b] on
    max_tokens,  # T_max
    num_heads,  # H_I
    stride_qb, stride_qh, stride_qd,
    stride_wb, stride_wh,
    stride_kb, stride_kt, stride_kd,
    stride_sb, stride_st,
    stride_ob, stride_ot,
    FP8: tl.constexpr,  # keys in e4m3: each token's dot products times its scale
    SPLIT_Q: tl.constexpr,  # fp32 q: q = q_hi + q_lo, two bf16 dots (q to ~16 significant bits)
    DOT_FP32: tl.constexpr,  # the interpreter: the dots' bf16 operands held in fp32
    BLOCK_T: tl.constexpr,  # tokens per tile (the dot's M)
    BLOCK_H: tl.constexpr,  # next power of two >= max(H_I, 16) (the dot's N)
    HEAD_DIM: tl.constexpr,  # d_I, a power of two >= 16 (the dot's K)
    NUM_STAGES: tl.constexpr,  # software-pipelining depth of the tile loop
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    split = tl.program_id(0)
    num_splits = tl.num_programs(0)
    batch = tl.program_id(1).to(tl.int64)
    length = tl.load(lengths_ptr + batch).to(tl.int32)
    length = tl.minimum(tl.maximum(length, 0), max_tokens)

    offs_h = tl.arange(0, BLOCK_H)
    live_h = offs_h < num_heads
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + batch * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=live_h[:, None], other=0.0).to(tl.float32)  # [BLOCK_H, D]; padded heads 0
    weights = tl.load(weights_ptr + batch * stride_wb + offs_h * stride_wh, mask=live_h, other=0.0)  # [BLOCK_H]
    q_hi = _round_to_bf16_grid(q)
    q_hi_t = tl.trans(_dot_operand(q_hi, DOT_FP32))  # [D, BLOCK_H]
    q_lo_t = q_hi_t
    if SPLIT_Q:
        # q - q_hi is exact in fp32; its bf16 rounding leaves ~2^-17 |q|, below the keys' own rounding.
        q_lo_t = tl.trans(_dot_operand(_round_to_bf16_grid(q - q_hi), DOT_FP32))

    key_row = keys_ptr + batch * stride_kb + offs_d[None, :] * stride_kd
    out_row = out_ptr + batch * stride_ob
    live_tiles = tl.cdiv(length, BLOCK_T)
    for tile in tl.range(split, live_tiles, num_splits, num_stages=NUM_STAGES):
        offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        live_t = offs_t < length
        keys = tl.load(key_row + offs_t[:, None].to(tl.int64) * stride_kt, mask=live_t[:, None], other=0.0)
        keys = _dot_operand(keys, DOT_FP32)  # fp8 -> bf16 is exact
        dots = tl.dot(keys, q_hi_t)  # [BLOCK_T, BLOCK_H] fp32
        if SPLIT_Q:
            dots = tl.dot(keys, q_lo_t, acc=dots)
        if FP8:
            scale = tl.load(scales_ptr + batch * stride_sb + offs_t.to(tl.int64) * stride_st, mask=live_t, other=0.0)
            dots = dots * scale[:, None]
        score = tl.sum(tl.maximum(dots, 0.0) * weights[None, :], axis=1)  # [BLOCK_T]
        tl.store(out_row + offs_t.to(tl.int64) * stride_ot, tl.where(live_t, score, float("-inf")),
                 mask=offs_t < max_tokens)
    # Tiles wholly past the row's length: -inf, nothing read. This program's first one is the
    # first tile >= live_tiles congruent to `split` modulo num_splits.
    first_dead = split + tl.cdiv(tl.maximum(live_tiles - split, 0), num_splits) * num_splits
    for tile in range(first_dead, tl.cdiv(max_tokens, BLOCK_T), num_splits):
        offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        tl.store(out_row + offs_t.to(tl.int64) * stride_ot, tl.full([BLOCK_T], float("-inf"), tl.float32),
                 mask=offs_t < max_tokens)
