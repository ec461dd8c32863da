"""Triton kernels for block top-K selection by threshold (radix) select. Launcher with checks:
`prr.kernels.topk`.

One program per (batch row, KV head) (many per row: `prr.kernels.topk_split_jit`, which reuses
_order_keys and _select_row). Scores are mapped to an order-preserving uint32 image
(flip all bits of negatives, set the sign bit of non-negatives; -0.0 is first folded to +0.0 so
float ties stay integer ties). The k-th largest key T is found by a most-significant-first
radix search: each pass fixes RADIX_BITS bits of T with one counting reduction over the row
(2^RADIX_BITS - 1 candidate thresholds, their counts packed into one integer; 4 bits, for the
short candidate rows, count 16 thresholds as a vector). T lies between the row's smallest valid
key and its largest one below +inf (forced blocks; unless the +inf keys alone fill k), so it has
the bits above the highest bit where those two differ: the search
starts from them and only the passes over the lower digits run (none when all keys are equal;
the tiled kernel runs them all). Then every block with key > T is taken, plus the lowest-index
blocks with key == T up to k, and written in ascending block order (positions from one prefix
sum). That is exactly the set of
`prr.blocks.top_blocks`: scores compared first, ties towards the lower block index.

Blocks the caller forces (the first `sink` blocks, the last `recent` blocks of the context)
score +inf; blocks at or past num_blocks[b], and blocks scored -inf, are never taken.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_prologue


@triton.jit
def _order_keys(
    scores_ptr, row_base, offs, stride_n, num_blocks, sink_blocks, recent_blocks, load_bound,
    L2_ONLY: tl.constexpr
):
    """-> (keys uint32, valid bool) for block ids `offs` of one row: keys order like the scores
    (forced blocks as +inf); invalid blocks (past the context or scored -inf) get key 0, below
    every valid key (the key of -inf is 0x007FFFFF, of -FLT_MAX 0x00800000).
    load_bound: scores are read below it (the row's length N: the load need not wait for
    num_blocks, itself a load; or num_blocks, reading no more than the context).
    L2_ONLY: load with .cg (scores written by other programs of the same launch).
    (Always pass L2_ONLY: triton 3.6 fails on a defaulted constexpr of a nested call.)"""
    in_context = offs < num_blocks
    ptrs = scores_ptr + row_base + offs * stride_n
    if L2_ONLY:
        s = tl.load(ptrs, mask=offs < load_bound, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
    else:
        s = tl.load(ptrs, mask=offs < load_bound, other=float("-inf")).to(tl.float32)
    s = tl.where(in_context, s, float("-inf"))
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 == +0.0 as floats: give them one key
    forced = in_context & ((offs < sink_blocks) | (offs >= num_blocks - recent_blocks))
    s = tl.where(forced, float("inf"), s)
    valid = in_context & (s > float("-inf"))
    bits = s.to(tl.uint32, bitcast=True)
    sign = bits >> 31
    keys = tl.where(sign == 1, ~bits, bits | 0x80000000)
    keys = tl.where(valid, keys, tl.zeros_like(keys))
    return keys, valid


@triton.jit
def _count_at_least(keys, threshold, shift, RADIX_BITS: tl.constexpr):
    """How many keys are >= threshold | (j << shift), for j = 1 .. 2^RADIX_BITS - 1, packed:
    RADIX_BITS 1 -> int32 count of j=1; RADIX_BITS 2 -> int64 with 21-bit fields j=1,2,3.
    shift: a constant or a runtime value (the digits are built as uint32: 3 << 30 fits)."""
    one = tl.full([], 1, tl.uint32) << shift
    if RADIX_BITS == 1:
        packed = (keys >= (threshold | one)).to(tl.int32)
    else:
        ge1 = (keys >= (threshold | one)).to(tl.int64)
        ge2 = (keys >= (threshold | (one << 1))).to(tl.int64)
        ge3 = (keys >= (threshold | (one * 3))).to(tl.int64)
        packed = ge1 + (ge2 << 21) + (ge3 << 42)
    return tl.sum(packed, axis=0)


@triton.jit
def _next_threshold(threshold, counts, shift, k_eff, RADIX_BITS: tl.constexpr):
    """Fix the digit at `shift`: the largest j whose candidate still has >= k_eff keys above."""
    if RADIX_BITS == 1:
        digit = (counts >= k_eff).to(tl.uint32)
    else:
        field = (1 << 21) - 1
        n1 = counts & field
        n2 = (counts >> 21) & field
        n3 = counts >> 42
        digit = tl.where(n3 >= k_eff, 3, tl.where(n2 >= k_eff, 2, tl.where(n1 >= k_eff, 1, 0))).to(tl.uint32)
    return threshold | (digit << shift)


@triton.jit
def _sum_sum_min_max(n_a, m_a, lo_a, hi_a, n_b, m_b, lo_b, hi_b):
    return n_a + n_b, m_a + m_b, tl.minimum(lo_a, lo_b), tl.maximum(hi_a, hi_b)


@triton.jit
def _common_prefix(lo, hi, RADIX_BITS: tl.constexpr):
    """-> (threshold, top, passes) for a k-th largest key T known to lie in [lo, hi]: T shares
    every bit above the highest bit where lo and hi differ, so the search starts from those
    bits (threshold) and only the `passes` digit passes at shifts top, top - RADIX_BITS, ..., 0
    are left. lo == hi: T = lo, no pass at all."""
    diff = lo ^ hi
    # top = RADIX_BITS * floor(highest set bit of diff / RADIX_BITS), by binary search on the
    # scalar (no clz in the interpreter): steps 16, 8, ..., RADIX_BITS; shifts stay <= 31.
    top = tl.zeros([], dtype=tl.int32)
    for i in tl.static_range(5):
        if (16 >> i) >= RADIX_BITS:
            above = top + (16 >> i)
            top = tl.where((diff >> above.to(tl.uint32)) != 0, above, top)
    # lo with its digits from `top` down cleared (two shifts: top + RADIX_BITS may be 32)
    cleared = ((lo >> top.to(tl.uint32)) >> RADIX_BITS) << RADIX_BITS << top.to(tl.uint32)
    threshold = tl.where(diff == 0, lo, cleared)
    passes = tl.where(diff == 0, 0, top // RADIX_BITS + 1)
    return threshold, top, passes


@triton.jit
def _emit(keys, valid, offs, threshold, base_gt, base_eq, need_eq, out_row, idx_out_ptr, limit):
    """Write the taken blocks of one tile: key > T, or key == T among the first need_eq ties.
    base_gt / base_eq: taken '>' blocks and '==' ties in earlier tiles. -> this tile's totals."""
    gt = valid & (keys > threshold)
    eq = valid & (keys == threshold)
    packed = gt.to(tl.int64) + (eq.to(tl.int64) << 32)
    inclusive = tl.cumsum(packed, axis=0)
    before = inclusive - packed
    gt_before = (before & 0xFFFFFFFF).to(tl.int32) + base_gt
    eq_before = (before >> 32).to(tl.int32) + base_eq
    take = gt | (eq & (eq_before < need_eq))
    position = gt_before + tl.minimum(eq_before, need_eq)
    tl.store(idx_out_ptr + out_row + position, offs, mask=take & (position < limit))
    total = tl.sum(packed, axis=0)
    return (total & 0xFFFFFFFF).to(tl.int32), (total >> 32).to(tl.int32)


