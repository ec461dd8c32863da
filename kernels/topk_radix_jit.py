"""Triton kernels for exact block top-K over long rows with many programs per row: a multi-program
radix select. Launcher with checks: `prr.kernels.topk.topk_select` (rows longer than
MAX_ROW_BLOCK, or multi_program=True); the keys and the emit are `prr.kernels.topk_jit`'s
(`_order_keys`, `_kth_key`, `_emit`, `_pad_and_count`).

Keys are `_order_keys`' order-preserving uint32 images (forced blocks +inf; blocks past the
context and -inf scores invalid, key 0). The k_eff-th largest valid key T (k_eff = min(k, valid
blocks)) is found one 8-bit digit at a time, most significant first, by up to four level passes
(`_radix_level_kernel`, LEVEL = 1..4, one launch each, grid (chunks, Hkv, B): every program keys
one chunk of CHUNK blocks, TILE at a time). A row's state (`ST_*`, per (row, KV head)) says what its next level does:
- HIST: the keys of the bucket (the valid keys in [lo, hi]: those whose higher digits equal the
  T digits known so far; every valid key at level 1) are histogrammed over their next digit
  (tl.histogram, 256 bins, added to the row's histogram with atomics);
- COMPACT (the bucket holds at most CAP keys): the bucket's keys and block ids are appended to a
  per-row candidate buffer (one atomic per program for its slot), and each chunk stores how many
  of its keys lie above the bucket.
With a hint (kernels/hinted_topk.py), a round before level 1 (`_radix_hint_kernel`) counts the
keys at or above thresholds around it; when those at or above the best one fit the buffer, level 1
compacts them (bucket [a, all ones]) and the histogram levels do nothing.
The last program of a row to finish a level (a per-row arrival counter; its acq_rel atomic orders
the other programs' writes before its reads) resolves it: from a histogram, the digit of T is the
highest bin whose count from the top reaches the keys still needed; the row goes on to HIST or
COMPACT at the next level (after level 4, T is known to the bit: SERIAL). From the candidates, T
is their need-th largest key (`_kth_key`, in registers), and each chunk's counts of keys > T and
== T are completed with atomics (DONE). The emit (`_radix_emit_kernel`, one program per chunk)
then takes every key > T and the first ties == T, at positions from those per-chunk counts
(`_emit`: ascending block order). SERIAL rows (more than CAP keys share T's top 24 bits, i.e.
heavy ties) have no per-chunk counts: one program emits the whole row, tile by tile.

FINISH (level 1 only; topk_select's multi_program_finish=True, opt-in until timed on a GPU against
the launches above): the program that resolves a row's level 1 completes the row alone
(`_finish_row`): while the row is HIST, it histograms the bucket's next digit over the whole row,
TILE at a time, and resolves it as a level's last program would; once COMPACT, it gathers the
bucket into the candidate buffer (slots by a running count: no atomics) and finds T there; then it
emits the row in block order as a SERIAL row's emit does. The same helpers, states and digits as the
level passes and the emit, so the same T and output bit for bit, in 2 launches (a memset and level
1) instead of 6: one program's serial walks over the row (one per remaining level, at most 3, then
the emit's) in place of launches that, for a decode step's single row, mostly do nothing.

Why it is exact: every pass keeps the invariant "the keys above the bucket number `above` <
k_eff <= above + bucket keys" (the resolve picks the digit so), so T lies in the bucket and the
row's top k_eff are the keys above it plus the bucket's top (k_eff - above), ties to the lower
block id, as `_emit` takes them. Lanes past N are invalid (key 0). Programs that find their
row resolved (or at another level) do nothing, so the grid is static (CUDA graphs) and the host
never reads a count.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .hinted_topk_jit import _count_round, _key_score, _narrow, _score_key
from .pdl import pdl_prologue
from .topk_jit import _emit, _kth_key, _order_keys, _pad_and_count

# Per-(row, KV head) state, int32 fields of the workspace (zeroed by the launcher).
# (tl.constexpr: jit code reads module globals only as constexprs; the launcher reads their .value.)
ST_MODE = tl.constexpr(0)  # what the row's next level does (MODE_*)
ST_LEVEL = tl.constexpr(1)  # the level that does it (level 1: every row, HIST)
ST_LO = tl.constexpr(2)  # the bucket is the valid keys in [lo, hi] (uint32 bits; level 1's HIST: all)
ST_HI = tl.constexpr(3)
ST_BUCKET = tl.constexpr(4)  # valid keys in the bucket
ST_ABOVE = tl.constexpr(5)  # valid keys above it (> hi: all > T)
ST_K_EFF = tl.constexpr(6)  # min(k, valid blocks)
ST_T = tl.constexpr(7)  # the k_eff-th largest key (DONE, SERIAL), as int32 bits
ST_NEED_EQ = tl.constexpr(8)  # ties == T to take, the lowest block ids first
STATE = tl.constexpr(9)
MODE_HIST = tl.constexpr(0)
MODE_COMPACT = tl.constexpr(1)
MODE_DONE = tl.constexpr(2)
MODE_SERIAL = tl.constexpr(3)
LEVELS = tl.constexpr(4)  # 8-bit digits: tl.histogram's per-element cost grows with its bins
BINS = tl.constexpr(256)
ARRIVALS = tl.constexpr(5)  # arrival counters per row: the hint round (level 0) and levels 1..4
HINT_COUNTS = tl.constexpr(5)  # int64 per row of the hint round: valid keys, then 4 x 2 threshold counts


@triton.jit
def _in_bucket(keys, valid, lo, hi, LEVEL: tl.constexpr):
    """The valid keys in the row's bucket [lo, hi]. Level 1: HIST has lo = 0 (every valid key);
    COMPACT after a hint round, [lo, all ones]."""
    if LEVEL == 1:
        return valid & (keys >= lo)
    else:
        return valid & (keys >= lo) & (keys <= hi)


@triton.jit
def _bucket_tile_histogram(keys, in_bucket, LEVEL: tl.constexpr, TILE: tl.constexpr):
    """[BINS] int32: one tile's bucket keys (keys, in_bucket: [TILE]) counted by their digit LEVEL.
    Keys outside the bucket are counted in bin 0 and taken out again (no histogram mask: the GPU's
    triton may predate it)."""
    bins = tl.arange(0, BINS)
    digit = ((keys >> (32 - 8 * LEVEL)) & 0xFF).to(tl.int32)
    tile_h = tl.histogram(tl.where(in_bucket, digit, 0), BINS)  # [256]
    return tl.where(bins == 0, tile_h - (TILE - tl.sum(in_bucket.to(tl.int32), axis=0)), tile_h)


@triton.jit
def _store_candidates(cand_keys_ptr, cand_ids_ptr, first_slot, keys, offs, in_bucket):
    """Append one tile's bucket keys and block ids (keys, offs, in_bucket: [TILE]) to a row's
    candidate buffers from slot first_slot on, in tile order."""
    slot = first_slot + tl.cumsum(in_bucket.to(tl.int32), axis=0) - 1
    tl.store(cand_keys_ptr + slot, keys.to(tl.int32, bitcast=True), mask=in_bucket)
    tl.store(cand_ids_ptr + slot, offs, mask=in_bucket)


@triton.jit
def _resolve_histogram(h, state_ptr, k, CAP: tl.constexpr, LEVEL: tl.constexpr):
    """The last program of a row at a HIST level: the next digit of T from the row's histogram
    (h: [BINS] int32 counts of the bucket's keys by digit LEVEL), then the row's next mode
    (state_ptr: its ST_* fields)."""
    bins = tl.arange(0, BINS)
    if LEVEL == 1:
        k_eff = tl.minimum(tl.sum(h, axis=0), k)  # every valid key is counted at level 1
        above = tl.zeros([], dtype=tl.int32)
        lo = tl.zeros([], dtype=tl.uint32)
    else:
        k_eff = tl.load(state_ptr + ST_K_EFF)
        above = tl.load(state_ptr + ST_ABOVE)
        lo = tl.load(state_ptr + ST_LO).to(tl.uint32, bitcast=True)
    need = k_eff - above  # >= 1 here unless k_eff = 0 (level 1)
    at_or_above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # [256] keys with digit >= bin, non-increasing
    digit = tl.max(tl.where(at_or_above >= need, bins, 0), axis=0)
    bucket = tl.sum(tl.where(bins == digit, h, 0), axis=0)
    above += tl.sum(tl.where(bins > digit, h, 0), axis=0)
    SHIFT: tl.constexpr = 32 - 8 * LEVEL
    lo = lo | (digit.to(tl.uint32) << SHIFT)  # T's digits down to this level's, zeros below
    hi = lo | ((1 << SHIFT) - 1)
    if need <= 0:  # nothing selectable: no key is above the all-ones T and no tie is taken
        tl.store(state_ptr + ST_MODE, MODE_DONE)
        tl.store(state_ptr + ST_T, -1)
        tl.store(state_ptr + ST_NEED_EQ, 0)
    elif LEVEL == 4:  # all 32 bits: T, with more than CAP keys sharing its top 24 bits
        tl.store(state_ptr + ST_MODE, MODE_SERIAL)
        tl.store(state_ptr + ST_T, lo.to(tl.int32, bitcast=True))
        tl.store(state_ptr + ST_NEED_EQ, k_eff - above)
    else:
        tl.store(state_ptr + ST_MODE, tl.where(bucket <= CAP, MODE_COMPACT, MODE_HIST))
        tl.store(state_ptr + ST_LEVEL, LEVEL + 1)
    tl.store(state_ptr + ST_LO, lo.to(tl.int32, bitcast=True))
    tl.store(state_ptr + ST_HI, hi.to(tl.int32, bitcast=True))
    tl.store(state_ptr + ST_BUCKET, bucket)
    tl.store(state_ptr + ST_ABOVE, above)
    tl.store(state_ptr + ST_K_EFF, k_eff)


@triton.jit
def _threshold_among_candidates(
    state_ptr, cand_keys_ptr, cand_ids_ptr, gt_ptr, eq_ptr, bucket,
    CHUNK: tl.constexpr, LANES: tl.constexpr, RADIX_BITS: tl.constexpr, PER_CHUNK: tl.constexpr,
):
    """`_resolve_candidates` over LANES >= bucket lanes."""
    lane = tl.arange(0, LANES)
    live = lane < bucket
    keys = tl.load(cand_keys_ptr + lane, mask=live, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
    ids = tl.load(cand_ids_ptr + lane, mask=live, other=0, cache_modifier=".cg")
    need = tl.load(state_ptr + ST_K_EFF) - tl.load(state_ptr + ST_ABOVE)  # 1 .. bucket keys
    threshold, _ = _kth_key(keys, live, need, RADIX_BITS)
    greater = live & (keys > threshold)
    if PER_CHUNK:
        tl.atomic_add(gt_ptr + ids // CHUNK, 1, mask=greater, sem="relaxed")
        tl.atomic_add(eq_ptr + ids // CHUNK, 1, mask=live & (keys == threshold), sem="relaxed")
    tl.store(state_ptr + ST_T, threshold.to(tl.int32, bitcast=True))
    tl.store(state_ptr + ST_NEED_EQ, need - tl.sum(greater.to(tl.int32), axis=0))
    tl.store(state_ptr + ST_MODE, MODE_DONE)


@triton.jit
def _resolve_candidates(
    state_ptr, cand_keys_ptr, cand_ids_ptr, gt_ptr, eq_ptr,
    CHUNK: tl.constexpr, CAP: tl.constexpr, CAND_RADIX: tl.constexpr, PER_CHUNK: tl.constexpr,
):
    """The last program of a row at a COMPACT level: T among the bucket's keys (cand_*_ptr: the
    row's [CAP] int32 buffers, ST_BUCKET of them written, in no particular order), then (PER_CHUNK:
    for the emit's programs) each chunk's count of keys > T (gt_ptr: [chunks] int32, holding the keys
    above the bucket) and == T (eq_ptr).
    A bucket of at most 512 keys (the usual one: a digit past the first two leaves few) is selected
    over 512 lanes with 4-bit passes (topk.candidate_filter_shape's rule), not over all CAP lanes."""
    bucket = tl.load(state_ptr + ST_BUCKET)
    if CAP > 512:
        if bucket <= 512:
            _threshold_among_candidates(state_ptr, cand_keys_ptr, cand_ids_ptr, gt_ptr, eq_ptr, bucket, CHUNK, 512, 4,
                                        PER_CHUNK)
        else:
            _threshold_among_candidates(state_ptr, cand_keys_ptr, cand_ids_ptr, gt_ptr, eq_ptr, bucket, CHUNK, CAP,
                                        CAND_RADIX, PER_CHUNK)
    else:
        _threshold_among_candidates(state_ptr, cand_keys_ptr, cand_ids_ptr, gt_ptr, eq_ptr, bucket, CHUNK, CAP,
                                    CAND_RADIX, PER_CHUNK)


@triton.jit
def _emit_blocks(
    scores_ptr, row_base, first, last, stride_sn, num_blocks, sink_blocks, recent_blocks, num_cols,
    threshold, base_gt, base_eq, need_eq, out_row, idx_out_ptr, k_out, TILE: tl.constexpr,
):
    """Write the taken blocks among [first, last) of a row, TILE at a time (`_emit`: keys > T and the
    first need_eq ties == T, ascending block order); base_gt / base_eq: those taken before first."""
    for start in range(first, last, TILE):
        offs = start + tl.arange(0, TILE)
        keys, valid = _order_keys(scores_ptr, row_base, offs, stride_sn, num_blocks, sink_blocks, recent_blocks,
                                  num_cols, False)
        tile_gt, tile_eq = _emit(keys, valid, offs, threshold, base_gt, base_eq, need_eq, out_row, idx_out_ptr,
                                 k_out)
        base_gt += tile_gt
        base_eq += tile_eq


@triton.jit
def _write_row_outputs(
    idx_out_ptr, count_out_ptr, hint_out_ptr, path_ptr, state, out_row, row, k_eff, k_out, threshold, mode,
    PAD_BLOCK: tl.constexpr, WRITE_HINT: tl.constexpr, WRITE_PATH: tl.constexpr,
):
    """A resolved row's padding and count, and (WRITE_HINT) its k_eff-th largest score, (WRITE_PATH) how
    its threshold was found: the level whose candidates held T, -1 SERIAL, 0 nothing to select."""
    _pad_and_count(idx_out_ptr, count_out_ptr, out_row, row, k_eff, k_out, PAD_BLOCK)
    if WRITE_HINT:
        tl.store(hint_out_ptr + row, tl.where(k_eff > 0, _key_score(threshold), float("-inf")))
    if WRITE_PATH:
        level = tl.where(k_eff > 0, tl.load(state + ST_LEVEL), 0)
        tl.store(path_ptr + row, tl.where(mode == MODE_SERIAL, -1, level))


@triton.jit
def _finish_row(
    scores_ptr, num_blocks_ptr, batch, kv_head, num_cols, k, k_out, sink_blocks, recent_blocks,
    stride_sb, stride_sh, stride_sn,
    state, row, cand_keys_ptr, cand_ids_ptr, idx_out_ptr, count_out_ptr, hint_out_ptr, path_ptr,
    TILE: tl.constexpr, CAP: tl.constexpr, CAND_RADIX: tl.constexpr, PAD_BLOCK: tl.constexpr,
    WRITE_HINT: tl.constexpr, WRITE_PATH: tl.constexpr,
):
    """FINISH: the row's program that resolved level 1 completes the row alone, TILE blocks of its
    scores at a time: the histogram levels left (each over the whole row), the compaction of the
    bucket into the row's candidate buffer (cand_*_ptr: [CAP] int32, slots in block order) and T
    among it, then the emit in block order (as a SERIAL row's), the padding and the count. The same
    state transitions, digits and T as the level passes and the emit: the same output. (Scalar
    state fields are re-read after a barrier: each was stored by this program's threads.)"""
    num_blocks = tl.minimum(tl.maximum(tl.load(num_blocks_ptr + batch).to(tl.int32), 0), num_cols)
    row_base = batch.to(tl.int64) * stride_sb + kv_head.to(tl.int64) * stride_sh
    for level in tl.static_range(2, LEVELS + 1):
        tl.debug_barrier()
        mode = tl.load(state + ST_MODE, cache_modifier=".cg")
        if (mode == MODE_HIST) & (tl.load(state + ST_LEVEL, cache_modifier=".cg") == level):
            lo = tl.load(state + ST_LO, cache_modifier=".cg").to(tl.uint32, bitcast=True)
            hi = tl.load(state + ST_HI, cache_modifier=".cg").to(tl.uint32, bitcast=True)
            h = tl.zeros([BINS], dtype=tl.int32)
            for start in range(0, num_blocks, TILE):
                offs = start + tl.arange(0, TILE)
                keys, valid = _order_keys(scores_ptr, row_base, offs, stride_sn, num_blocks, sink_blocks,
                                          recent_blocks, num_cols, False)
                h += _bucket_tile_histogram(keys, _in_bucket(keys, valid, lo, hi, level), level, TILE)
            _resolve_histogram(h, state, k, CAP, level)
    tl.debug_barrier()
    if tl.load(state + ST_MODE, cache_modifier=".cg") == MODE_COMPACT:  # at level 2..4 ([lo, hi] buckets)
        lo = tl.load(state + ST_LO, cache_modifier=".cg").to(tl.uint32, bitcast=True)
        hi = tl.load(state + ST_HI, cache_modifier=".cg").to(tl.uint32, bitcast=True)
        taken = tl.zeros([], dtype=tl.int32)
        for start in range(0, num_blocks, TILE):
            offs = start + tl.arange(0, TILE)
            keys, valid = _order_keys(scores_ptr, row_base, offs, stride_sn, num_blocks, sink_blocks,
                                      recent_blocks, num_cols, False)
            in_bucket = _in_bucket(keys, valid, lo, hi, 2)
            _store_candidates(cand_keys_ptr, cand_ids_ptr, taken, keys, offs, in_bucket)
            taken += tl.sum(in_bucket.to(tl.int32), axis=0)
        tl.debug_barrier()  # the candidates, read back by every thread
        # no per-chunk counts (PER_CHUNK False): their pointers and CHUNK are unused placeholders
        _resolve_candidates(state, cand_keys_ptr, cand_ids_ptr, cand_keys_ptr, cand_ids_ptr, 1, CAP, CAND_RADIX,
                            False)
        tl.debug_barrier()
    mode = tl.load(state + ST_MODE, cache_modifier=".cg")  # DONE or SERIAL
    threshold = tl.load(state + ST_T, cache_modifier=".cg").to(tl.uint32, bitcast=True)
    need_eq = tl.load(state + ST_NEED_EQ, cache_modifier=".cg")
    k_eff = tl.load(state + ST_K_EFF, cache_modifier=".cg")
    out_row = row.to(tl.int64) * k_out
    zero = tl.zeros([], dtype=tl.int32)
    _emit_blocks(scores_ptr, row_base, 0, tl.where(k_eff > 0, num_blocks, 0), stride_sn, num_blocks, sink_blocks,
                 recent_blocks, num_cols, threshold, zero, zero, need_eq, out_row, idx_out_ptr, k_out, TILE)
    _write_row_outputs(idx_out_ptr, count_out_ptr, hint_out_ptr, path_ptr, state, out_row, row, k_eff, k_out,
                       threshold, mode, PAD_BLOCK, WRITE_HINT, WRITE_PATH)


@triton.jit
def _radix_level_kernel(
    scores_ptr,  # [B, Hkv, N] fp32 (fp16/bf16 are widened exactly)
    num_blocks_ptr,  # [B] int32/int64 blocks in each row's context
    num_cols,  # N
    num_kv_heads,  # Hkv
    num_chunks,  # C = cdiv(N, CHUNK)
    k,
    k_out,  # FINISH: K_out
    sink_blocks,
    recent_blocks,
    stride_sb, stride_sh, stride_sn,
    state_ptr,  # [B * Hkv, STATE] int32 (zeroed before level 1)
    hist_ptr,  # [B * Hkv, LEVELS, BINS] int32 (zeroed)
    arrivals_ptr,  # [B * Hkv, ARRIVALS] int32 (zeroed): programs of the row done with each level
    gt_ptr,  # [B * Hkv, C] int32 (zeroed): per chunk, keys > T once DONE
    eq_ptr,  # [B * Hkv, C] int32 (zeroed): per chunk, keys == T once DONE
    cand_count_ptr,  # [B * Hkv] int32 (zeroed): candidates appended
    cand_keys_ptr,  # [B * Hkv, CAP] int32 workspace
    cand_ids_ptr,  # [B * Hkv, CAP] int32 workspace
    idx_out_ptr,  # FINISH: [B, Hkv, K_out] int32 contiguous
    count_out_ptr,  # FINISH: [B, Hkv] int32 contiguous
    hint_out_ptr,  # FINISH and WRITE_HINT: [B * Hkv] fp32 out, as the emit's
    path_ptr,  # FINISH and WRITE_PATH: [B * Hkv] int32 out, as the emit's
    LEVEL: tl.constexpr,  # 1..4: this launch fixes digit LEVEL (bits 32 - 8 LEVEL .. 39 - 8 LEVEL) of T
    CHUNK: tl.constexpr,  # blocks per program (a power of two)
    TILE: tl.constexpr,  # blocks in registers at a time (a power of two dividing CHUNK)
    CAP: tl.constexpr,  # candidate buffer per row (a power of two)
    CAND_RADIX: tl.constexpr,  # bits per pass of the select over the candidates (2 or 4)
    FINISH: tl.constexpr,  # LEVEL 1 only: the row's last program completes the row alone (`_finish_row`)
    PAD_BLOCK: tl.constexpr,  # FINISH: as the emit's
    WRITE_HINT: tl.constexpr,  # FINISH: as the emit's
    WRITE_PATH: tl.constexpr,  # FINISH: as the emit's
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    chunk = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    row = batch * num_kv_heads + kv_head
    state = state_ptr + row * STATE
    mode = tl.load(state + ST_MODE)
    if LEVEL == 1:  # every row (state zeroed: HIST at "level 0"), or COMPACT after a hint round that fit
        active = (mode <= MODE_COMPACT) & (tl.load(state + ST_LEVEL) <= 1)
    else:
        active = (mode <= MODE_COMPACT) & (tl.load(state + ST_LEVEL) == LEVEL)
    if active:
        num_blocks = tl.minimum(tl.maximum(tl.load(num_blocks_ptr + batch).to(tl.int32), 0), num_cols)
        row_base = batch.to(tl.int64) * stride_sb + kv_head.to(tl.int64) * stride_sh
        lo = tl.load(state + ST_LO).to(tl.uint32, bitcast=True)
        hi = tl.load(state + ST_HI).to(tl.uint32, bitcast=True)
        if mode == MODE_HIST:
            bins = tl.arange(0, BINS)
            h = tl.zeros([BINS], dtype=tl.int32)
            for start in range(0, CHUNK, TILE):
                offs = chunk * CHUNK + start + tl.arange(0, TILE)  # [TILE] block ids; >= N: invalid
                keys, valid = _order_keys(scores_ptr, row_base, offs, stride_sn, num_blocks, sink_blocks,
                                          recent_blocks, num_cols, False)
                h += _bucket_tile_histogram(keys, _in_bucket(keys, valid, lo, hi, LEVEL), LEVEL, TILE)
            hist_row = hist_ptr + (row.to(tl.int64) * LEVELS + (LEVEL - 1)) * BINS
            tl.atomic_add(hist_row + bins, h, mask=h > 0, sem="relaxed")
        else:
            n_above = tl.zeros([], dtype=tl.int32)
            for start in range(0, CHUNK, TILE):
                offs = chunk * CHUNK + start + tl.arange(0, TILE)
                keys, valid = _order_keys(scores_ptr, row_base, offs, stride_sn, num_blocks, sink_blocks,
                                          recent_blocks, num_cols, False)
                in_bucket = _in_bucket(keys, valid, lo, hi, LEVEL)
                n_above += tl.sum((valid & (keys > hi)).to(tl.int32), axis=0)  # all > T
                base = tl.atomic_add(cand_count_ptr + row, tl.sum(in_bucket.to(tl.int32), axis=0), sem="relaxed")
                _store_candidates(cand_keys_ptr, cand_ids_ptr, row.to(tl.int64) * CAP + base, keys, offs, in_bucket)
            tl.store(gt_ptr + row.to(tl.int64) * num_chunks + chunk, n_above)
        tl.debug_barrier()  # every thread's writes precede the arrival (released by its acq_rel atomic)
        arrived = tl.atomic_add(arrivals_ptr + row * ARRIVALS + LEVEL, 1, sem="acq_rel")
        if arrived == num_chunks - 1:  # the row's last program: every other one's writes are visible
            tl.debug_barrier()
            if mode == MODE_HIST:
                hist_row = hist_ptr + (row.to(tl.int64) * LEVELS + (LEVEL - 1)) * BINS
                _resolve_histogram(tl.load(hist_row + tl.arange(0, BINS), cache_modifier=".cg"), state, k, CAP,
                                   LEVEL)
            else:
                counts = row.to(tl.int64) * num_chunks
                _resolve_candidates(state, cand_keys_ptr + row.to(tl.int64) * CAP, cand_ids_ptr + row.to(tl.int64) * CAP,
                                    gt_ptr + counts, eq_ptr + counts, CHUNK, CAP, CAND_RADIX, not FINISH)
            if FINISH:
                _finish_row(scores_ptr, num_blocks_ptr, batch, kv_head, num_cols, k, k_out, sink_blocks,
                            recent_blocks, stride_sb, stride_sh, stride_sn, state, row,
                            cand_keys_ptr + row.to(tl.int64) * CAP, cand_ids_ptr + row.to(tl.int64) * CAP,
                            idx_out_ptr, count_out_ptr, hint_out_ptr, path_ptr,
                            TILE, CAP, CAND_RADIX, PAD_BLOCK, WRITE_HINT, WRITE_PATH)
    else:
        if FINISH:
            if chunk == 0:  # a row the hint round left nothing to select (DONE): its outputs, as the emit's
                _finish_row(scores_ptr, num_blocks_ptr, batch, kv_head, num_cols, k, k_out, sink_blocks,
                            recent_blocks, stride_sb, stride_sh, stride_sn, state, row,
                            cand_keys_ptr + row.to(tl.int64) * CAP, cand_ids_ptr + row.to(tl.int64) * CAP,
                            idx_out_ptr, count_out_ptr, hint_out_ptr, path_ptr,
                            TILE, CAP, CAND_RADIX, PAD_BLOCK, WRITE_HINT, WRITE_PATH)


@triton.jit
def _radix_hint_kernel(
    scores_ptr,  # [B, Hkv, N] fp32 (fp16/bf16 are widened exactly)
    num_blocks_ptr,  # [B] int32/int64
    hint_ptr,  # [B * Hkv] fp32: a guess of each row's k-th largest score (any value)
    num_cols,  # N
    num_kv_heads,
    num_chunks,  # C
    k,
    sink_blocks,
    recent_blocks,
    stride_sb, stride_sh, stride_sn,
    state_ptr,  # [B * Hkv, STATE] int32 (zeroed)
    hint_counts_ptr,  # [B * Hkv, HINT_COUNTS] int64 (zeroed)
    arrivals_ptr,  # [B * Hkv, ARRIVALS] int32 (zeroed)
    CHUNK: tl.constexpr,
    TILE: tl.constexpr,  # < 65536 (the round's 16-bit partial counts), dividing CHUNK
    CAP: tl.constexpr,
    PDL: tl.constexpr,
):
    """The hint round before level 1 (kernels/hinted_topk.py, rows past its register row): every
    program counts its chunk's valid keys at or above 8 thresholds around the hint
    (hinted_topk_jit's `_count_round`, round 0), added up per row with atomics; the row's last
    program narrows the bracket (`_narrow`) to a, the highest threshold with >= k_eff keys at or above
    it. When those keys fit the buffer (<= CAP), level 1 compacts them (COMPACT, bucket [a, all ones])
    and selects T among them; else the row takes the histogram levels as without a hint. Exact either
    way: T >= a, so the keys >= a hold every key > T and every tie."""
    pdl_prologue(PDL)
    chunk = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    row = batch * num_kv_heads + kv_head
    num_blocks = tl.minimum(tl.maximum(tl.load(num_blocks_ptr + batch).to(tl.int32), 0), num_cols)
    row_base = batch.to(tl.int64) * stride_sb + kv_head.to(tl.int64) * stride_sh
    hint_key = _score_key(tl.load(hint_ptr + row).to(tl.float32)).to(tl.int64)
    a = tl.full([], 1, tl.int64)  # the bracket [a, b) before the round: every valid key
    b = tl.full([], 0xFF800001, tl.int64)  # +inf's key + 1
    n_valid = tl.zeros([], dtype=tl.int32)
    c01 = tl.zeros([], dtype=tl.int64)  # 32-bit count fields: a row has < 2^21 blocks, no carries
    c23 = tl.zeros([], dtype=tl.int64)
    c45 = tl.zeros([], dtype=tl.int64)
    c67 = tl.zeros([], dtype=tl.int64)
    for start in range(0, CHUNK, TILE):
        keys, valid = _order_keys(scores_ptr, row_base, chunk * CHUNK + start + tl.arange(0, TILE), stride_sn,
                                  num_blocks, sink_blocks, recent_blocks, num_cols, False)
        t_valid, t01, t23, t45, t67 = _count_round(keys, a, b, hint_key, True)
        n_valid += t_valid
        c01 += t01
        c23 += t23
        c45 += t45
        c67 += t67
    counts = hint_counts_ptr + row.to(tl.int64) * HINT_COUNTS
    tl.atomic_add(counts, n_valid.to(tl.int64), sem="relaxed")
    tl.atomic_add(counts + 1, c01, sem="relaxed")
    tl.atomic_add(counts + 2, c23, sem="relaxed")
    tl.atomic_add(counts + 3, c45, sem="relaxed")
    tl.atomic_add(counts + 4, c67, sem="relaxed")
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr + row * ARRIVALS, 1, sem="acq_rel")
    if arrived == num_chunks - 1:
        tl.debug_barrier()
        n_valid = tl.load(counts, cache_modifier=".cg").to(tl.int32)
        k_eff = tl.minimum(n_valid, k)
        a, count_a, b = _narrow(tl.load(counts + 1, cache_modifier=".cg"), tl.load(counts + 2, cache_modifier=".cg"),
                                tl.load(counts + 3, cache_modifier=".cg"), tl.load(counts + 4, cache_modifier=".cg"),
                                a, n_valid, b, hint_key, k_eff, True)
        state = state_ptr + row * STATE
        if k_eff == 0:  # nothing selectable: no key is above the all-ones T and no tie is taken
            tl.store(state + ST_MODE, MODE_DONE)
            tl.store(state + ST_T, -1)
            tl.store(state + ST_NEED_EQ, 0)
            tl.store(state + ST_K_EFF, 0)
        elif count_a <= CAP:
            tl.store(state + ST_MODE, MODE_COMPACT)
            tl.store(state + ST_LO, a.to(tl.uint32).to(tl.int32, bitcast=True))
            tl.store(state + ST_HI, -1)  # all ones: no key above the bucket
            tl.store(state + ST_BUCKET, count_a)
            tl.store(state + ST_K_EFF, k_eff)
        tl.store(state + ST_LEVEL, 1)  # (a row left HIST takes level 1 as without a hint)


@triton.jit
def _radix_emit_kernel(
    scores_ptr,  # [B, Hkv, N] fp32
    num_blocks_ptr,  # [B] int32/int64
    idx_out_ptr,  # [B, Hkv, K_out] int32 contiguous, K_out = min(k, N)
    count_out_ptr,  # [B, Hkv] int32 contiguous
    num_cols,  # N
    num_kv_heads,
    num_chunks,  # C
    k_out,
    sink_blocks,
    recent_blocks,
    stride_sb, stride_sh, stride_sn,
    state_ptr,  # [B * Hkv, STATE] int32 from the level passes (DONE or SERIAL)
    gt_ptr,  # [B * Hkv, C] int32: per chunk, keys > T (DONE)
    eq_ptr,  # [B * Hkv, C] int32: per chunk, keys == T (DONE)
    hint_out_ptr,  # [B * Hkv] fp32 out (WRITE_HINT): the k_eff-th largest score, -inf when none
    path_ptr,  # [B * Hkv] int32 out (WRITE_PATH): the level whose candidates held T, -1 SERIAL, 0 nothing to select
    CHUNK: tl.constexpr,
    TILE: tl.constexpr,  # blocks in registers at a time (dividing CHUNK)
    CHUNKS_BLOCK: tl.constexpr,  # next power of two >= C
    PAD_BLOCK: tl.constexpr,
    WRITE_HINT: tl.constexpr,  # hinted top-k's next hint (kernels/hinted_topk.py)
    WRITE_PATH: tl.constexpr,  # tests and benchmarks
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    chunk = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    row = batch * num_kv_heads + kv_head
    state = state_ptr + row * STATE
    num_blocks = tl.minimum(tl.maximum(tl.load(num_blocks_ptr + batch).to(tl.int32), 0), num_cols)
    row_base = batch.to(tl.int64) * stride_sb + kv_head.to(tl.int64) * stride_sh
    out_row = row.to(tl.int64) * k_out
    threshold = tl.load(state + ST_T).to(tl.uint32, bitcast=True)
    need_eq = tl.load(state + ST_NEED_EQ)
    k_eff = tl.load(state + ST_K_EFF)
    mode = tl.load(state + ST_MODE)
    if mode == MODE_DONE:
        # This chunk, with the blocks taken before it from the per-chunk counts of keys > T and == T.
        earlier = tl.arange(0, CHUNKS_BLOCK)
        counts = row.to(tl.int64) * num_chunks + earlier
        base_gt = tl.sum(tl.load(gt_ptr + counts, mask=earlier < chunk, other=0), axis=0)
        base_eq = tl.sum(tl.load(eq_ptr + counts, mask=earlier < chunk, other=0), axis=0)
        first = chunk * CHUNK
        last = first + CHUNK
    else:  # SERIAL: program 0 walks the whole context, counting as it goes
        base_gt = tl.zeros([], dtype=tl.int32)
        base_eq = tl.zeros([], dtype=tl.int32)
        first = 0
        last = tl.where(chunk == 0, num_blocks, 0)
    _emit_blocks(scores_ptr, row_base, first, last, stride_sn, num_blocks, sink_blocks, recent_blocks, num_cols,
                 threshold, base_gt, base_eq, need_eq, out_row, idx_out_ptr, k_out, TILE)
    if chunk == 0:
        _write_row_outputs(idx_out_ptr, count_out_ptr, hint_out_ptr, path_ptr, state, out_row, row, k_eff, k_out,
                           threshold, mode, PAD_BLOCK, WRITE_HINT, WRITE_PATH)
