"""Triton device code for sparse (block-list) decode attention and partial-state merge.

Launchers, input checks and the shapes at the Python boundary live in
kernels/sparse_decode.py; this file holds only @triton.jit code.

Conventions (DESIGN.md §3): an attention state is (out, lse) with `out` the normalised
fp32 output and `lse` the fp32 natural-log sum of exp(scale · q·k) over its keys; an empty
key set is lse = -inf, out = 0. Inside the kernels scores are kept in log2 units
(scaled by log2(e)) so the softmax uses exp2; lse is converted back to natural log at the
store.

GQA: query head `kv_head * GROUP + g` (g < GROUP) attends KV head `kv_head`. Each program
loads all GROUP query rows of its KV head at once (padded to GROUP_PAD >= 16 rows, so the
tl.dot shapes are valid on the GPU: M = GROUP_PAD, N = TILE_TOKENS >= 16,
K = HEAD_DIM >= 16), so every K/V tile is read once for the whole group.

Dot modes (constexpr NATIVE_DOT):
- True: K/V and q stay in their 16-bit storage type for tl.dot (fp32 accumulate);
  probabilities are cast to the value dtype for the P·V product; with PRECISE_PV they are
  split as p = hi + lo (both 16-bit) and P·V = hi·V + lo·V, which removes the 16-bit
  rounding of p (relative error ~2^-9 in bf16) for one more small tensor-core dot. The GPU default for
  fp16/bf16 caches. Valid in the CPU interpreter for fp16 only (not bf16).
- False: loads are cast to fp32 right after tl.load; tl.dot runs on fp32 operands with
  INPUT_PRECISION ("ieee" for fp32 data, "tf32" for 16-bit data, where fp16/bf16 values
  are exact in tf32).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_prologue

LOG2E = 1.4426950408889634  # scores are scaled by scale * LOG2E (launcher side)


@triton.jit
def _load_kv_tile(base_ptr, tokens, live, offs_d, stride_t, stride_d, NATIVE_DOT: tl.constexpr):
    """tokens: [TILE] int64 token positions; live: [TILE] bool -> tile [TILE, HEAD_DIM]
    (zeros where not live; fp32 unless NATIVE_DOT)."""
    rows = base_ptr + tokens * stride_t  # [TILE] pointers
    tile = tl.load(rows[:, None] + offs_d[None, :] * stride_d, mask=live[:, None], other=0.0)
    if not NATIVE_DOT:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _load_query_group(
    q_ptr, batch, kv_head, offs_g, offs_d, stride_qb, stride_qh, stride_qd,
    GROUP: tl.constexpr, NATIVE_DOT: tl.constexpr,
):
    """-> q: [GROUP_PAD, HEAD_DIM], rows >= GROUP are zero."""
    heads = kv_head * GROUP + offs_g  # [GROUP_PAD]
    ptrs = q_ptr + batch * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(ptrs, mask=(offs_g < GROUP)[:, None], other=0.0)
    if not NATIVE_DOT:
        q = q.to(tl.float32)
    return q


@triton.jit
def _online_softmax_step(
    q, k, v, live, m, l_sum, acc, qk_scale,
    NATIVE_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr, PRECISE_PV: tl.constexpr,
):
    """One tile of online softmax.

    q: [GROUP_PAD, D]; k, v: [TILE, D]; live: [TILE] bool;
    m, l_sum: [GROUP_PAD] fp32 running max (log2 units) and sum; acc: [GROUP_PAD, D] fp32
    -> updated (m, l_sum, acc). Never produces NaN: a row with no live key so far keeps
    m = -inf, l_sum = 0, acc = 0.
    """
    if NATIVE_DOT:
        s = tl.dot(q, tl.trans(k))
    else:
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
    s = s * qk_scale  # [GROUP_PAD, TILE], log2 units
    s = tl.where(live[None, :], s, float("-inf"))
    return _online_softmax_fold(s, v, m, l_sum, acc, NATIVE_DOT, INPUT_PRECISION, PRECISE_PV)


@triton.jit
def _online_softmax_fold(
    s, v, m, l_sum, acc,
    NATIVE_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr, PRECISE_PV: tl.constexpr,
):
    """Fold a tile of scores s [GROUP_PAD, TILE] (log2 units, -inf where not live) and its values
    v [TILE, D] into the running (m, l_sum, acc) of _online_softmax_step; also the exact repair's
    fold of token states whose scores were computed before (kernels/prr_repair.py)."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)  # 0 while m = -inf
    p = tl.exp2(s - m_safe[:, None])  # 0 where not live
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if NATIVE_DOT:
        p_hi = p.to(v.dtype)
        acc = tl.dot(p_hi, v, acc)
        if PRECISE_PV:  # p = hi + lo: the 16-bit rounding error of p is added back by a second dot
            acc = tl.dot((p - p_hi.to(tl.float32)).to(v.dtype), v, acc)
    else:
        acc = tl.dot(p, v, acc, input_precision=INPUT_PRECISION)
    return m_new, l_sum, acc