@triton.jit
def _pad_and_count(idx_out_ptr, count_out_ptr, out_row, count_index, k_eff, k_out, PAD_BLOCK: tl.constexpr):
    for start in range(0, k_out, PAD_BLOCK):
        offs = start + tl.arange(0, PAD_BLOCK)
        tl.store(idx_out_ptr + out_row + offs, tl.zeros_like(offs), mask=(offs >= k_eff) & (offs < k_out))
    tl.store(count_out_ptr + count_index, k_eff)


@triton.jit
def _kth_key(keys, valid, k, RADIX_BITS: tl.constexpr):
    """The k_eff-th largest valid key of a row held in registers (keys/valid from _order_keys),
    k_eff = min(k, valid keys): -> (T, k_eff); T is +inf's key when k_eff = 0 (no key is above it,
    and no tie is taken). Shared by `_select_row` and the multi-program path's candidate select."""
    # One reduction: valid keys, those of +inf (forced blocks), the smallest valid key lo and the
    # largest one below +inf hi. Valid keys are at most +inf's (NaN scores are invalid).
    INF_KEY: tl.constexpr = 0xFF800000
    finite = valid & (keys < INF_KEY)
    n_valid, n_inf, lo, hi = tl.reduce(
        (
            valid.to(tl.int32),
            (keys == INF_KEY).to(tl.int32),
            tl.where(valid, keys, 0xFFFFFFFF),
            tl.where(finite, keys, tl.zeros_like(keys)),
        ),
        0,
        _sum_sum_min_max,
    )
    k_eff = tl.minimum(n_valid, k)
    # T lies in [lo, hi] unless the +inf keys (always in the candidates once a block is forced)
    # fill k_eff: then T is +inf's key, no pass. That covers k_eff = 0 too: no key is above
    # +inf's and no tie is taken, so nothing is (as with the all-ones T of a full search).
    lo = tl.where(n_inf >= k_eff, INF_KEY, lo)
    hi = tl.where(n_inf >= k_eff, INF_KEY, hi)
    # Each pass costs a block-wide reduction's latency: run only the passes over the digits
    # where lo and hi differ (the higher bits of T are theirs), most significant first.
    threshold, top, passes = _common_prefix(lo, hi, RADIX_BITS)
    if RADIX_BITS == 4:
        # Short rows (the candidate filter's): all 15 candidate digits counted in one [N, 16]
        # reduction per pass.
        digits = tl.arange(0, 16)
        for p in range(0, passes):
            shift = (top - 4 * p).to(tl.uint32)
            candidates = threshold | (digits.to(tl.uint32) << shift)  # [16]
            counts = tl.sum((keys[:, None] >= candidates[None, :]).to(tl.int32), axis=0)  # [16]
            digit = tl.max(tl.where(counts >= k_eff, digits, 0), axis=0)
            threshold = threshold | (digit.to(tl.uint32) << shift)
    else:
        for p in range(0, passes):
            shift = (top - RADIX_BITS * p).to(tl.uint32)
            counts = _count_at_least(keys, threshold, shift, RADIX_BITS)
            threshold = _next_threshold(threshold, counts, shift, k_eff, RADIX_BITS)
    # threshold is now the k_eff-th largest valid key (+inf's when k_eff = 0: nothing taken)
    return threshold, k_eff


