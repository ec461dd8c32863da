"""Triton kernels for Quest block selection (arXiv 2406.10774): block scores and the
incremental metadata update. Launchers with checks live in `prr.kernels.quest`.

Quest keeps, per KV head and block, the elementwise max M_b and min m_b of the block's keys
and scores a query q with U_b(q) = Σ_i max(q_i M_{b,i}, q_i m_{b,i}). Because M_b ≥ m_b
elementwise, max(q_i M_i, q_i m_i) = q_i⁺ M_i + q_i⁻ m_i with q⁺ = max(q, 0) and
q⁻ = min(q, 0): the score is two fused multiply-adds per element, no compare. Blocks past a
row's context are never loaded and score -inf.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_prologue
from .topk_jit import _order_keys, _select_row


@triton.jit
def _quest_score_tile(
    q_ptr,  # [B, Hq, D] fp16/bf16/fp32, Hq = Hkv * GROUP (query head h reads KV head h // GROUP)
    key_max_ptr,  # [B, Hkv, NB_max, D] fp32 (or fp16/bf16) elementwise key max per block
    key_min_ptr,  # [B, Hkv, NB_max, D] same dtype and strides as key_max
    num_blocks_ptr,  # [B] int32/int64: blocks in each row's context
    out_ptr,  # [B, Hkv, NB_max] fp32 GQA-reduced scores, -inf from num_blocks[b] on
    max_blocks,  # NB_max
    head_dim,  # D
    stride_qb, stride_qh, stride_qd,
    stride_mb, stride_mh, stride_mn, stride_md,
    stride_ob, stride_oh, stride_on,
    GROUP: tl.constexpr,  # G = Hq / Hkv
    GROUP_PAD: tl.constexpr,  # next power of two >= G
    SUM_GROUP: tl.constexpr,  # True: sum over the group's heads; False: max
    BLOCK_N: tl.constexpr,  # blocks per program
    BLOCK_D: tl.constexpr,  # next power of two >= D
    D_CHUNK: tl.constexpr,  # 0: per head over all of D; > 0: all heads at once, D in chunks; -1: tensor cores
):
    """Scores of blocks [tile * BLOCK_N, (tile + 1) * BLOCK_N) of one (row, KV head), stored."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)

    num_blocks = tl.load(num_blocks_ptr + batch).to(tl.int32)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] block ids
    live_n = (offs_n < num_blocks) & (offs_n < max_blocks)
    # key_max and key_min share strides: one offset serves both.
    meta_n = batch.to(tl.int64) * stride_mb + kv_head.to(tl.int64) * stride_mh
    meta_n += offs_n[:, None].to(tl.int64) * stride_mn  # [BLOCK_N, 1]
    q_row = q_ptr + batch.to(tl.int64) * stride_qb + (kv_head * GROUP).to(tl.int64) * stride_qh

    if D_CHUNK == -1:
        # Tensor cores (16-bit q and metadata of one dtype): the group's scores are two GEMMs,
        # q⁺ [GROUP_PAD, D] · M^T + q⁻ · m^T. q⁺, q⁻ are exact in q's dtype and 16-bit products
        # are exact in fp32; the tensor cores' fp32 accumulation may round differently from the
        # FMA path (a few ulps), so near-ties can rank differently. The FMA path spends ~8 FMAs
        # per loaded value and is instruction-bound, not byte-bound.
        offs_d = tl.arange(0, BLOCK_D)
        live_d = offs_d < head_dim
        live = live_n[:, None] & live_d[None, :]
        meta = meta_n + offs_d[None, :] * stride_md
        key_max = tl.load(key_max_ptr + meta, mask=live, other=0.0)  # [BLOCK_N, BLOCK_D] 16-bit
        key_min = tl.load(key_min_ptr + meta, mask=live, other=0.0)
        offs_g = tl.arange(0, GROUP_PAD)
        q_live = (offs_g[:, None] < GROUP) & live_d[None, :]
        q = tl.load(q_row + offs_g[:, None] * stride_qh + offs_d[None, :] * stride_qd, mask=q_live, other=0.0)
        zero = tl.zeros_like(q)
        q_pos = tl.maximum(q, zero).to(key_max.dtype)  # (older Triton widens 16-bit maximum to fp32)
        q_neg = tl.minimum(q, zero).to(key_max.dtype)
        per_head = tl.dot(q_pos, tl.trans(key_max)) + tl.dot(q_neg, tl.trans(key_min))
        real_head = (offs_g < GROUP)[:, None]  # [GROUP_PAD, BLOCK_N] fp32 above
        if SUM_GROUP:
            reduced = tl.sum(tl.where(real_head, per_head, 0.0), axis=0)  # [BLOCK_N]
        else:
            reduced = tl.max(tl.where(real_head, per_head, float("-inf")), axis=0)
    elif D_CHUNK == 0:
        # Load the [BLOCK_N, D] tiles once, then one reduction over D per query head.
        offs_d = tl.arange(0, BLOCK_D)
        live_d = offs_d < head_dim
        live = live_n[:, None] & live_d[None, :]
        meta = meta_n + offs_d[None, :] * stride_md
        # Masked-off lanes (past the context) read nothing from memory.
        key_max = tl.load(key_max_ptr + meta, mask=live, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        key_min = tl.load(key_min_ptr + meta, mask=live, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        reduced = tl.zeros([BLOCK_N], dtype=tl.float32)
        for g in tl.static_range(GROUP):
            q = tl.load(q_row + g * stride_qh + offs_d * stride_qd, mask=live_d, other=0.0).to(tl.float32)
            q_pos = tl.maximum(q, 0.0)  # [BLOCK_D]
            q_neg = tl.minimum(q, 0.0)
            score = tl.sum(key_max * q_pos[None, :] + key_min * q_neg[None, :], axis=1)  # [BLOCK_N]
            if g == 0:
                reduced = score
            elif SUM_GROUP:
                reduced = reduced + score
            else:
                reduced = tl.maximum(reduced, score)
    else:
        # All heads of the group at once: elementwise partial sums over D chunks, one short
        # reduction at the end (fewer cross-lane shuffles than a full-D reduction per head).
        offs_g = tl.arange(0, GROUP_PAD)
        acc = tl.zeros([GROUP_PAD, BLOCK_N, D_CHUNK], dtype=tl.float32)
        for d0 in tl.static_range(0, BLOCK_D, D_CHUNK):
            offs_d = d0 + tl.arange(0, D_CHUNK)
            live_d = offs_d < head_dim
            live = live_n[:, None] & live_d[None, :]
            meta = meta_n + offs_d[None, :] * stride_md
            key_max = tl.load(key_max_ptr + meta, mask=live, other=0.0).to(tl.float32)  # [BLOCK_N, D_CHUNK]
            key_min = tl.load(key_min_ptr + meta, mask=live, other=0.0).to(tl.float32)
            q_live = (offs_g[:, None] < GROUP) & live_d[None, :]
            q = tl.load(
                q_row + offs_g[:, None] * stride_qh + offs_d[None, :] * stride_qd, mask=q_live, other=0.0
            ).to(tl.float32)  # [GROUP_PAD, D_CHUNK]
            q_pos = tl.maximum(q, 0.0)
            q_neg = tl.minimum(q, 0.0)
            acc += key_max[None, :, :] * q_pos[:, None, :] + key_min[None, :, :] * q_neg[:, None, :]
        per_head = tl.sum(acc, axis=2)  # [GROUP_PAD, BLOCK_N]
        real_head = (offs_g < GROUP)[:, None]
        if SUM_GROUP:
            reduced = tl.sum(tl.where(real_head, per_head, 0.0), axis=0)  # [BLOCK_N]
        else:
            reduced = tl.max(tl.where(real_head, per_head, float("-inf")), axis=0)

    reduced = tl.where(live_n, reduced, float("-inf"))
    out = out_ptr + batch.to(tl.int64) * stride_ob + kv_head.to(tl.int64) * stride_oh + offs_n * stride_on
    tl.store(out, reduced, mask=offs_n < max_blocks)


@triton.jit
def _quest_score_kernel(
    q_ptr, key_max_ptr, key_min_ptr, num_blocks_ptr, out_ptr,  # as in _quest_score_tile
    max_blocks, head_dim,
    stride_qb, stride_qh, stride_qd,
    stride_mb, stride_mh, stride_mn, stride_md,
    stride_ob, stride_oh, stride_on,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, SUM_GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_CHUNK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    # grid: (cdiv(NB_max, BLOCK_N), Hkv, B)
    _quest_score_tile(
        q_ptr, key_max_ptr, key_min_ptr, num_blocks_ptr, out_ptr, max_blocks, head_dim,
        stride_qb, stride_qh, stride_qd, stride_mb, stride_mh, stride_mn, stride_md,
        stride_ob, stride_oh, stride_on,
        GROUP, GROUP_PAD, SUM_GROUP, BLOCK_N, BLOCK_D, D_CHUNK,
    )


@triton.jit
def _quest_select_kernel(
    q_ptr, key_max_ptr, key_min_ptr, num_blocks_ptr, out_ptr,  # as in _quest_score_tile
    idx_out_ptr,  # [B, Hkv, K_out] int32 contiguous: selected block ids, ascending, then padding 0
    count_out_ptr,  # [B, Hkv] int32 contiguous
    arrivals_ptr,  # [B * Hkv] int32, zero on entry and re-armed to zero on exit
    max_blocks, head_dim,
    stride_qb, stride_qh, stride_qd,
    stride_mb, stride_mh, stride_mn, stride_md,
    stride_ob, stride_oh, stride_on,
    num_kv_heads, k, k_out, sink_blocks, recent_blocks,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, SUM_GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_CHUNK: tl.constexpr,
    ROW_BLOCK: tl.constexpr,  # next power of two >= NB_max: the select holds the row in registers
    RADIX_BITS: tl.constexpr, PAD_BLOCK: tl.constexpr,
):
    """Score + top-k in one launch: every program scores its tile; the last program of a
    (row, KV head) to finish (an acq_rel arrival counter) selects over the whole row."""
    _quest_score_tile(
        q_ptr, key_max_ptr, key_min_ptr, num_blocks_ptr, out_ptr, max_blocks, head_dim,
        stride_qb, stride_qh, stride_qd, stride_mb, stride_mh, stride_mn, stride_md,
        stride_ob, stride_oh, stride_on,
        GROUP, GROUP_PAD, SUM_GROUP, BLOCK_N, BLOCK_D, D_CHUNK,
    )
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    row = batch * num_kv_heads + kv_head
    tl.debug_barrier()  # every thread's score stores precede the arrival (release covers them)
    arrived = tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        num_blocks = tl.minimum(tl.maximum(tl.load(num_blocks_ptr + batch).to(tl.int32), 0), max_blocks)
        row_base = batch.to(tl.int64) * stride_ob + kv_head.to(tl.int64) * stride_oh
        offs = tl.arange(0, ROW_BLOCK)
        # .cg: read the other programs' scores from L2, never from a stale L1 line.
        keys, valid = _order_keys(out_ptr, row_base, offs, stride_on, num_blocks, sink_blocks, recent_blocks, num_blocks,
                                  True)
        _select_row(
            keys, valid, offs, k, k_out, row.to(tl.int64) * k_out, row, idx_out_ptr, count_out_ptr,
            RADIX_BITS, PAD_BLOCK,
        )
        tl.store(arrivals_ptr + row, 0)  # re-arm for the next launch (all arrivals are in)


@triton.jit
def _quest_update_one(
    key_max_ptr, key_min_ptr,  # [B, Hkv, NB_max, D], updated in place
    k,  # [BLOCK_D] fp32: the new key of one (row, KV head), lanes >= head_dim unused
    position,  # int64 scalar: its token position
    meta_base,  # int64 scalar: offset of (row, KV head) in the metadata
    max_blocks, head_dim, stride_mn, stride_md,
    BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Block position // BLOCK_SIZE becomes the running max / min with k (k itself for the
    first token of a block: stale contents are ignored)."""
    block = position // BLOCK_SIZE
    later = (position % BLOCK_SIZE) != 0
    # Out-of-range positions are the caller's error; they write nothing rather than stray memory.
    # (Scalar conditions become lane limits: the CPU interpreter mishandles scalar & tensor masks.)
    d_limit = tl.where(position >= 0, tl.where(block < max_blocks, head_dim, 0), 0)
    offs_d = tl.arange(0, BLOCK_D)
    live_d = offs_d < d_limit
    meta = meta_base + block * stride_mn + offs_d * stride_md
    keep = offs_d < tl.where(later, d_limit, 0)
    old_max = tl.load(key_max_ptr + meta, mask=keep, other=float("-inf")).to(tl.float32)
    old_min = tl.load(key_min_ptr + meta, mask=keep, other=float("inf")).to(tl.float32)
    # Stored in the metadata's dtype: max / min of keys held in that dtype are exact in it.
    tl.store(key_max_ptr + meta, tl.maximum(old_max, k), mask=live_d)
    tl.store(key_min_ptr + meta, tl.minimum(old_min, k), mask=live_d)


@triton.jit
def _quest_update_kernel(
    key_max_ptr,  # [B, Hkv, NB_max, D] updated in place
    key_min_ptr,  # [B, Hkv, NB_max, D] updated in place
    k_new_ptr,  # [B, Hkv, D] the key appended at positions[b]
    positions_ptr,  # [B] int32/int64 token position of k_new in each row
    max_blocks,  # NB_max
    head_dim,  # D
    stride_mb, stride_mh, stride_mn, stride_md,
    stride_kb, stride_kh, stride_kd,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (a power of two)
    BLOCK_D: tl.constexpr,  # next power of two >= D
):
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    position = tl.load(positions_ptr + batch).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    k = tl.load(
        k_new_ptr + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh + offs_d * stride_kd,
        mask=offs_d < head_dim,
        other=0.0,
    ).to(tl.float32)  # [BLOCK_D]
    meta_base = batch.to(tl.int64) * stride_mb + kv_head.to(tl.int64) * stride_mh
    _quest_update_one(key_max_ptr, key_min_ptr, k, position, meta_base, max_blocks, head_dim, stride_mn, stride_md,
                      BLOCK_SIZE, BLOCK_D)