@triton.jit
def _attend_list(
    q, ids_row, stride_ic, k_row, v_row, stride_kt, stride_kd, stride_vt, stride_vd,
    entry_begin, entry_end, capacity, length, qk_scale,
    GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_TOKENS: tl.constexpr,
    NATIVE_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr, PRECISE_PV: tl.constexpr,
):
    """Online softmax of q [GROUP_PAD, D] over the tokens of list entries [entry_begin, entry_end)
    of ids_row (a list of `capacity` block ids; tokens >= length masked) -> (m, l_sum, acc), the
    running state of _online_softmax_step. The entries' tokens are walked as one flat sequence
    (entry e, offset o) -> e * BLOCK_SIZE + o in tiles of TILE_TOKENS rows."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, TILE_TOKENS)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    # Block ids a tile ahead, masked by the list's capacity only: the first tile's load does not
    # wait for the list's count (written by the kernel before, like the ids), so the two L2 reads overlap.
    ahead = entry_begin + offs_t // BLOCK_SIZE
    block_ahead = tl.load(ids_row + ahead * stride_ic, mask=ahead < capacity, other=0)
    for flat_start in range(entry_begin * BLOCK_SIZE, entry_end * BLOCK_SIZE, TILE_TOKENS):
        flat = flat_start + offs_t  # [TILE]
        entry = flat // BLOCK_SIZE
        in_list = entry < entry_end
        block = block_ahead.to(tl.int64)  # list entries past the end are padding: masked by in_list
        ahead = (flat + TILE_TOKENS) // BLOCK_SIZE
        block_ahead = tl.load(ids_row + ahead * stride_ic, mask=ahead < entry_end, other=0)
        tokens = block * BLOCK_SIZE + (flat % BLOCK_SIZE)
        live = in_list & (tokens >= 0) & (tokens < length)
        k = _load_kv_tile(k_row, tokens, live, offs_d, stride_kt, stride_kd, NATIVE_DOT)
        v = _load_kv_tile(v_row, tokens, live, offs_d, stride_vt, stride_vd, NATIVE_DOT)
        m, l_sum, acc = _online_softmax_step(q, k, v, live, m, l_sum, acc, qk_scale, NATIVE_DOT, INPUT_PRECISION,
                                             PRECISE_PV)
    return m, l_sum, acc


@triton.jit
def _store_state(
    out_ptr, lse_ptr, batch, kv_head, slot, offs_g, offs_d, m, l_sum, acc,
    stride_ob, stride_oh, stride_os, stride_od, stride_lb, stride_lh, stride_ls,
    GROUP: tl.constexpr,
):
    """Normalise and store GROUP rows of a state at out[batch, head, slot, :], lse[batch, head, slot]."""
    has_mass = l_sum > 0.0
    l_safe = tl.where(has_mass, l_sum, 1.0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    lse = tl.where(has_mass, (m_safe + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    out = acc / l_safe[:, None]
    heads = kv_head * GROUP + offs_g
    row_ok = offs_g < GROUP
    out_ptrs = (out_ptr + batch * stride_ob + slot * stride_os
                + heads[:, None] * stride_oh + offs_d[None, :] * stride_od)
    tl.store(out_ptrs, out, mask=row_ok[:, None])
    tl.store(lse_ptr + batch * stride_lb + slot * stride_ls + heads * stride_lh, lse, mask=row_ok)


@triton.jit
def _merge_row_splits(
    out_ptr, lse_ptr, merged_out_ptr, merged_lse_ptr, batch, kv_head, num_splits, offs_d,
    stride_ob, stride_oh, stride_os, stride_od, stride_lb, stride_lh, stride_ls,
    stride_mb, stride_mh, stride_md, stride_mlb, stride_mlh,
    GROUP: tl.constexpr, MERGE_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
):
    """⊕ of one (batch, KV head)'s split states (every split stored; read from L2) into
    merged_out [B, Hq, D], merged_lse [B, Hq] for its GROUP query heads (MERGE_GROUP: the next
    power of two). The splits are read SPLIT_CHUNK at a time as [MERGE_GROUP, SPLIT_CHUNK, D]
    tiles in an unrolled loop, so the loads do not wait for each other: this tail runs after the
    row's last split, on the critical path (one load per split in a loop cost ~0.3 µs each)."""
    offs_g = tl.arange(0, MERGE_GROUP)
    heads = kv_head * GROUP + offs_g  # [MERGE_GROUP]
    row_ok = offs_g < GROUP
    lse_row = lse_ptr + batch * stride_lb + heads[:, None] * stride_lh  # [MERGE_GROUP, 1]
    offs_s = tl.arange(0, SPLITS_PAD)
    lse = tl.load(lse_row + offs_s[None, :] * stride_ls, mask=row_ok[:, None] & (offs_s < num_splits)[None, :],
                  other=float("-inf"), cache_modifier=".cg")  # [MERGE_GROUP, SPLITS_PAD]
    m = tl.max(lse, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(lse - m_safe[:, None]), axis=1)  # 0 for empty and absent splits
    acc = tl.zeros([MERGE_GROUP, HEAD_DIM], tl.float32)
    offs_c = tl.arange(0, SPLIT_CHUNK)
    out_row = out_ptr + batch * stride_ob + heads[:, None, None] * stride_oh + offs_d[None, None, :] * stride_od
    for s0 in tl.static_range(0, SPLITS_PAD, SPLIT_CHUNK):
        splits = s0 + offs_c  # [SPLIT_CHUNK]
        live = row_ok[:, None] & (splits < num_splits)[None, :]
        # this chunk's weights, from its lse (a slice of a register tensor is not expressible)
        w = tl.exp(tl.load(lse_row + splits[None, :] * stride_ls, mask=live, other=float("-inf"),
                           cache_modifier=".cg") - m_safe[:, None])  # [MERGE_GROUP, SPLIT_CHUNK]
        o = tl.load(out_row + splits[None, :, None] * stride_os, mask=(live & (w > 0.0))[:, :, None], other=0.0,
                    cache_modifier=".cg")  # [MERGE_GROUP, SPLIT_CHUNK, HEAD_DIM]
        acc += tl.sum(w[:, :, None] * o, axis=1)
    has_mass = total > 0.0
    total_safe = tl.where(has_mass, total, 1.0)
    merged_lse = tl.where(has_mass, m_safe + tl.log(total_safe), float("-inf"))
    tl.store(merged_out_ptr + batch * stride_mb + heads[:, None] * stride_mh + offs_d[None, :] * stride_md,
             acc / total_safe[:, None], mask=row_ok[:, None])
    tl.store(merged_lse_ptr + batch * stride_mlb + heads * stride_mlh, merged_lse, mask=row_ok)


