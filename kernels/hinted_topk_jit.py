"""Triton kernels for hinted exact block top-K (a threshold guess per row, e.g. the previous decode
step's k-th score; the idea of GVR, arXiv 2604.22312). Launcher with checks:
`prr.kernels.hinted_topk`; torch reference: `prr.kernels.reference_hinted_topk`.

Keys are `prr.kernels.topk_jit`'s order-preserving uint32 images of the scores (forced blocks
+inf, blocks past the context and -inf scores invalid, key 0). Per (row, KV head) the program
keeps a bracket [a, b) of keys holding the k_eff-th largest valid key T (k_eff = min(k, valid
blocks)): at least k_eff keys are >= a (c_a of them) and fewer than k_eff are >= b. It starts as
[1, +inf's key + 1) (every valid key is >= 1), c_a the context's blocks (the valid ones once
round 0 has counted them). While c_a exceeds the candidate buffer (CAP), a round counts the keys
at or above 8 thresholds inside the bracket in one pass over the keys (two reductions of an int64
of four 16-bit counts; round 0 counts the valid keys in the same pass; the thresholds are scalar
arithmetic) and moves a up to the highest threshold still holding k_eff keys, b down to the
lowest one that does not. Round 0 places its thresholds around the hint (key offsets 0, ±2^14,
±2^17, ±2^20 and -2^23: about ±0.2 %, ±1.6 %, ±12.5 % of the score and half of it), later rounds
cut the bracket into 8 equal parts. Once c_a <= CAP, the valid keys >= a are compacted, in
ascending block order, into a per-row scratch and the row kernel's exact radix select
(`_select_row`) runs over those candidates only, their keys >= b lowered to b (all are > T and
taken either way; the select's passes then cover the bits where a and b differ only). A good hint thus costs one counting pass, one
compaction and a select over about k keys, where `topk_select` runs up to 16 counting passes over
the row (the tiled kernels: re-reading it each time).

Why it is exact, whatever the hint: every threshold of a round lies in [a, b), so the bracket
invariant holds and T >= a; the candidates (all valid keys >= a) then hold every key > T and every
key == T, in block order, so their top-k (keys first, ties to the lower block id) is the row's.
The hint only places round 0's thresholds: a hint of ±inf, far off, or NaN (read as -inf) costs
rounds, never exactness. When ROUNDS rounds leave more than CAP candidates, the row kernel falls
back to the plain radix select over the whole row in registers; the tiled kernel (rows longer
than a register row) keeps narrowing (8x a round: the bracket is one key after at most 12
rounds) and then emits the blocks > T and the first ties == T straight from the row.

Each program writes the k_eff-th largest score (-inf when nothing is selectable), the next decode
step's hint, in place of its hint or into a separate buffer. `path` (optional) records the rounds
run before the candidates fit (-1: they never did: the full-row fallback).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_prologue
from .topk_jit import _emit, _order_keys, _pad_and_count, _select_row


@triton.jit
def _score_key(score):
    """fp32 scalar -> its uint32 order key, as `_order_keys` keys scores (NaN read as -inf)."""
    score = tl.where(score == score, score, float("-inf"))
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 and +0.0: one key
    bits = score.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) == 1, ~bits, bits | 0x80000000)


@triton.jit
def _key_score(key):
    """uint32 order key -> the fp32 score it is the key of (the inverse of `_score_key`)."""
    bits = tl.where((key >> 31) == 1, key ^ 0x80000000, ~key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _sum_pair(x_a, y_a, x_b, y_b):
    return x_a + x_b, y_a + y_b


@triton.jit
def _threshold(j: tl.constexpr, a, b, hint_key, AROUND_HINT: tl.constexpr):
    """Threshold j (0..7, ascending in j) of a round inside the bracket [a, b) (int64 scalars,
    a < b): AROUND_HINT (round 0), the hint's key (int64) offset by -2^23, -2^20, -2^17, -2^14, 0,
    2^14, 2^17, 2^20 keys, clamped into the bracket; else a + j (b - a) / 8. Scalar arithmetic only."""
    if AROUND_HINT:
        if j < 4:
            offset: tl.constexpr = -(1 << (23 - 3 * j))
        elif j == 4:
            offset: tl.constexpr = 0
        else:
            offset: tl.constexpr = 1 << (14 + 3 * (j - 5))
        threshold = tl.minimum(tl.maximum(hint_key + offset, a), b - 1)
    else:
        threshold = a + ((b - a) * j) // 8
    return threshold


@triton.jit
def _widen(packed):
    """Two 16-bit counts (bits 0-15, 16-31 of an int64) -> the same in 32-bit fields."""
    return (packed & 0xFFFF) | (((packed >> 16) & 0xFFFF) << 32)


@triton.jit
def _count_round(keys, a, b, hint_key, AROUND_HINT: tl.constexpr):
    """keys: [T] uint32 (T < 65536; invalid keys 0, below every threshold) -> (valid keys, round 0
    only, else 0; then how many keys are >= each of the round's 8 thresholds (`_threshold`), as
    four int64 scalars of two 32-bit counts each: thresholds 0-1, 2-3, 4-5, 6-7), from two
    reductions of one int64 of four 16-bit counts each (one int64 per key at a time: two would
    spill registers at 8192 keys and 8 warps)."""
    low = tl.zeros(keys.shape, dtype=tl.int64)
    for i in tl.static_range(4):
        low += (keys >= _threshold(i, a, b, hint_key, AROUND_HINT).to(tl.uint32)).to(tl.int64) << (16 * i)
    if AROUND_HINT:  # the row's valid keys, counted in the same pass
        low, n_valid = tl.reduce((low, (keys > 0).to(tl.int32)), 0, _sum_pair)
    else:
        low = tl.sum(low, axis=0)
        n_valid = tl.zeros([], dtype=tl.int32)
    high = tl.zeros(keys.shape, dtype=tl.int64)
    for i in tl.static_range(4):
        high += (keys >= _threshold(i + 4, a, b, hint_key, AROUND_HINT).to(tl.uint32)).to(tl.int64) << (16 * i)
    high = tl.sum(high, axis=0)
    return n_valid, _widen(low), _widen(low >> 32), _widen(high), _widen(high >> 32)


@triton.jit
def _count_of(j: tl.constexpr, c01, c23, c45, c67):
    """Count j (0..7) of `_count_round`'s packed scalars, int32."""
    if j // 2 == 0:
        packed = c01
    elif j // 2 == 1:
        packed = c23
    elif j // 2 == 2:
        packed = c45
    else:
        packed = c67
    return ((packed >> (32 * (j % 2))) & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _narrow(c01, c23, c45, c67, a, count_a, b, hint_key, k_eff, AROUND_HINT: tl.constexpr):
    """One round's bracket update from its counts (non-increasing in j): -> (a, count_a, b), a the
    highest threshold with >= k_eff keys at or above it, b the lowest with fewer (each unchanged
    where there is none). Scalar arithmetic only."""
    new_a = a
    new_count_a = count_a
    new_b = b
    for j in tl.static_range(8):  # ascending: the last threshold with enough keys stays
        enough = _count_of(j, c01, c23, c45, c67) >= k_eff
        new_a = tl.where(enough, _threshold(j, a, b, hint_key, AROUND_HINT), new_a)
        new_count_a = tl.where(enough, _count_of(j, c01, c23, c45, c67), new_count_a)
    for i in tl.static_range(8):  # descending: the first threshold without enough keys stays
        short = _count_of(7 - i, c01, c23, c45, c67) < k_eff
        new_b = tl.where(short, _threshold(7 - i, a, b, hint_key, AROUND_HINT), new_b)
    return new_a, new_count_a, new_b


@triton.jit
def _select_candidates(keys, valid, offs, a, base, scratch, scratch_keys_ptr, scratch_ids_ptr):
    """Compact one tile's valid keys >= a (int64) and their block ids, in block order, into the
    row's scratch from position base on. -> candidates written."""
    candidate = valid & (keys >= a.to(tl.uint32))
    as_int = candidate.to(tl.int32)
    slot = base + tl.cumsum(as_int, axis=0) - 1
    tl.store(scratch_keys_ptr + scratch + slot, keys.to(tl.int32, bitcast=True), mask=candidate)
    tl.store(scratch_ids_ptr + scratch + slot, offs, mask=candidate)
    return tl.sum(as_int, axis=0)


@triton.jit
def _finish_row(next_hint_ptr, path_ptr, row, threshold, k_eff, rounds, WRITE_PATH: tl.constexpr):
    """The next step's hint (the k_eff-th largest score; -inf when nothing is selectable) and the
    rounds run (path)."""
    tl.store(next_hint_ptr + row, tl.where(k_eff > 0, _key_score(threshold), float("-inf")))
    if WRITE_PATH:
        tl.store(path_ptr + row, rounds)


@triton.jit
def _hinted_topk_row_kernel(
    scores_ptr,  # [B, Hkv, N] fp32 (fp16/bf16 are widened exactly)
    num_blocks_ptr,  # [B] int32/int64 blocks in each row's context
    hint_ptr,  # [B * Hkv] fp32: the threshold guess
    next_hint_ptr,  # [B * Hkv] fp32 out: this selection's k-th score (may be hint_ptr: read before written)
    idx_out_ptr,  # [B, Hkv, K_out] int32, K_out = min(k, N), contiguous
    count_out_ptr,  # [B, Hkv] int32, contiguous
    path_ptr,  # [B * Hkv] int32 out (WRITE_PATH): rounds run, -1 for the full-row fallback
    num_cols,  # N
    num_kv_heads,  # Hkv
    k,
    k_out,
    sink_blocks,
    recent_blocks,
    stride_sb, stride_sh, stride_sn,
    scratch_keys_ptr,  # [B * Hkv, CAP] int32 workspace
    scratch_ids_ptr,  # [B * Hkv, CAP] int32 workspace
    BLOCK: tl.constexpr,  # next power of two >= N: the whole row lives in registers
    CAP: tl.constexpr,  # candidate buffer (a power of two <= BLOCK)
    ROUNDS: tl.constexpr,  # bracket rounds before the full-row fallback
    RADIX_BITS: tl.constexpr,  # the fallback's bits per pass (1 or 2)
    CAND_RADIX: tl.constexpr,  # bits per pass over the candidates (2 or 4)
    PAD_BLOCK: tl.constexpr,
    WRITE_PATH: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    num_blocks = tl.minimum(tl.maximum(tl.load(num_blocks_ptr + batch).to(tl.int32), 0), num_cols)
    row_base = batch.to(tl.int64) * stride_sb + kv_head.to(tl.int64) * stride_sh
    row = batch * num_kv_heads + kv_head
    out_row = row.to(tl.int64) * k_out

    offs = tl.arange(0, BLOCK)
    keys, valid = _order_keys(scores_ptr, row_base, offs, stride_sn, num_blocks, sink_blocks, recent_blocks, num_cols,
                              False)
    hint_key = _score_key(tl.load(hint_ptr + row).to(tl.float32)).to(tl.int64)
    a = tl.full([], 1, tl.int64)  # bracket [a, b) of the k_eff-th largest key: valid keys are >= 1
    b = tl.full([], 0xFF800001, tl.int64)  # +inf's key + 1
    count_a = num_blocks  # keys >= a: the valid blocks, at most num_blocks until round 0 counts them
    k_eff = tl.minimum(num_blocks, k)  # min(k, valid blocks) from round 0 on
    rounds = tl.zeros([], dtype=tl.int32)
    for r in tl.static_range(ROUNDS):
        if count_a > CAP:
            n_valid, c01, c23, c45, c67 = _count_round(keys, a, b, hint_key, r == 0)
            if r == 0:
                count_a = n_valid
                k_eff = tl.minimum(n_valid, k)
            a, count_a, b = _narrow(c01, c23, c45, c67, a, count_a, b, hint_key, k_eff, r == 0)
            rounds += 1
    threshold = tl.zeros([], dtype=tl.uint32)
    if count_a <= CAP:
        scratch = row.to(tl.int64) * CAP
        n_candidates = _select_candidates(keys, valid, offs, a, 0, scratch, scratch_keys_ptr, scratch_ids_ptr)
        tl.debug_barrier()  # the program's own stores, read back by other threads
        lane = tl.arange(0, CAP)
        live = lane < n_candidates
        c_keys = tl.load(scratch_keys_ptr + scratch + lane, mask=live, other=0).to(tl.uint32, bitcast=True)
        c_keys = tl.minimum(c_keys, b.to(tl.uint32))  # keys >= b are all > T: as b, the select's passes span [a, b]
        c_ids = tl.load(scratch_ids_ptr + scratch + lane, mask=live, other=0)
        threshold, k_eff = _select_row(c_keys, live, c_ids, k, k_out, out_row, row, idx_out_ptr, count_out_ptr,
                                       CAND_RADIX, PAD_BLOCK)
    else:
        threshold, k_eff = _select_row(keys, valid, offs, k, k_out, out_row, row, idx_out_ptr, count_out_ptr,
                                       RADIX_BITS, PAD_BLOCK)
        rounds = tl.full([], -1, tl.int32)
    _finish_row(next_hint_ptr, path_ptr, row, threshold, k_eff, rounds, WRITE_PATH)


@triton.jit
def _hinted_topk_tiled_kernel(
    scores_ptr,  # [B, Hkv, N] fp32 (fp16/bf16 are widened exactly)
    num_blocks_ptr,  # [B] int32/int64
    hint_ptr,  # [B * Hkv] fp32, as the row kernel's
    next_hint_ptr,  # [B * Hkv] fp32 out
    idx_out_ptr,  # [B, Hkv, K_out] int32 contiguous
    count_out_ptr,  # [B, Hkv] int32 contiguous
    path_ptr,  # [B * Hkv] int32 out (WRITE_PATH)
    num_cols,  # N
    num_kv_heads,
    k,
    k_out,
    sink_blocks,
    recent_blocks,
    stride_sb, stride_sh, stride_sn,
    scratch_keys_ptr,  # [B * Hkv, CAP] int32 workspace
    scratch_ids_ptr,  # [B * Hkv, CAP] int32 workspace
    TILE: tl.constexpr,  # the row is re-read in tiles of TILE blocks each round (from L2)
    CAP: tl.constexpr,  # candidate buffer (a power of two, at most a register row)
    CAND_RADIX: tl.constexpr,
    PAD_BLOCK: tl.constexpr,
    WRITE_PATH: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    num_blocks = tl.minimum(tl.maximum(tl.load(num_blocks_ptr + batch).to(tl.int32), 0), num_cols)
    row_base = batch.to(tl.int64) * stride_sb + kv_head.to(tl.int64) * stride_sh
    row = batch * num_kv_heads + kv_head
    out_row = row.to(tl.int64) * k_out
    lane = tl.arange(0, TILE)

    hint_key = _score_key(tl.load(hint_ptr + row).to(tl.float32)).to(tl.int64)
    a = tl.full([], 1, tl.int64)
    b = tl.full([], 0xFF800001, tl.int64)
    count_a = num_blocks
    k_eff = tl.minimum(num_blocks, k)
    rounds = tl.zeros([], dtype=tl.int32)
    # Round 0 may not shrink the bracket (a hint far outside it); each later round leaves at most
    # ceil(width / 8) of it: < 2^32 keys are one key after 11 of them.
    for r in tl.static_range(12):
        if (count_a > CAP) & (b - a > 1):
            n_valid = tl.zeros([], dtype=tl.int32)
            c01 = tl.zeros([], dtype=tl.int64)  # 32-bit count fields: a row has < 2^21 blocks
            c23 = tl.zeros([], dtype=tl.int64)
            c45 = tl.zeros([], dtype=tl.int64)
            c67 = tl.zeros([], dtype=tl.int64)
            for start in range(0, num_blocks, TILE):
                keys, valid = _order_keys(scores_ptr, row_base, start + lane, stride_sn, num_blocks, sink_blocks,
                                          recent_blocks, num_blocks, False)
                t_valid, t01, t23, t45, t67 = _count_round(keys, a, b, hint_key, r == 0)
                n_valid += t_valid
                c01 += t01
                c23 += t23
                c45 += t45
                c67 += t67
            if r == 0:
                count_a = n_valid
                k_eff = tl.minimum(n_valid, k)
            a, count_a, b = _narrow(c01, c23, c45, c67, a, count_a, b, hint_key, k_eff, r == 0)
            rounds += 1
    threshold = tl.zeros([], dtype=tl.uint32)
    if count_a <= CAP:
        scratch = row.to(tl.int64) * CAP
        n_candidates = tl.zeros([], dtype=tl.int32)
        for start in range(0, num_blocks, TILE):
            keys, valid = _order_keys(scores_ptr, row_base, start + lane, stride_sn, num_blocks, sink_blocks,
                                      recent_blocks, num_blocks, False)
            n_candidates += _select_candidates(keys, valid, start + lane, a, n_candidates, scratch, scratch_keys_ptr,
                                               scratch_ids_ptr)
        tl.debug_barrier()
        c_lane = tl.arange(0, CAP)
        live = c_lane < n_candidates
        c_keys = tl.load(scratch_keys_ptr + scratch + c_lane, mask=live, other=0).to(tl.uint32, bitcast=True)
        c_keys = tl.minimum(c_keys, b.to(tl.uint32))  # as the row kernel's
        c_ids = tl.load(scratch_ids_ptr + scratch + c_lane, mask=live, other=0)
        threshold, k_eff = _select_row(c_keys, live, c_ids, k, k_out, out_row, row, idx_out_ptr, count_out_ptr,
                                       CAND_RADIX, PAD_BLOCK)
    else:
        # The bracket is one key: T = a (k_eff counted in round 0, which ran: count_a > CAP). Emit the keys > T, then the first ties, in block order.
        threshold = a.to(tl.uint32)
        n_gt = tl.zeros([], dtype=tl.int32)
        for start in range(0, num_blocks, TILE):
            keys, valid = _order_keys(scores_ptr, row_base, start + lane, stride_sn, num_blocks, sink_blocks,
                                      recent_blocks, num_blocks, False)
            n_gt += tl.sum((keys > threshold).to(tl.int32), axis=0)
        base_gt = tl.zeros([], dtype=tl.int32)
        base_eq = tl.zeros([], dtype=tl.int32)
        for start in range(0, num_blocks, TILE):
            keys, valid = _order_keys(scores_ptr, row_base, start + lane, stride_sn, num_blocks, sink_blocks,
                                      recent_blocks, num_blocks, False)
            tile_gt, tile_eq = _emit(keys, valid, start + lane, threshold, base_gt, base_eq, k_eff - n_gt, out_row,
                                     idx_out_ptr, k_out)
            base_gt += tile_gt
            base_eq += tile_eq
        _pad_and_count(idx_out_ptr, count_out_ptr, out_row, row, k_eff, k_out, PAD_BLOCK)
        rounds = tl.full([], -1, tl.int32)
    _finish_row(next_hint_ptr, path_ptr, row, threshold, k_eff, rounds, WRITE_PATH)
