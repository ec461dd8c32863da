"""Triton kernels of the predictors' propose and update (one program per (batch row, KV head),
rows walked in tiles of TILE blocks). Launchers with checks: `prr.kernels.predict`; torch
references: `prr.kernels.reference_predict`.

- `_ema_rank_kernel`: ema's rank (ema + β·last_selected + γ·recent, -inf outside the context),
  optionally mixed with the cross-layer part; feeds `topk_select` (the propose's second launch).
- `_ema_update_kernel`: standardise the selection scores over the finite entries, EMA them,
  write last_selected from the selection's block ids (and, for cross_layer, z and the mask).
- `_scatter_selected_kernel`: last_step's update (the selected blocks' scores, -inf elsewhere),
  ema_membership's update (α·s, then + (1-α) on the selected blocks), SPIN's exploit marks.
- `_spin_rank_kernel`, `_spin_update_kernel`: SPIN's max-pooled rank with its exploration
  draw, and its vertical / diagonal EMAs.
- `_qsim_rank_kernel`, `_qsim_similarity_kernel`, `_qsim_propose_kernel`, `_qsim_update_kernel`,
  `_qsim_counters_kernel`: query_similarity's rank (normalise the query, cosine against the ring
  buffer, the best neighbours' votes added at their listed ids, the recent window, the last
  z-scores), its propose in two launches (the cosines over C / SLOTS programs a KV head, then the
  neighbours' id lists in registers: their merged candidates' top-k, or every candidate and the
  fill list's first others; the whole row with topk_jit's `_select_row` only where neither holds
  P), its update (ring-buffer slot, last z, the selection as mask and id list; the counters in a
  one-program launch after it).

Writes of one program that its own threads read back are separated by `tl.debug_barrier()`
(a CTA barrier: the program's global writes before it are visible to its threads after it).
Row offsets are int64; block ids and counts int32. Constants are literals (no module globals).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_prologue
from .topk_jit import _pad_and_count, _select_row


@triton.jit
def _row_stats(scores_ptr, score_row, stride_sn, n, TILE: tl.constexpr):
    """-> (mean, std, finite count) of one row's finite scores: mean = Σx / max(n, 1), std =
    max(sqrt(Σ(x - mean)² / max(n, 1)), 1e-6) (two passes, as the torch reference)."""
    total = tl.zeros([], dtype=tl.float32)
    count = tl.zeros([], dtype=tl.int32)
    for start in range(0, n, TILE):
        offs = start + tl.arange(0, TILE)
        s = tl.load(scores_ptr + score_row + offs.to(tl.int64) * stride_sn, mask=offs < n, other=float("-inf"))
        s = s.to(tl.float32)
        finite = (s == s) & (tl.abs(s) < float("inf"))
        total += tl.sum(tl.where(finite, s, 0.0), axis=0)
        count += tl.sum(finite.to(tl.int32), axis=0)
    rows = tl.maximum(count, 1).to(tl.float32)
    mean = total / rows
    squares = tl.zeros([], dtype=tl.float32)
    for start in range(0, n, TILE):
        offs = start + tl.arange(0, TILE)
        s = tl.load(scores_ptr + score_row + offs.to(tl.int64) * stride_sn, mask=offs < n, other=float("-inf"))
        s = s.to(tl.float32)
        finite = (s == s) & (tl.abs(s) < float("inf"))
        dev = tl.where(finite, s - mean, 0.0)
        squares += tl.sum(dev * dev, axis=0)
    std = tl.maximum(tl.sqrt_rn(squares / rows), 1e-6)
    return mean, std, count


@triton.jit
def _zscore(s, mean, std):
    """-> (z, finite) of scores s: (s - mean) / std where finite, 0 elsewhere."""
    finite = (s == s) & (tl.abs(s) < float("inf"))
    return tl.where(finite, tl.div_rn(s - mean, std), 0.0), finite


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (products wrap mod 2^32, as the reference's mul32)."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _ema_rank_kernel(
    ema_ptr,  # [B, Hkv, N] fp32 contiguous (MIX != 1)
    sel_ptr,  # [B, Hkv, N] uint8 (bool) last_selected (MIX != 1)
    stick_ptr,  # [B / rows_per_param] fp32 β: one per layer (a layer's rows share it)
    rec_ptr,  # [B / rows_per_param] fp32 γ
    num_blocks_ptr,  # [rows_per_param] int32/int64 blocks in each row's context at the step proposed
    z_ptr,  # [B, Hkv, N] fp32 the source layer's z-scores (MIX != 0)
    zsel_ptr,  # [B, Hkv, N] uint8 the source layer's selection (MIX != 0)
    rank_ptr,  # [B, Hkv, N] fp32 out
    n, num_kv_heads, recent_blocks,
    rows_per_param,  # rows of one layer: B is layers x rows_per_param when several layers go in one launch
    source_stickiness, temporal_weight, cross_weight,  # fp32: s, w, 1 - w
    MIX: tl.constexpr,  # 0: ema's rank; 1: the cross-layer part alone; 2: (1 - w)·cross + w·ema's rank
    TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    nb = tl.load(num_blocks_ptr + batch % rows_per_param).to(tl.int32)
    row = (batch.to(tl.int64) * num_kv_heads + kv_head) * n
    stick = tl.load(stick_ptr + batch // rows_per_param)
    rec = tl.load(rec_ptr + batch // rows_per_param)
    for start in range(0, n, TILE):
        offs = start + tl.arange(0, TILE)
        live = offs < n
        inside = offs < nb
        if MIX != 1:
            e = tl.load(ema_ptr + row + offs, mask=live, other=0.0)
            s = tl.load(sel_ptr + row + offs, mask=live, other=0).to(tl.float32)
            recent = ((offs >= nb - recent_blocks) & inside).to(tl.float32)
            temporal = e + stick * s + rec * recent
        if MIX != 0:
            zs = tl.load(z_ptr + row + offs, mask=live, other=0.0)
            zsel = tl.load(zsel_ptr + row + offs, mask=live, other=0).to(tl.float32)
            cross = zs + source_stickiness * zsel
        if MIX == 0:
            score = temporal
        elif MIX == 1:
            score = cross
        else:
            score = cross_weight * cross + temporal_weight * tl.where(inside, temporal, float("-inf"))
        tl.store(rank_ptr + row + offs, tl.where(inside, score, float("-inf")), mask=live)


@triton.jit
def _ema_update_kernel(
    scores_ptr,  # [B, Hkv, N] fp32 selection scores (-inf outside the context), strided
    idx_ptr,  # [B, Hkv, C] int32/int64 selected block ids (entries >= count: padding), strided
    cnt_ptr,  # [B, Hkv] int32/int64, strided
    alpha_ptr,  # [B / rows_per_param] fp32 α: one per layer (a layer's rows share it)
    ema_ptr,  # [B, Hkv, N] fp32 contiguous, updated in place
    sel_ptr,  # [B, Hkv, N] uint8 contiguous: last_selected, rewritten
    z_ptr,  # [B, Hkv, N] fp32 contiguous: z-scores out (WRITE_Z)
    zsel_ptr,  # [B, Hkv, N] uint8 contiguous: the selection's mask out (WRITE_Z)
    n, num_kv_heads, capacity,
    rows_per_param,  # rows of one layer: B is layers x rows_per_param when several layers go in one launch
    stride_sb, stride_sh, stride_sn,
    stride_ib, stride_ih, stride_ic,
    stride_cb, stride_ch,
    WRITE_Z: tl.constexpr,
    TILE: tl.constexpr,
    IDX_TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    score_row = batch.to(tl.int64) * stride_sb + kv_head.to(tl.int64) * stride_sh
    row = (batch.to(tl.int64) * num_kv_heads + kv_head) * n
    mean, std, count = _row_stats(scores_ptr, score_row, stride_sn, n, TILE)
    alpha = tl.load(alpha_ptr + batch // rows_per_param)
    for start in range(0, n, TILE):
        offs = start + tl.arange(0, TILE)
        live = offs < n
        s = tl.load(scores_ptr + score_row + offs.to(tl.int64) * stride_sn, mask=live, other=float("-inf"))
        z, finite = _zscore(s.to(tl.float32), mean, std)
        e = tl.load(ema_ptr + row + offs, mask=live, other=0.0)
        tl.store(ema_ptr + row + offs, tl.where(finite, alpha * e + (1 - alpha) * z, e), mask=live)
        tl.store(sel_ptr + row + offs, tl.zeros([TILE], dtype=tl.uint8), mask=live)
        if WRITE_Z:
            tl.store(z_ptr + row + offs, z, mask=live)
            tl.store(zsel_ptr + row + offs, tl.zeros([TILE], dtype=tl.uint8), mask=live)
    tl.debug_barrier()  # the zeros land before the selected blocks' ones
    chosen = tl.load(cnt_ptr + batch.to(tl.int64) * stride_cb + kv_head.to(tl.int64) * stride_ch).to(tl.int32)
    idx_row = batch.to(tl.int64) * stride_ib + kv_head.to(tl.int64) * stride_ih
    for start in range(0, capacity, IDX_TILE):
        j = start + tl.arange(0, IDX_TILE)
        valid = (j < chosen) & (j < capacity)
        ids = tl.load(idx_ptr + idx_row + j.to(tl.int64) * stride_ic, mask=valid, other=0).to(tl.int32)
        valid = valid & (ids >= 0) & (ids < n)
        tl.store(sel_ptr + row + ids, tl.full([IDX_TILE], 1, tl.uint8), mask=valid)
        if WRITE_Z:
            tl.store(zsel_ptr + row + ids, tl.full([IDX_TILE], 1, tl.uint8), mask=valid)


@triton.jit
def _scatter_selected_kernel(
    row_ptr,  # [B, Hkv, N] fp32 contiguous, rewritten
    scores_ptr,  # [B, Hkv, N] fp32, strided (MODE 0)
    idx_ptr,  # [B, Hkv, C] int32/int64 block ids, strided
    cnt_ptr,  # [B, Hkv] int32/int64, strided
    n, num_kv_heads, capacity,
    scale, bonus,  # fp32 (MODE 1: α, 1 - α; MODE 2: -, the mark)
    stride_sb, stride_sh, stride_sn,
    stride_ib, stride_ih, stride_ic,
    stride_cb, stride_ch,
    MODE: tl.constexpr,  # 0: last_step (row = -inf, the selected blocks' scores); 1: membership EMA
                         # (row = α·row, + (1 - α) on the selected); 2: mark (row[selected] = bonus)
    TILE: tl.constexpr,
    IDX_TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    row = (batch.to(tl.int64) * num_kv_heads + kv_head) * n
    if MODE != 2:
        for start in range(0, n, TILE):
            offs = start + tl.arange(0, TILE)
            live = offs < n
            if MODE == 0:
                tl.store(row_ptr + row + offs, tl.full([TILE], float("-inf"), tl.float32), mask=live)
            else:
                r = tl.load(row_ptr + row + offs, mask=live, other=0.0)
                tl.store(row_ptr + row + offs, r * scale, mask=live)
        tl.debug_barrier()  # the whole row is written before the selected blocks are
    chosen = tl.load(cnt_ptr + batch.to(tl.int64) * stride_cb + kv_head.to(tl.int64) * stride_ch).to(tl.int32)
    idx_row = batch.to(tl.int64) * stride_ib + kv_head.to(tl.int64) * stride_ih
    score_row = batch.to(tl.int64) * stride_sb + kv_head.to(tl.int64) * stride_sh
    for start in range(0, capacity, IDX_TILE):
        j = start + tl.arange(0, IDX_TILE)
        valid = (j < chosen) & (j < capacity)
        ids = tl.load(idx_ptr + idx_row + j.to(tl.int64) * stride_ic, mask=valid, other=0).to(tl.int32)
        valid = valid & (ids >= 0) & (ids < n)
        if MODE == 0:
            s = tl.load(scores_ptr + score_row + ids.to(tl.int64) * stride_sn, mask=valid, other=0.0).to(tl.float32)
            s = tl.where(s == s, s, 0.0)  # NaN -> 0, ±inf -> ±1e30 (torch.nan_to_num's)
            s = tl.where(s == float("inf"), 1e30, tl.where(s == float("-inf"), -1e30, s))
            tl.store(row_ptr + row + ids, s, mask=valid)
        elif MODE == 1:
            r = tl.load(row_ptr + row + ids, mask=valid, other=0.0, cache_modifier=".cg")
            tl.store(row_ptr + row + ids, r + bonus, mask=valid)
        else:
            tl.store(row_ptr + row + ids, tl.full([IDX_TILE], 0.0, tl.float32) + bonus, mask=valid)


@triton.jit(do_not_specialize=["key"])
def _spin_rank_kernel(
    vertical_ptr,  # [B, Hkv, N] fp32 contiguous
    diagonal_ptr,  # [B, Hkv, N] fp32 contiguous, by distance from the newest block
    num_blocks_ptr,  # [B] int32/int64
    updates_ptr,  # [L] int64 selections each layer has seen (the draw's step key)
    rank_ptr,  # [B, Hkv, N] fp32 out
    draw_ptr,  # [B, Hkv, N] fp32 out: the exploration draw in [0, 1), -inf outside (DRAW)
    n, num_kv_heads,
    key,  # the host part of the draw's key, its 32 bits as an int32: the layer's (KEY_PER_LAYER
    # False), or the seed's, mixed here with each row's layer first_layer + row // rows_per_layer
    first_layer,
    rows_per_layer,  # rows (B) of one layer: row r reads counter r // rows_per_layer
    DRAW: tl.constexpr,
    KEY_PER_LAYER: tl.constexpr,
    TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    nb = tl.load(num_blocks_ptr + batch).to(tl.int32)
    row = (batch.to(tl.int64) * num_kv_heads + kv_head) * n
    if DRAW:
        layer = batch // rows_per_layer
        step = (tl.load(updates_ptr + layer) & 0xFFFFFFFF).to(tl.uint32)
        layer_key = key.to(tl.uint32, bitcast=True)
        if KEY_PER_LAYER:  # spin.draw_key: mix32(the seed's key ^ layer)
            layer_key = _mix32(layer_key ^ (first_layer + layer).to(tl.uint32))
        step_key = _mix32(layer_key ^ step)
    for start in range(0, n, TILE):
        offs = start + tl.arange(0, TILE)
        live = offs < n
        inside = offs < nb
        distance = tl.minimum(tl.maximum(nb - 1 - offs, 0), n - 1)
        v = tl.load(vertical_ptr + row + offs, mask=live, other=0.0)
        d = tl.load(diagonal_ptr + row + distance, mask=live, other=0.0)
        tl.store(rank_ptr + row + offs, tl.where(inside, tl.maximum(v, d), float("-inf")), mask=live)
        if DRAW:
            bits = _mix32(step_key ^ (kv_head * n + offs).to(tl.uint32))
            u = (bits >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2^-24
            tl.store(draw_ptr + row + offs, tl.where(inside, u, float("-inf")), mask=live)


@triton.jit
def _spin_update_kernel(
    scores_ptr,  # [B, Hkv, N] fp32 selection scores, strided
    idx_ptr,  # [B, Hkv, C] int32/int64, strided
    cnt_ptr,  # [B, Hkv] int32/int64, strided
    vertical_ptr,  # [B, Hkv, N] fp32 contiguous, updated in place
    diagonal_ptr,  # [B, Hkv, N] fp32 contiguous, updated in place
    member_ptr,  # [B, Hkv, N] uint8 scratch: the selection's mask
    updates_ptr,  # [L] int64: each layer's counter + 1
    n, num_kv_heads, capacity,
    rows_per_layer,  # rows (B) of one layer: row r's layer is r // rows_per_layer
    alpha_vertical, alpha_diagonal, selection_bonus,
    stride_sb, stride_sh, stride_sn,
    stride_ib, stride_ih, stride_ic,
    stride_cb, stride_ch,
    TILE: tl.constexpr,
    IDX_TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    score_row = batch.to(tl.int64) * stride_sb + kv_head.to(tl.int64) * stride_sh
    row = (batch.to(tl.int64) * num_kv_heads + kv_head) * n
    for start in range(0, n, TILE):
        offs = start + tl.arange(0, TILE)
        tl.store(member_ptr + row + offs, tl.zeros([TILE], dtype=tl.uint8), mask=offs < n)
    mean, std, count = _row_stats(scores_ptr, score_row, stride_sn, n, TILE)
    tl.debug_barrier()
    chosen = tl.load(cnt_ptr + batch.to(tl.int64) * stride_cb + kv_head.to(tl.int64) * stride_ch).to(tl.int32)
    idx_row = batch.to(tl.int64) * stride_ib + kv_head.to(tl.int64) * stride_ih
    for start in range(0, capacity, IDX_TILE):
        j = start + tl.arange(0, IDX_TILE)
        valid = (j < chosen) & (j < capacity)
        ids = tl.load(idx_ptr + idx_row + j.to(tl.int64) * stride_ic, mask=valid, other=0).to(tl.int32)
        valid = valid & (ids >= 0) & (ids < n)
        tl.store(member_ptr + row + ids, tl.full([IDX_TILE], 1, tl.uint8), mask=valid)
    tl.debug_barrier()  # the mask is complete before it is read (forward and reversed)
    for start in range(0, n, TILE):
        offs = start + tl.arange(0, TILE)
        live = offs < n
        s = tl.load(scores_ptr + score_row + offs.to(tl.int64) * stride_sn, mask=live, other=float("-inf"))
        z, finite = _zscore(s.to(tl.float32), mean, std)
        member = tl.load(member_ptr + row + offs, mask=live, other=0, cache_modifier=".cg").to(tl.float32)
        x = z + selection_bonus * member
        v = tl.load(vertical_ptr + row + offs, mask=live, other=0.0)
        tl.store(vertical_ptr + row + offs, tl.where(finite, alpha_vertical * v + (1 - alpha_vertical) * x, v),
                 mask=live)
        # diagonal at distance δ = offs: x of block count - 1 - δ (clamped to 0)
        source = tl.maximum(count - 1 - offs, 0)
        s_src = tl.load(scores_ptr + score_row + source.to(tl.int64) * stride_sn, mask=live, other=float("-inf"))
        z_src, _ = _zscore(s_src.to(tl.float32), mean, std)
        member_src = tl.load(member_ptr + row + source, mask=live, other=0, cache_modifier=".cg").to(tl.float32)
        x_src = z_src + selection_bonus * member_src
        d = tl.load(diagonal_ptr + row + offs, mask=live, other=0.0)
        tl.store(diagonal_ptr + row + offs,
                 tl.where(offs < count, alpha_diagonal * d + (1 - alpha_diagonal) * x_src, d), mask=live)
    if (kv_head == 0) & (batch % rows_per_layer == 0):  # one program per layer counts
        layer = batch // rows_per_layer
        tl.store(updates_ptr + layer, tl.load(updates_ptr + layer) + 1)


@triton.jit
def _qsim_similarity(query_ptr, keys_ptr, pending_ptr, has_pending_ptr, filled, bh, kv_head, batch, query_size,
                     cache_size, C_BLOCK: tl.constexpr, Q_TILE: tl.constexpr):
    """Normalise this row's query (written to pending; program (0, 0) raises has_pending) ->
    cosine similarity [C_BLOCK] of every cached query (-inf for unfilled slots)."""
    q_row = bh * query_size
    squares = tl.zeros([], dtype=tl.float32)
    for start in range(0, query_size, Q_TILE):
        offs = start + tl.arange(0, Q_TILE)
        x = tl.load(query_ptr + q_row + offs, mask=offs < query_size, other=0.0).to(tl.float32)
        squares += tl.sum(x * x, axis=0)
    norm = tl.maximum(tl.sqrt_rn(squares), 1e-12)
    slots = tl.arange(0, C_BLOCK)
    similarity = tl.zeros([C_BLOCK], dtype=tl.float32)
    key_rows = (bh * cache_size + slots.to(tl.int64)) * query_size
    for start in range(0, query_size, Q_TILE):
        offs = start + tl.arange(0, Q_TILE)
        live = offs < query_size
        x = tl.div_rn(tl.load(query_ptr + q_row + offs, mask=live, other=0.0).to(tl.float32), norm)
        tl.store(pending_ptr + q_row + offs, x, mask=live)
        k = tl.load(keys_ptr + key_rows[:, None] + offs[None, :], mask=(slots[:, None] < cache_size) & live[None, :],
                    other=0.0)
        similarity += tl.sum(k * x[None, :], axis=1)
    if (kv_head == 0) & (batch == 0):
        tl.store(has_pending_ptr, tl.full([], 1, tl.uint8))
    return tl.where(slots.to(tl.int64) < filled, similarity, float("-inf"))


@triton.jit
def _qsim_neighbours(similarity, filled, cache_size, NEIGHBOURS: tl.constexpr, C_BLOCK: tl.constexpr,
                     M_ROWS: tl.constexpr):
    """-> (slot [M_ROWS] int32, weight [M_ROWS] fp32): row j < NEIGHBOURS the j-th most similar
    cached pair (ties to the lower slot) and its vote 1.5 + s/2 (0 for an unfilled slot: it does
    not vote); while nothing is cached, row 0 is slot C (A_{t-1}) with weight 1. Other rows 0."""
    slots = tl.arange(0, C_BLOCK)
    rows = tl.arange(0, M_ROWS)
    slot = tl.zeros([M_ROWS], dtype=tl.int32)
    weight = tl.zeros([M_ROWS], dtype=tl.float32)
    remaining = similarity
    for j in tl.static_range(NEIGHBOURS):
        best = tl.max(remaining, axis=0)
        which = tl.min(tl.where(remaining == best, slots, C_BLOCK), axis=0)
        remaining = tl.where(slots == which, float("-inf"), remaining)
        slot = tl.where(rows == j, tl.minimum(which, cache_size - 1), slot)
        weight = tl.where(rows == j, tl.where(best > float("-inf"), 1.5 + best / 2, 0.0), weight)
    empty = filled == 0
    slot = tl.where(empty, tl.where(rows == 0, cache_size, 0), slot)
    weight = tl.where(empty, tl.where(rows == 0, 1.0, 0.0), weight)
    return slot, weight


@triton.jit
def _qsim_rank_row(rank_ptr, row, set_ids_ptr, set_cnt_ptr, last_sel_ptr, last_z_ptr, slot, weight, filled, bh, n, nb,
                   width, cache_size, recent_blocks, recent_bonus, tie, NEIGHBOURS: tl.constexpr, M_ROWS: tl.constexpr,
                   TILE: tl.constexpr, IDX_TILE: tl.constexpr):
    """The rank of one row (O(N + neighbours·K)) into rank[row : row + n]: the votes are summed in
    the row itself (zeros, then each neighbour's weight added at its ids, neighbour by neighbour:
    torch's order), then + the recent bonus + tie·last z, -inf at or past nb."""
    for start in range(0, n, TILE):
        offs = start + tl.arange(0, TILE)
        tl.store(rank_ptr + row + offs, tl.zeros([TILE], dtype=tl.float32), mask=offs < n)
    tl.debug_barrier()
    rows = tl.arange(0, M_ROWS)
    lists = bh * (cache_size + 1) + slot  # [M_ROWS] the neighbours' lists
    for j in tl.static_range(NEIGHBOURS):
        list_j = tl.sum(tl.where(rows == j, lists, 0), axis=0)
        w_j = tl.sum(tl.where(rows == j, weight, 0.0), axis=0)
        # unfilled slots do not vote; while nothing is cached A_{t-1} comes from last_selected below
        cnt = tl.where((w_j > 0) & (filled > 0), tl.load(set_cnt_ptr + list_j), 0)
        for start in range(0, width, IDX_TILE):
            c = start + tl.arange(0, IDX_TILE)
            valid = c < cnt
            ids = tl.load(set_ids_ptr + list_j * width + c, mask=valid, other=0)
            valid = valid & (ids < n)
            v = tl.load(rank_ptr + row + ids, mask=valid, other=0.0, cache_modifier=".cg")
            tl.store(rank_ptr + row + ids, v + w_j, mask=valid)
        tl.debug_barrier()  # one neighbour's votes land before the next one's are added
    for start in range(0, n, TILE):
        offs = start + tl.arange(0, TILE)
        live = offs < n
        inside = offs < nb
        votes = tl.load(rank_ptr + row + offs, mask=live, other=0.0, cache_modifier=".cg")
        last = tl.load(last_sel_ptr + row + offs, mask=live, other=0).to(tl.float32)
        votes = tl.where(filled > 0, votes, last)
        recent = (offs >= nb - recent_blocks) & inside
        z = tl.load(last_z_ptr + row + offs, mask=live, other=0.0)
        score = votes + recent_bonus * recent.to(tl.float32) + tie * z
        tl.store(rank_ptr + row + offs, tl.where(inside, score, float("-inf")), mask=live)


@triton.jit
def _qsim_rank_kernel(
    query_ptr,  # [B, Hkv, GD] fp32/bf16/fp16 this step's query (G query heads of D), contiguous
    keys_ptr,  # [B, Hkv, C, GD] fp32 contiguous: the ring buffer's normalised past queries
    set_ids_ptr,  # [B, Hkv, C + 1, W] int32 contiguous: their selections as ascending id lists (slot C: A_{t-1})
    set_cnt_ptr,  # [B, Hkv, C + 1] int32: the lists' lengths
    last_sel_ptr,  # [B, Hkv, N] uint8 (bool): A_{t-1}
    last_z_ptr,  # [B, Hkv, N] fp32: z-scores of step t-1
    filled_ptr,  # [1] int64 pairs cached
    num_blocks_ptr,  # [B] int32/int64
    pending_ptr,  # [B, Hkv, GD] fp32 out: the normalised query
    has_pending_ptr,  # [1] uint8 (bool) out: set
    rank_ptr,  # [B, Hkv, N] fp32 out
    n, num_kv_heads, query_size, cache_size, width, recent_blocks,
    recent_bonus, tie,  # fp32: 2·neighbours + 1, TIE
    NEIGHBOURS: tl.constexpr,
    C_BLOCK: tl.constexpr,  # next power of two >= cache_size
    M_ROWS: tl.constexpr,  # next power of two >= NEIGHBOURS
    Q_TILE: tl.constexpr,  # query values per loop iteration
    TILE: tl.constexpr,
    IDX_TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    bh = batch.to(tl.int64) * num_kv_heads + kv_head
    filled = tl.load(filled_ptr)
    similarity = _qsim_similarity(query_ptr, keys_ptr, pending_ptr, has_pending_ptr, filled, bh, kv_head, batch,
                                  query_size, cache_size, C_BLOCK, Q_TILE)
    nb = tl.load(num_blocks_ptr + batch).to(tl.int32)
    slot, weight = _qsim_neighbours(similarity, filled, cache_size, NEIGHBOURS, C_BLOCK, M_ROWS)
    _qsim_rank_row(rank_ptr, bh * n, set_ids_ptr, set_cnt_ptr, last_sel_ptr, last_z_ptr, slot, weight, filled, bh, n, nb,
                   width, cache_size, recent_blocks, recent_bonus, tie, NEIGHBOURS, M_ROWS, TILE, IDX_TILE)


@triton.jit
def _order_key(score):
    """fp32 scores -> order-preserving uint32 keys (topk_jit's): -0.0 folded to +0.0."""
    score = tl.where(score == 0.0, 0.0, score)
    bits = score.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) == 1, ~bits, bits | 0x80000000)