@triton.jit
def _group_row(
    row, q_ptr, k_ptr, v_ptr, ids_ptr, counts_ptr, lengths_ptr, num_kv_heads, capacity,
    stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_vb, stride_vh, stride_ib, stride_ih,
    stride_cb, stride_ch, stride_len,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, NATIVE_DOT: tl.constexpr,
):
    """What a program of grid row `row` = batch * Hkv + kv_head loads before walking its list (the
    split kernels of both list kinds and per_block_program) -> (batch, kv_head) int64; count: the
    row's list length counts[batch, kv_head] clamped to [0, capacity] (int32); length: its context
    lengths[batch] (int64); q [GROUP_PAD, HEAD_DIM]: its query group (_load_query_group); and the
    base pointers of its list ids[batch, kv_head, :] and of k/v[batch, kv_head, :, :]."""
    batch = (row // num_kv_heads).to(tl.int64)
    kv_head = (row % num_kv_heads).to(tl.int64)

    count = tl.load(counts_ptr + batch * stride_cb + kv_head * stride_ch).to(tl.int32)
    count = tl.minimum(tl.maximum(count, 0), capacity)
    length = tl.load(lengths_ptr + batch * stride_len).to(tl.int64)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    q = _load_query_group(q_ptr, batch, kv_head, offs_g, offs_d, stride_qb, stride_qh, stride_qd,
                          GROUP, NATIVE_DOT)

    ids_row = ids_ptr + batch * stride_ib + kv_head * stride_ih
    k_row = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_row = v_ptr + batch * stride_vb + kv_head * stride_vh
    return batch, kv_head, count, length, q, ids_row, k_row, v_row


@triton.jit
def _store_split(
    out_ptr, lse_ptr, batch, kv_head, split, row, m, l_sum, acc,
    stride_ob, stride_oh, stride_os, stride_od, stride_lb, stride_lh, stride_ls,
    arrivals_ptr, merged_out_ptr, merged_lse_ptr, stride_mb, stride_mh, stride_md, stride_mlb, stride_mlh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, FUSED_MERGE: tl.constexpr,
    SPLITS_PAD: tl.constexpr, MERGE_GROUP: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
):
    """The split kernels' tail (both list kinds): store one split's state (m, l_sum, acc of
    _online_softmax_step) at out[batch, head, split, :] [B, Hq, S, D], lse[batch, head, split]; with
    FUSED_MERGE, the row's last split to arrive (arrivals[row], an atomic count) merges all of the
    row's splits into merged_out [B, Hq, D], merged_lse [B, Hq] and re-arms its arrival count."""
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    _store_state(out_ptr, lse_ptr, batch, kv_head, split, offs_g, offs_d, m, l_sum, acc,
                 stride_ob, stride_oh, stride_os, stride_od, stride_lb, stride_lh, stride_ls, GROUP)
    if FUSED_MERGE:
        tl.debug_barrier()  # every thread's stores precede the arrival (release covers them)
        arrived = tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) - 1:
            _merge_row_splits(out_ptr, lse_ptr, merged_out_ptr, merged_lse_ptr, batch, kv_head, tl.num_programs(0),
                              offs_d, stride_ob, stride_oh, stride_os, stride_od, stride_lb, stride_lh,
                              stride_ls, stride_mb, stride_mh, stride_md, stride_mlb, stride_mlh,
                              GROUP, MERGE_GROUP, HEAD_DIM, SPLITS_PAD, SPLIT_CHUNK)
            tl.store(arrivals_ptr + row, 0)  # re-armed for the next launch (all arrivals are in)


