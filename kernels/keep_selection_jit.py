"""Triton kernel keeping a layer's A for reuse=steps in one launch: one program per (KV head, row)
copies the row's C ids into the width-wide buffer with zero padding past C, its count, and the
scores A came from (when given). Launcher: `prr.kernels.keep_selection`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_prologue


@triton.jit
def _keep_selection_kernel(
    idx_ptr,  # [B, Hkv, C] int32 / int64: A's ids, copied as they are (padding past count included)
    count_ptr,  # [B, Hkv] int32 / int64
    scores_ptr,  # [B, Hkv, NB] fp32 / bf16 / fp16 (unread without HAS_SCORES)
    out_idx_ptr,  # [B, Hkv, W] int32 contiguous: A, then zeros
    out_count_ptr,  # [B, Hkv] int32 contiguous
    out_scores_ptr,  # [B, Hkv, NB] fp32 contiguous (unwritten without HAS_SCORES)
    num_kv_heads,  # Hkv
    capacity,  # C
    width,  # W
    num_scores,  # NB
    stride_ib, stride_ih, stride_ic,
    stride_cb, stride_ch,
    stride_sb, stride_sh, stride_sn,
    BLOCK_OUT: tl.constexpr,  # next power of two >= W
    BLOCK_SCORES: tl.constexpr,  # scores copied at a time
    HAS_SCORES: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    head = tl.program_id(0)
    batch = tl.program_id(1)
    row = (batch * num_kv_heads + head).to(tl.int64)  # the outputs' row (contiguous)
    offs = tl.arange(0, BLOCK_OUT)
    ids = tl.load(idx_ptr + batch.to(tl.int64) * stride_ib + head.to(tl.int64) * stride_ih + offs * stride_ic,
                  mask=offs < capacity, other=0)
    tl.store(out_idx_ptr + row * width + offs, ids.to(tl.int32), mask=offs < width)  # past C: the zeros of `other`
    count = tl.load(count_ptr + batch * stride_cb + head * stride_ch)
    tl.store(out_count_ptr + row, count.to(tl.int32))
    if HAS_SCORES:
        src = scores_ptr + batch.to(tl.int64) * stride_sb + head.to(tl.int64) * stride_sh
        dst = out_scores_ptr + row * num_scores
        for start in range(0, num_scores, BLOCK_SCORES):
            at = start + tl.arange(0, BLOCK_SCORES)
            inside = at < num_scores
            tl.store(dst + at, tl.load(src + at * stride_sn, mask=inside).to(tl.float32), mask=inside)