@triton.jit
def _qsim_similarity_kernel(
    query_ptr,  # [B, Hkv, G·D] contiguous, any float dtype
    keys_ptr,  # [B, Hkv, C, G·D] fp32 contiguous: the cached normalised queries
    pending_ptr,  # [B, Hkv, G·D] fp32 out: the query normalised (written by the slot group 0 programs)
    has_pending_ptr,  # [1] uint8 out: set
    similarity_ptr,  # [B, Hkv, C] fp32 out: cosine of the query with every slot (filled or not)
    num_kv_heads, query_size, cache_size,
    SLOTS: tl.constexpr,  # slots per program (a power of two)
    Q_CHUNK: tl.constexpr,  # query values per loop iteration (a power of two)
):
    """The first of query_similarity's two propose launches: one program per (KV head, batch row,
    group of SLOTS slots), so the C·G·D fp32 keys (128 KB a KV head at C = 64, G·D = 512) are read
    by C / SLOTS programs at once instead of one (a lone program a KV head was bound by the keys'
    load latency). The dot products use the raw query, divided by its norm at the end."""
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    group = tl.program_id(2)
    bh = batch.to(tl.int64) * num_kv_heads + kv_head
    q_row = bh * query_size
    slots = group * SLOTS + tl.arange(0, SLOTS)
    key_rows = (bh * cache_size + slots.to(tl.int64)) * query_size
    squares = tl.zeros([], dtype=tl.float32)
    dots = tl.zeros([SLOTS], dtype=tl.float32)
    for start in range(0, query_size, Q_CHUNK):
        offs = start + tl.arange(0, Q_CHUNK)
        live = offs < query_size
        x = tl.load(query_ptr + q_row + offs, mask=live, other=0.0).to(tl.float32)
        k = tl.load(keys_ptr + key_rows[:, None] + offs[None, :], mask=(slots[:, None] < cache_size) & live[None, :],
                    other=0.0)
        squares += tl.sum(x * x, axis=0)
        dots += tl.sum(k * x[None, :], axis=1)
    norm = tl.maximum(tl.sqrt_rn(squares), 1e-12)
    tl.store(similarity_ptr + bh * cache_size + slots, tl.div_rn(dots, norm), mask=slots < cache_size)
    if group == 0:
        for start in range(0, query_size, Q_CHUNK):
            offs = start + tl.arange(0, Q_CHUNK)
            live = offs < query_size
            x = tl.load(query_ptr + q_row + offs, mask=live, other=0.0).to(tl.float32)
            tl.store(pending_ptr + q_row + offs, tl.div_rn(x, norm), mask=live)
        if (kv_head == 0) & (batch == 0):
            tl.store(has_pending_ptr, tl.full([], 1, tl.uint8))