@triton.jit
def sparse_decode_split_kernel(
    q_ptr, k_ptr, v_ptr, ids_ptr, counts_ptr, lengths_ptr, out_ptr, lse_ptr,
    qk_scale, num_kv_heads, capacity, entries_per_split,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ib, stride_ih, stride_ic,
    stride_cb, stride_ch,
    stride_len,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh, stride_ls,
    arrivals_ptr,  # [B * Hkv] int32 zeros (FUSED_MERGE), left zeroed
    merged_out_ptr, merged_lse_ptr,  # [B, Hq, D], [B, Hq] fp32 (FUSED_MERGE)
    stride_mb, stride_mh, stride_md, stride_mlb, stride_mlh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_TOKENS: tl.constexpr,
    NATIVE_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr, PRECISE_PV: tl.constexpr,
    FUSED_MERGE: tl.constexpr,  # the last split of a row to finish merges the row (no merge launch)
    SPLITS_PAD: tl.constexpr,  # next power of two >= the number of splits (FUSED_MERGE)
    MERGE_GROUP: tl.constexpr,  # next power of two >= GROUP (FUSED_MERGE)
    SPLIT_CHUNK: tl.constexpr,  # splits the merge reads per load (FUSED_MERGE)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    """Attention of one (batch, kv head)'s query group over one split of its block list.

    grid = (num_splits, B * Hkv). Split s covers list entries
    [s * entries_per_split, (s + 1) * entries_per_split) ∩ [0, count). The entries' tokens
    are walked as one flat sequence (entry e, offset o) -> flat e * BLOCK_SIZE + o in tiles
    of TILE_TOKENS rows, so a tile spans several small blocks or part of a large one.
    Writes the split's state to out[b, head, s, :] [B, Hq, S, D] and lse[b, head, s].
    """
    pdl_prologue(PDL)
    split = tl.program_id(0)
    row = tl.program_id(1)
    batch, kv_head, count, length, q, ids_row, k_row, v_row = _group_row(
        row, q_ptr, k_ptr, v_ptr, ids_ptr, counts_ptr, lengths_ptr, num_kv_heads, capacity,
        stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_vb, stride_vh, stride_ib, stride_ih,
        stride_cb, stride_ch, stride_len, GROUP, GROUP_PAD, HEAD_DIM, NATIVE_DOT)
    entry_begin = split * entries_per_split
    entry_end = tl.minimum(entry_begin + entries_per_split, count)

    m, l_sum, acc = _attend_list(q, ids_row, stride_ic, k_row, v_row, stride_kt, stride_kd, stride_vt, stride_vd,
                                 entry_begin, entry_end, capacity, length, qk_scale,
                                 GROUP_PAD, HEAD_DIM, BLOCK_SIZE, TILE_TOKENS, NATIVE_DOT, INPUT_PRECISION, PRECISE_PV)
    _store_split(out_ptr, lse_ptr, batch, kv_head, split, row, m, l_sum, acc,
                 stride_ob, stride_oh, stride_os, stride_od, stride_lb, stride_lh, stride_ls,
                 arrivals_ptr, merged_out_ptr, merged_lse_ptr, stride_mb, stride_mh, stride_md, stride_mlb, stride_mlh,
                 GROUP, GROUP_PAD, HEAD_DIM, FUSED_MERGE, SPLITS_PAD, MERGE_GROUP, SPLIT_CHUNK)


@triton.jit
def sparse_decode_per_block_kernel(
    q_ptr, k_ptr, v_ptr, ids_ptr, counts_ptr, lengths_ptr, out_ptr, lse_ptr,
    qk_scale, num_kv_heads, capacity, entries_per_program,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ib, stride_ih, stride_ic,
    stride_cb, stride_ch,
    stride_len,
    stride_ob, stride_oh, stride_oc, stride_od,
    stride_lb, stride_lh, stride_lc,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SUB_TILE: tl.constexpr,
    NATIVE_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr, PRECISE_PV: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    """One attention state per list entry, for one (batch, kv head)'s query group.
    grid = (ceil(C / entries_per_program), B * Hkv): program (p, row) runs `per_block_program`."""
    pdl_prologue(PDL)
    per_block_program(tl.program_id(0), tl.program_id(1),
                      q_ptr, k_ptr, v_ptr, ids_ptr, counts_ptr, lengths_ptr, out_ptr, lse_ptr,
                      qk_scale, num_kv_heads, capacity, entries_per_program,
                      stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd,
                      stride_vb, stride_vh, stride_vt, stride_vd, stride_ib, stride_ih, stride_ic,
                      stride_cb, stride_ch, stride_len, stride_ob, stride_oh, stride_oc, stride_od,
                      stride_lb, stride_lh, stride_lc,
                      GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, SUB_TILE, NATIVE_DOT, INPUT_PRECISION, PRECISE_PV)


@triton.jit
def per_block_program(
    chunk, row,  # entries [chunk * entries_per_program, ...) of row (batch, kv head) = divmod(row, num_kv_heads)
    q_ptr, k_ptr, v_ptr, ids_ptr, counts_ptr, lengths_ptr, out_ptr, lse_ptr,
    qk_scale, num_kv_heads, capacity, entries_per_program,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ib, stride_ih, stride_ic,
    stride_cb, stride_ch,
    stride_len,
    stride_ob, stride_oh, stride_oc, stride_od,
    stride_lb, stride_lh, stride_lc,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SUB_TILE: tl.constexpr,
    NATIVE_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr, PRECISE_PV: tl.constexpr,
):
    """Writes entries [chunk * entries_per_program, ...) ∩ [0, C) of out [B, Hq, C, D] and
    lse [B, Hq, C] for one (batch, kv head)'s query group: padding entries (>= count) and
    blocks with no live token get lse = -inf, out = 0. A block is walked in SUB_TILE-token
    sub-tiles (SUB_TILE divides BLOCK_SIZE). Also run inside exact selection's q·K launch
    (kernels/exact_jit.py: P's speculation in the same launch)."""
    batch, kv_head, count, length, q, ids_row, k_row, v_row = _group_row(
        row, q_ptr, k_ptr, v_ptr, ids_ptr, counts_ptr, lengths_ptr, num_kv_heads, capacity,
        stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_vb, stride_vh, stride_ib, stride_ih,
        stride_cb, stride_ch, stride_len, GROUP, GROUP_PAD, HEAD_DIM, NATIVE_DOT)
    entry_begin = chunk * entries_per_program
    entry_stop = tl.minimum(entry_begin + entries_per_program, capacity)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, SUB_TILE)

    for entry in range(entry_begin, entry_stop):
        valid = entry < count
        block = tl.load(ids_row + entry * stride_ic).to(tl.int64)  # entry < C: in bounds
        block = tl.where(valid, block, 0)
        limit = tl.where(valid, length, 0)  # padding entries: no live token
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for sub in tl.static_range(0, BLOCK_SIZE, SUB_TILE):
            tokens = block * BLOCK_SIZE + sub + offs_t  # [SUB_TILE]
            live = (tokens >= 0) & (tokens < limit)
            k = _load_kv_tile(k_row, tokens, live, offs_d, stride_kt, stride_kd, NATIVE_DOT)
            v = _load_kv_tile(v_row, tokens, live, offs_d, stride_vt, stride_vd, NATIVE_DOT)
            m, l_sum, acc = _online_softmax_step(q, k, v, live, m, l_sum, acc, qk_scale, NATIVE_DOT, INPUT_PRECISION,
                                             PRECISE_PV)
        _store_state(out_ptr, lse_ptr, batch, kv_head, entry, offs_g, offs_d, m, l_sum, acc,
                     stride_ob, stride_oh, stride_oc, stride_od, stride_lb, stride_lh, stride_lc, GROUP)


@triton.jit
def merge_partials_kernel(
    out_ptr, lse_ptr, keep_ptr, merged_out_ptr, merged_lse_ptr,
    num_partials, head_dim,
    stride_or, stride_on, stride_od,
    stride_lr, stride_ln,
    stride_kr, stride_kn,
    stride_mr, stride_md,
    stride_mlr,
    HAS_KEEP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    """Log-sum-exp merge of one row's N partial states, for one BLOCK_D slice of D.

    grid = (R, cdiv(D, BLOCK_D)). out [R, N, D], lse [R, N], keep [R, N] (uint8, 0 = drop)
    -> merged_out [R, D], merged_lse [R]. Two passes over lse (max, then weights) so no
    loop-carried scalar is rescaled. Every D slice of a row computes the same lse from the
    same data, and all store it (identical values). Dropped and empty partials get weight
    exactly 0 and their `out` is never read (a NaN there cannot leak); all dropped ->
    lse = -inf, out = 0.
    """
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    lse_row = lse_ptr + row * stride_lr
    keep_row = keep_ptr + row * stride_kr
    out_row = out_ptr + row * stride_or

    m_vec = tl.full([BLOCK_N], float("-inf"), tl.float32)
    for n_start in range(0, num_partials, BLOCK_N):
        n = n_start + offs_n
        n_ok = n < num_partials
        lse = tl.load(lse_row + n * stride_ln, mask=n_ok, other=float("-inf")).to(tl.float32)
        if HAS_KEEP:
            keep = tl.load(keep_row + n * stride_kn, mask=n_ok, other=0)
            lse = tl.where(keep != 0, lse, float("-inf"))
        m_vec = tl.maximum(m_vec, lse)
    m = tl.max(m_vec, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)

    w_vec = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for n_start in range(0, num_partials, BLOCK_N):
        n = n_start + offs_n
        n_ok = n < num_partials
        lse = tl.load(lse_row + n * stride_ln, mask=n_ok, other=float("-inf")).to(tl.float32)
        if HAS_KEEP:
            keep = tl.load(keep_row + n * stride_kn, mask=n_ok, other=0)
            lse = tl.where(keep != 0, lse, float("-inf"))
        w = tl.exp(lse - m_safe)  # [BLOCK_N]; 0 for dropped / empty partials
        used = w > 0.0
        o = tl.load(out_row + n[:, None] * stride_on + offs_d[None, :] * stride_od,
                    mask=used[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w[:, None] * o, axis=0)
        w_vec += w
    total = tl.sum(w_vec, axis=0)
    has_mass = total > 0.0
    total_safe = tl.where(has_mass, total, 1.0)
    merged_lse = tl.where(has_mass, m_safe + tl.log(total_safe), float("-inf"))
    tl.store(merged_out_ptr + row * stride_mr + offs_d * stride_md, acc / total_safe, mask=d_ok)
    tl.store(merged_lse_ptr + row * stride_mlr, merged_lse)