@triton.jit
def _select_row(
    keys, valid, offs, k, k_out, out_row, count_index, idx_out_ptr, count_out_ptr,
    RADIX_BITS: tl.constexpr, PAD_BLOCK: tl.constexpr,
):
    """Top-k of one row held in registers (keys/valid from _order_keys, block ids offs):
    writes idx_out[out_row : out_row + k_out] and count_out[count_index]; -> (the threshold key T,
    k_eff = min(k, valid keys))."""
    threshold, k_eff = _kth_key(keys, valid, k, RADIX_BITS)
    n_gt = tl.sum((keys > threshold).to(tl.int32), axis=0)  # invalid keys are 0 <= threshold
    _emit(keys, valid, offs, threshold, 0, 0, k_eff - n_gt, out_row, idx_out_ptr, k_out)
    _pad_and_count(idx_out_ptr, count_out_ptr, out_row, count_index, k_eff, k_out, PAD_BLOCK)
    return threshold, k_eff  # the k_eff-th largest key (kernels/hinted_topk_jit.py: the next step's hint)


@triton.jit
def _topk_row_kernel(
    scores_ptr,  # [B, Hkv, N] fp32 (fp16/bf16 are widened exactly)
    num_blocks_ptr,  # [B] int32/int64 blocks in each row's context
    idx_out_ptr,  # [B, Hkv, K_out] int32, K_out = min(k, N), contiguous
    count_out_ptr,  # [B, Hkv] int32, contiguous
    num_cols,  # N
    num_kv_heads,  # Hkv
    k,  # requested blocks
    k_out,  # K_out
    sink_blocks,
    recent_blocks,
    stride_sb, stride_sh, stride_sn,
    scratch_keys_ptr,  # [B * Hkv, CAP] int32 workspace (GROUPS > 0)
    scratch_ids_ptr,  # [B * Hkv, CAP] int32 workspace
    BLOCK: tl.constexpr,  # next power of two >= N: the whole row lives in registers
    RADIX_BITS: tl.constexpr,  # 1 or 2 bits of the threshold fixed per counting pass
    PAD_BLOCK: tl.constexpr,
    GROUPS: tl.constexpr,  # candidate filter over GROUPS groups of the row (0: off)
    CAP: tl.constexpr,  # candidates the filter keeps at most (a power of two)
    CAND_RADIX: tl.constexpr,  # 2 or 4 threshold bits per pass over the candidates
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    num_blocks = tl.minimum(tl.maximum(tl.load(num_blocks_ptr + batch).to(tl.int32), 0), num_cols)
    row_base = batch.to(tl.int64) * stride_sb + kv_head.to(tl.int64) * stride_sh
    out_row = (batch.to(tl.int64) * num_kv_heads + kv_head) * k_out

    offs = tl.arange(0, BLOCK)
    keys, valid = _order_keys(scores_ptr, row_base, offs, stride_sn, num_blocks, sink_blocks, recent_blocks, num_cols,
                               False)
    row = batch * num_kv_heads + kv_head
    if GROUPS == 0:
        _select_row(keys, valid, offs, k, k_out, out_row, row, idx_out_ptr, count_out_ptr, RADIX_BITS, PAD_BLOCK)
    else:
        # Candidate filter: each radix pass is a reduction over the whole row, so shrink the row
        # first. Every group that holds a valid key has its max >= the smallest such max,
        # `bound`: with >= k_eff non-empty groups, the top k_eff keys are all >= bound. Groups
        # are strided (block b in group b % GROUPS), so a context shorter than the row leaves
        # none empty. The keys >= bound (ascending block order kept) are compacted through a
        # per-row scratch of CAP entries and selected there; more than CAP: the full row.
        k_eff = tl.minimum(tl.sum(valid.to(tl.int32), axis=0), k)
        group_max = tl.max(tl.reshape(keys, [BLOCK // GROUPS, GROUPS]), axis=0)  # [GROUPS] (invalid keys are 0)
        nonempty = group_max > 0
        bound = tl.min(tl.where(nonempty, group_max, 0xFFFFFFFF), axis=0)
        bound = tl.where(tl.sum(nonempty.to(tl.int32), axis=0) >= k_eff, bound, 0)
        candidate = valid & (keys >= bound)
        n_candidates = tl.sum(candidate.to(tl.int32), axis=0)
        if n_candidates <= CAP:
            slot = tl.cumsum(candidate.to(tl.int32), axis=0) - 1
            scratch = row.to(tl.int64) * CAP
            tl.store(scratch_keys_ptr + scratch + slot, keys.to(tl.int32, bitcast=True), mask=candidate)
            tl.store(scratch_ids_ptr + scratch + slot, offs, mask=candidate)
            tl.debug_barrier()  # the program's own stores, read back by other threads
            lane = tl.arange(0, CAP)
            live = lane < n_candidates
            c_keys = tl.load(scratch_keys_ptr + scratch + lane, mask=live, other=0).to(tl.uint32, bitcast=True)
            c_ids = tl.load(scratch_ids_ptr + scratch + lane, mask=live, other=0)
            _select_row(c_keys, live, c_ids, k, k_out, out_row, row, idx_out_ptr, count_out_ptr, CAND_RADIX, PAD_BLOCK)
        else:
            _select_row(keys, valid, offs, k, k_out, out_row, row, idx_out_ptr, count_out_ptr, RADIX_BITS, PAD_BLOCK)


@triton.jit
def _topk_tiled_kernel(
    scores_ptr,  # [B, Hkv, N] fp32 (fp16/bf16 are widened exactly)
    num_blocks_ptr,  # [B] int32/int64
    idx_out_ptr,  # [B, Hkv, K_out] int32 contiguous
    count_out_ptr,  # [B, Hkv] int32 contiguous
    num_cols,  # N
    num_kv_heads,
    k,
    k_out,
    sink_blocks,
    recent_blocks,
    stride_sb, stride_sh, stride_sn,
    TILE: tl.constexpr,  # the row is re-read in tiles of TILE blocks each pass (from L2)
    RADIX_BITS: tl.constexpr,
    PAD_BLOCK: tl.constexpr,
):
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    num_blocks = tl.minimum(tl.maximum(tl.load(num_blocks_ptr + batch).to(tl.int32), 0), num_cols)
    row_base = batch.to(tl.int64) * stride_sb + kv_head.to(tl.int64) * stride_sh
    out_row = (batch.to(tl.int64) * num_kv_heads + kv_head) * k_out
    lane = tl.arange(0, TILE)

    n_valid = tl.zeros([], dtype=tl.int32)
    for start in range(0, num_blocks, TILE):
        keys, valid = _order_keys(scores_ptr, row_base, start + lane, stride_sn, num_blocks, sink_blocks, recent_blocks, num_blocks,
                                    False)
        n_valid += tl.sum(valid.to(tl.int32), axis=0)
    k_eff = tl.minimum(n_valid, k)

    threshold = tl.zeros([], dtype=tl.uint32)
    for p in tl.static_range(32 // RADIX_BITS):
        shift = 32 - RADIX_BITS * (p + 1)
        if RADIX_BITS == 1:
            counts = tl.zeros([], dtype=tl.int32)
        else:
            counts = tl.zeros([], dtype=tl.int64)
        for start in range(0, num_blocks, TILE):
            keys, valid = _order_keys(
                scores_ptr, row_base, start + lane, stride_sn, num_blocks, sink_blocks, recent_blocks, num_blocks, False
            )
            counts += _count_at_least(keys, threshold, shift, RADIX_BITS)
        threshold = _next_threshold(threshold, counts, shift, k_eff, RADIX_BITS)

    n_gt = tl.zeros([], dtype=tl.int32)
    for start in range(0, num_blocks, TILE):
        keys, valid = _order_keys(scores_ptr, row_base, start + lane, stride_sn, num_blocks, sink_blocks, recent_blocks, num_blocks,
                                    False)
        n_gt += tl.sum((keys > threshold).to(tl.int32), axis=0)
    need_eq = k_eff - n_gt
    base_gt = tl.zeros([], dtype=tl.int32)
    base_eq = tl.zeros([], dtype=tl.int32)
    for start in range(0, num_blocks, TILE):
        offs = start + lane
        keys, valid = _order_keys(scores_ptr, row_base, offs, stride_sn, num_blocks, sink_blocks, recent_blocks, num_blocks,
                                  False)
        tile_gt, tile_eq = _emit(keys, valid, offs, threshold, base_gt, base_eq, need_eq, out_row, idx_out_ptr, k_out)
        base_gt += tile_gt
        base_eq += tile_eq
    _pad_and_count(idx_out_ptr, count_out_ptr, out_row, batch * num_kv_heads + kv_head, k_eff, k_out, PAD_BLOCK)