@triton.jit
def _rows_of_lowest_id(id_a, rows_a, id_b, rows_b):
    """associative_scan combine (commutative and associative, so neither the scan's direction nor
    its tree changes the result): the lower id, with the OR of the row masks that carry it."""
    low = tl.minimum(id_a, id_b)
    return low, tl.where(id_a == low, rows_a, 0) | tl.where(id_b == low, rows_b, 0)


@triton.jit
def _rows_of_highest_id(id_a, rows_a, id_b, rows_b):
    """As `_rows_of_lowest_id` for the higher id."""
    high = tl.maximum(id_a, id_b)
    return high, tl.where(id_a == high, rows_a, 0) | tl.where(id_b == high, rows_b, 0)


@triton.jit
def _exchange(x, N: tl.constexpr, S: tl.constexpr, DESCENDING_BIT: tl.constexpr):
    """One step of a bitonic network over x [N]: the elements S apart (in blocks of 2S) put in
    order, ascending, or descending in the blocks whose position has DESCENDING_BIT set."""
    pairs = tl.permute(tl.reshape(x, [N // (2 * S), 2, S]), (0, 2, 1))  # [.., S, 2]: (x[i], x[i + S])
    a, b = tl.split(pairs)
    lo = tl.minimum(a, b)
    hi = tl.maximum(a, b)
    if DESCENDING_BIT < N:
        descending = ((tl.arange(0, N // (2 * S)) * (2 * S)) & DESCENDING_BIT)[:, None] != 0
        lo, hi = tl.where(descending, hi, lo), tl.where(descending, lo, hi)
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), [N])


@triton.jit
def _bitonic_sort(x, N: tl.constexpr):
    """x [N] (N a power of two, at most 2^15) in ascending order: a bitonic network of
    log N·(log N + 1)/2 steps, each a min/max over the pairs in registers. (Its sm_90 PTX at 4
    warps, 512 lanes: 19 barriers for int32 or uint64, against tl.sort's 27 and 55.)"""
    for stage in tl.static_range(1, 16):
        if (1 << stage) <= N:  # runs of 2^(stage - 1), alternately ascending and descending, merged
            for i in tl.static_range(stage):
                x = _exchange(x, N, 1 << (stage - 1 - i), 1 << stage)
    return x


@triton.jit
def _store_in_lane_order(idx_out_ptr, out_row, ids, taken, k):
    """idx_out[out_row + i] <- the i-th taken lane's id (i < k), the lanes in order."""
    position = tl.cumsum(taken.to(tl.int32), axis=0) - 1
    tl.store(idx_out_ptr + out_row + position, ids, mask=taken & (position < k))


@triton.jit
def _qsim_propose_kernel(
    similarity_ptr,  # [B, Hkv, C] fp32: `_qsim_similarity_kernel`'s cosines
    set_ids_ptr, set_cnt_ptr, last_z_ptr, filled_ptr, num_blocks_ptr,  # (as _qsim_rank_kernel's)
    fill_ptr,  # [B, Hkv, W_fill] int32: the W_fill best blocks by tie·last_z, best first (ties to the lower id) (HAS_FILL)
    fill_valid_ptr,  # [1] uint8: fill is up to date with last_z (HAS_FILL)
    idx_out_ptr,  # [B, Hkv, K_out] int32: P in ascending block order, then padding 0
    count_out_ptr,  # [B, Hkv] int32
    scratch_row_ptr,  # [B * Hkv, N] int32 workspace: the fill's marks (HAS_FILL); the whole row's keys (only where
    # the lists do not hold P)
    n, num_kv_heads, cache_size, width, recent_blocks, k, k_out, fill_width,
    recent_bonus, tie,
    NEIGHBOURS: tl.constexpr,
    C_BLOCK: tl.constexpr,
    M_ROWS: tl.constexpr,  # next power of two >= NEIGHBOURS + 1: the neighbours' lists and the recent window
    K_BLOCK: tl.constexpr,  # next power of two >= max(W, recent_blocks, W_fill / M_ROWS): one list
    BLOCK: tl.constexpr,  # next power of two >= N: the whole row in registers (only where the lists do not hold P)
    HAS_FILL: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    PAD_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """query_similarity's propose from the id lists (the second launch, after the cosines): the
    lists and the fill list in registers, no pass over the N blocks where they hold P. Candidates
    (blocks in a voting neighbour's list or the recent window, inside the context) score
    >= 1 - |tie·z| and the others exactly tie·z (< 0.5 for rows under 250000 blocks: |z| <=
    sqrt(N - 1)), so
    - where at least k blocks are candidates the top k among them (one sort of (key, id) packed
      in 64 bits over the LANES = M_ROWS·K_BLOCK lanes);
    - where fewer are, P is every candidate and the best k - n_c others by tie·z, whose order does
      not depend on the query: the first k - n_c non-candidates inside the context in `fill` (the
      update's list of the row's best by tie·z, best first, written off the critical path);
    - else (no valid fill, or too short) the top-k of the whole row (O(N), in registers).
    The memberships take one sort and two scans over the lanes (log-depth), not a compare of each
    lane against each neighbour's list ([LANES × K_BLOCK] per neighbour, which spilled at K =
    128): the lanes are sorted once as (id << 6 | row) int32 keys, so a block's lanes are adjacent,
    and two scans OR their rows' bits (forward: the block's first lane is the one whose prefix
    holds only its own row; backward: that lane gets every row listing the block, whose
    neighbours' weights are then added in torch's order). The candidates' ids then ascend across
    the lanes, so P is written in lane order (a cumsum, no sort) unless fill blocks join it.
    The fill's ids listed by a neighbour are found by marks in the scratch row (O(LANES + W_fill),
    two barriers). The sorts are `_bitonic_sort`'s network (fewer barriers than tl.sort's)."""
    pdl_prologue(PDL)
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    bh = batch.to(tl.int64) * num_kv_heads + kv_head
    filled = tl.load(filled_ptr)
    nb = tl.minimum(tl.load(num_blocks_ptr + batch).to(tl.int32), n)
    c_slots = tl.arange(0, C_BLOCK)
    similarity = tl.load(similarity_ptr + bh * cache_size + c_slots, mask=c_slots < cache_size, other=float("-inf"))
    similarity = tl.where(c_slots.to(tl.int64) < filled, similarity, float("-inf"))
    slot, weight = _qsim_neighbours(similarity, filled, cache_size, NEIGHBOURS, C_BLOCK, M_ROWS)
    # lanes [M_ROWS, K_BLOCK]: row j < NEIGHBOURS the j-th neighbour's list, row NEIGHBOURS the recent window
    rows = tl.arange(0, M_ROWS)
    cols = tl.arange(0, K_BLOCK)
    lists = bh * (cache_size + 1) + slot  # [M_ROWS]
    cnt = tl.load(set_cnt_ptr + lists, mask=(rows < NEIGHBOURS) & (weight > 0), other=0)  # unfilled slots: no lanes
    in_list = cols[None, :] < cnt[:, None]
    ids2 = tl.load(set_ids_ptr + lists[:, None] * width + cols[None, :], mask=in_list, other=0)
    window = rows[:, None] == NEIGHBOURS
    ids2 = tl.where(window, nb - recent_blocks + cols[None, :], ids2)
    live2 = (in_list | (window & (cols[None, :] < recent_blocks))) & (ids2 >= 0) & (ids2 < nb)
    LANES: tl.constexpr = M_ROWS * K_BLOCK
    # a lane's key: its block id << 6 | its row (M_ROWS <= 64; ids < nb <= N, the launcher's rows of up to
    # MAX_ROW_BLOCK = 16384 blocks: far below 2^25); the lanes outside the lists and the window (or the
    # context) sort last (key 2^31 - 1, no row bit)
    tl.static_assert(M_ROWS <= 64)
    BIG: tl.constexpr = 2147483647
    lane_row2 = tl.broadcast_to(rows[:, None], [M_ROWS, K_BLOCK])
    key = _bitonic_sort(tl.reshape(tl.where(live2, (ids2 << 6) | lane_row2, BIG), [LANES]), LANES)
    lane = tl.arange(0, LANES)
    live = key != BIG
    ids = key >> 6
    lane_row = key & 63
    # each lane's row as one bit (int32 up to 32 rows), none for the lanes that are not live (whose
    # shift is 0: none past the width)
    shift = tl.where(live, lane_row, 0)
    if M_ROWS > 32:
        bit = tl.where(live, tl.full([LANES], 1, tl.int64) << shift.to(tl.int64), 0)
    else:
        bit = tl.where(live, tl.full([LANES], 1, tl.int32) << shift, 0)
    # a block's lanes are adjacent, its rows ascending: forward, a lane's mask holds the rows of the
    # block's lanes up to it (only its own at the block's first lane); backward, those from it on
    # (every row listing the block at its first lane)
    _, before = tl.associative_scan((ids, bit), 0, _rows_of_highest_id)
    _, after = tl.associative_scan((ids, bit), 0, _rows_of_lowest_id, reverse=True)
    # one lane per block, its first (every live lane is voted, weight > 0, or recent)
    candidate = live & (before == bit)
    # votes of each candidate's block, neighbour by neighbour (torch's order of the sum)
    votes = tl.zeros([LANES], dtype=tl.float32)
    for j in tl.static_range(NEIGHBOURS):
        w_j = tl.sum(tl.where(rows == j, weight, 0.0), axis=0)
        votes = tl.where(((after >> j) & 1) != 0, votes + w_j, votes)
    recent = ids >= nb - recent_blocks
    z = tl.load(last_z_ptr + bh * n + ids, mask=candidate, other=0.0)
    score = votes + recent_bonus * recent.to(tl.float32) + tie * z
    keys = tl.where(candidate, _order_key(score), 0)
    n_cand = tl.sum(candidate.to(tl.int32), axis=0)
    done = n_cand >= k
    out_row = bh * k_out
    if HAS_FILL:
        # the fill list in LANES lanes (K_BLOCK is sized so that M_ROWS·K_BLOCK >= W_fill), read
        # only where the candidates are too few; its ids listed by a neighbour or in the recent
        # window are candidates already. Listed: marks in the scratch row (0 at the fill's ids,
        # then 1 at the lists' ids, then read at the fill's)
        fid = tl.zeros([LANES], dtype=tl.int32)
        enough = n_cand < 0
        picked = lane < 0
        if n_cand < k:
            fid = tl.load(fill_ptr + bh * fill_width + lane, mask=lane < fill_width, other=0)
            in_fill = (lane < fill_width) & (fid >= 0) & (fid < nb)
            marks = scratch_row_ptr + bh * n
            tl.store(marks + fid, tl.zeros([LANES], dtype=tl.int32), mask=in_fill)
            tl.debug_barrier()
            tl.store(marks + ids, tl.full([LANES], 1, tl.int32), mask=live & (lane_row < NEIGHBOURS))
            tl.debug_barrier()
            listed = tl.load(marks + fid, mask=in_fill, other=0, cache_modifier=".cg") != 0
            is_cand = (fid >= nb - recent_blocks) | listed
            usable = (lane < fill_width) & (fid < nb) & ~is_cand  # non-candidates inside the context, best first
            need = k - n_cand
            enough = (tl.load(fill_valid_ptr) != 0) & (tl.sum(usable.to(tl.int32), axis=0) >= need)
            # (need times 0 or 1: the interpreter does not broadcast a scalar bool into a block mask)
            picked = usable & (tl.cumsum(usable.to(tl.int32), axis=0) <= need * enough.to(tl.int32))
        done = done | enough
    if done:
        # P's ids ascending: the candidates' ids ascend across the lanes
        if n_cand > k:
            # the top_k_blocks order (key descending, then the lower id) as one uint64 sort, the
            # k-th largest at lane LANES - k; non-candidates are 0, below every candidate (whose
            # keys are those of scores >= 0.5)
            packed = tl.where(candidate, (keys.to(tl.uint64) << 32) | (
                0xFFFFFFFF - ids.to(tl.uint32, bitcast=True)).to(tl.uint64), 0)
            kth = tl.max(tl.where(lane == LANES - k, _bitonic_sort(packed, LANES), 0), axis=0)
            _store_in_lane_order(idx_out_ptr, out_row, ids, candidate & (packed >= kth), k)
        else:
            # every candidate, or where the fill was used one sort of their ids beside the fill's
            if HAS_FILL:
                if enough:
                    out_lane = tl.arange(0, 2 * LANES)
                    chosen = tl.where(candidate, ids, BIG)
                    ascending = _bitonic_sort(tl.reshape(tl.join(chosen, tl.where(picked, fid, BIG)), [2 * LANES]),
                                              2 * LANES)
                    tl.store(idx_out_ptr + out_row + out_lane, ascending, mask=out_lane < k)
                else:
                    _store_in_lane_order(idx_out_ptr, out_row, ids, candidate, k)
            else:
                _store_in_lane_order(idx_out_ptr, out_row, ids, candidate, k)
        _pad_and_count(idx_out_ptr, count_out_ptr, out_row, bh, k, k_out, PAD_BLOCK)
    else:
        # the whole row: tie·z as the rank sums it for a block without votes (0 + 0 + tie·z), the
        # candidates' keys written over theirs, then the row's top-k
        if HAS_FILL:
            tl.debug_barrier()  # every thread has read the fill's marks before the row overwrites them
        offs = tl.arange(0, BLOCK)
        inside = offs < nb
        z_row = tl.load(last_z_ptr + bh * n + offs, mask=offs < n, other=0.0)
        zero = tl.zeros([BLOCK], dtype=tl.float32)
        row_keys = tl.where(inside, _order_key(zero + recent_bonus * zero + tie * z_row), 0)
        tl.store(scratch_row_ptr + bh * n + offs, row_keys.to(tl.int32, bitcast=True), mask=offs < n)
        tl.debug_barrier()
        tl.store(scratch_row_ptr + bh * n + ids, keys.to(tl.int32, bitcast=True), mask=candidate)
        tl.debug_barrier()
        row_keys = tl.load(scratch_row_ptr + bh * n + offs, mask=offs < n, other=0, cache_modifier=".cg").to(
            tl.uint32, bitcast=True)
        _select_row(row_keys, inside, offs, k, k_out, out_row, bh, idx_out_ptr, count_out_ptr, RADIX_BITS, PAD_BLOCK)


@triton.jit
def _qsim_update_kernel(
    scores_ptr,  # [B, Hkv, N] fp32, strided
    idx_ptr,  # [B, Hkv, C_A] int32/int64, strided
    cnt_ptr,  # [B, Hkv] int32/int64, strided
    keys_ptr,  # [B, Hkv, C, GD] fp32 contiguous (PAIR)
    set_ids_ptr,  # [B, Hkv, C + 1, W] int32 contiguous: slot C <- this selection's list; slot cursor too where paired
    set_cnt_ptr,  # [B, Hkv, C + 1] int32
    pending_ptr,  # [B, Hkv, GD] fp32 (PAIR)
    has_pending_ptr,  # [L] uint8 (PAIR): each layer's
    cursor_ptr,  # [L] int64 (PAIR): each layer's
    last_sel_ptr,  # [B, Hkv, N] uint8 out
    last_z_ptr,  # [B, Hkv, N] fp32 out
    n, num_kv_heads, capacity, query_size, cache_size, width,
    rows_per_layer,  # B: row r (the "batch" axis, L·B rows for a layer range) is layer r // B's
    stride_sb, stride_sh, stride_sn,
    stride_ib, stride_ih, stride_ic,
    stride_cb, stride_ch,
    PAIR: tl.constexpr,  # the buffers are sized (a propose has run): pair the pending query
    TILE: tl.constexpr,
    IDX_TILE: tl.constexpr,
    Q_TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    """last_z, last_selected <- this selection, and its list (distinct in-range ids, ascending,
    from the mask: O(N), off the critical path) into slot C; where a propose left a query, slot
    `cursor` of the ring buffer <- (that query, the list). The counters move in
    `_qsim_counters_kernel` (after every program here has read them)."""
    pdl_prologue(PDL)
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    layer = batch // rows_per_layer
    bh = batch.to(tl.int64) * num_kv_heads + kv_head
    score_row = batch.to(tl.int64) * stride_sb + kv_head.to(tl.int64) * stride_sh
    row = bh * n
    mean, std, count = _row_stats(scores_ptr, score_row, stride_sn, n, TILE)
    # pair: 1 where a propose left a query to pair (a multiplier of loop bounds and masks: the
    # interpreter does not broadcast a scalar bool into a block mask)
    pair = tl.zeros([], dtype=tl.int32)
    slot = tl.zeros([], dtype=tl.int64)
    if PAIR:
        pair = (tl.load(has_pending_ptr + layer) != 0).to(tl.int32)
        slot = tl.load(cursor_ptr + layer)
        for start in range(0, query_size, Q_TILE):
            offs = start + tl.arange(0, Q_TILE)
            live = offs < query_size * pair
            x = tl.load(pending_ptr + bh * query_size + offs, mask=live, other=0.0)
            tl.store(keys_ptr + (bh * cache_size + slot) * query_size + offs, x, mask=live)
    for start in range(0, n, TILE):
        offs = start + tl.arange(0, TILE)
        live = offs < n
        s = tl.load(scores_ptr + score_row + offs.to(tl.int64) * stride_sn, mask=live, other=float("-inf"))
        z, finite = _zscore(s.to(tl.float32), mean, std)
        tl.store(last_z_ptr + row + offs, z, mask=live)
        tl.store(last_sel_ptr + row + offs, tl.zeros([TILE], dtype=tl.uint8), mask=live)
    tl.debug_barrier()  # the zeros land before the selected blocks' ones
    chosen = tl.load(cnt_ptr + batch.to(tl.int64) * stride_cb + kv_head.to(tl.int64) * stride_ch).to(tl.int32)
    idx_row = batch.to(tl.int64) * stride_ib + kv_head.to(tl.int64) * stride_ih
    for start in range(0, capacity, IDX_TILE):
        j = start + tl.arange(0, IDX_TILE)
        valid = (j < chosen) & (j < capacity)
        ids = tl.load(idx_ptr + idx_row + j.to(tl.int64) * stride_ic, mask=valid, other=0).to(tl.int32)
        valid = valid & (ids >= 0) & (ids < n)
        tl.store(last_sel_ptr + row + ids, tl.full([IDX_TILE], 1, tl.uint8), mask=valid)
    tl.debug_barrier()  # the mask is complete before it is compacted
    last_list = (bh * (cache_size + 1) + cache_size) * width
    pair_list = (bh * (cache_size + 1) + slot) * width
    total = tl.zeros([], dtype=tl.int32)
    for start in range(0, n, TILE):
        offs = start + tl.arange(0, TILE)
        member = tl.load(last_sel_ptr + row + offs, mask=offs < n, other=0, cache_modifier=".cg").to(tl.int32)
        position = total + tl.cumsum(member, axis=0) - 1
        listed = (member != 0) & (position < width)  # the launcher keeps the selection's capacity <= width
        tl.store(set_ids_ptr + last_list + position, offs, mask=listed)
        if PAIR:
            tl.store(set_ids_ptr + pair_list + position, offs, mask=listed & (position < width * pair))
        total += tl.sum(member, axis=0)
    total = tl.minimum(total, width)
    for start in range(0, width, IDX_TILE):
        j = start + tl.arange(0, IDX_TILE)
        pad = (j >= total) & (j < width)
        tl.store(set_ids_ptr + last_list + j, tl.zeros([IDX_TILE], dtype=tl.int32), mask=pad)
        if PAIR:
            tl.store(set_ids_ptr + pair_list + j, tl.zeros([IDX_TILE], dtype=tl.int32), mask=pad & (j < width * pair))
    tl.store(set_cnt_ptr + bh * (cache_size + 1) + cache_size, total)
    if PAIR:
        pair_cnt = set_cnt_ptr + bh * (cache_size + 1) + slot
        tl.store(pair_cnt, tl.where(pair != 0, total, tl.load(pair_cnt)))


@triton.jit
def _qsim_counters_kernel(has_pending_ptr, cursor_ptr, filled_ptr, cache_size):
    """One program a layer: where a query was pending, cursor <- (cursor + 1) mod C and filled <-
    min(filled + 1, C); has_pending <- False."""
    layer = tl.program_id(0)
    step = (tl.load(has_pending_ptr + layer) != 0).to(tl.int64)
    tl.store(cursor_ptr + layer, (tl.load(cursor_ptr + layer) + step) % cache_size)
    tl.store(filled_ptr + layer, tl.minimum(tl.load(filled_ptr + layer) + step, cache_size))
    tl.store(has_pending_ptr + layer, tl.zeros([], dtype=tl.uint8))


@triton.jit
def _qsim_fill_kernel(
    last_z_ptr,  # [B, Hkv, N] fp32: z-scores of step t-1
    fill_ptr,  # [B, Hkv, W] int32 out: the W blocks of largest tie·last_z, best first, ties to the lower id
    count_ptr,  # [B * Hkv] int32 workspace: the selection's counts
    fill_valid_ptr,  # [1] uint8 out: set (the list matches last_z)
    n, num_kv_heads, width,
    tie,  # fp32: TIE
    BLOCK: tl.constexpr,  # next power of two >= N: the row in registers
    FILL_BLOCK: tl.constexpr,  # next power of two >= W
    RADIX_BITS: tl.constexpr,
    PAD_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """query_similarity's fill list in one launch (it was a top-k, two gathers and a torch sort):
    the row's top-W set by tie·last_z (`_select_row`, the top-k kernels' radix select), then its
    W ids ordered best first by one tl.sort of (key descending, id ascending) packed in 64 bits."""
    pdl_prologue(PDL)
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    bh = batch.to(tl.int64) * num_kv_heads + kv_head
    offs = tl.arange(0, BLOCK)
    ranked = tie * tl.load(last_z_ptr + bh * n + offs, mask=offs < n, other=0.0)  # fp32, as torch's tie * last_z
    valid = (offs < n) & (ranked > float("-inf")) & (ranked == ranked)
    keys = tl.where(valid, _order_key(ranked), 0)
    out_row = bh * width
    _select_row(keys, valid, offs, width, width, out_row, bh, fill_ptr, count_ptr, RADIX_BITS, PAD_BLOCK)
    tl.debug_barrier()  # the program's own stores, read back by other threads
    lanes = tl.arange(0, FILL_BLOCK)
    held = lanes < tl.load(count_ptr + bh, cache_modifier=".cg")
    ids = tl.load(fill_ptr + out_row + lanes, mask=held, other=0, cache_modifier=".cg")
    key = _order_key(tie * tl.load(last_z_ptr + bh * n + ids, mask=held, other=0.0)).to(tl.uint64)
    packed = ((0xFFFFFFFF - key) << 32) | ids.to(tl.uint64)  # ascending: best key first, then the lower id
    packed = tl.where(held, packed, packed | (0xFFFFFFFF << 32))  # (unused lanes last)
    ordered = tl.sort(packed)
    tl.debug_barrier()  # every thread has read the set before any writes the order
    tl.store(fill_ptr + out_row + lanes, (ordered & 0xFFFFFFFF).to(tl.int32), mask=held)
    if (kv_head == 0) & (batch == 0):
        tl.store(fill_valid_ptr, 1)
