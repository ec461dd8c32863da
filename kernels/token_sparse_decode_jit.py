"""Triton device code for decode attention over TOKEN lists (one id per token, not per block).

Launcher, input checks and the shapes at the Python boundary: kernels/token_sparse_decode.py.
Everything but the walk over the list is the block kernel's (kernels/sparse_decode_jit.py): the
row prologue (_group_row: count, length, query group, row pointers), the K/V row gather, the
online-softmax step and the split tail (_store_split: the state store and the fused merge) are
imported from there, so the two kernels share their numerics and conventions
(scores in log2 units inside, lse stored as a natural log; empty set -> lse = -inf, out = 0).

GQA: query head `kv_head * GROUP + g` attends KV head `kv_head`; a program loads its KV head's
GROUP query rows (padded to GROUP_PAD >= 16 for tl.dot) so each gathered K/V row is read once
for the whole group.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_prologue
from .sparse_decode_jit import _group_row, _load_kv_tile, _online_softmax_step, _store_split


@triton.jit
def _attend_token_list(
    q, ids_row, stride_ic, k_row, v_row, stride_kt, stride_kd, stride_vt, stride_vd,
    begin, end, capacity, length, qk_scale,
    GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, TILE_TOKENS: tl.constexpr,
    NATIVE_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr, PRECISE_PV: tl.constexpr,
):
    """Online softmax of q [GROUP_PAD, D] over the tokens named by list entries [begin, end) of
    ids_row (a list of `capacity` token ids; ids < 0 or >= length are masked) -> (m, l_sum, acc),
    the running state of _online_softmax_step. Tiles of TILE_TOKENS entries: each tile's ids are
    loaded one tile ahead, so the dependent id -> K/V load chain costs one id latency per
    program, not one per tile."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, TILE_TOKENS)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    # The first tile's ids are masked by the capacity only: the load does not wait for the count
    # (both written by the kernel before), so the two reads overlap; entries >= end are masked below.
    ahead = begin + offs_t
    ids_ahead = tl.load(ids_row + ahead * stride_ic, mask=ahead < capacity, other=-1)
    for start in range(begin, end, TILE_TOKENS):
        entry = start + offs_t  # [TILE]
        tokens = ids_ahead.to(tl.int64)
        ahead = entry + TILE_TOKENS
        ids_ahead = tl.load(ids_row + ahead * stride_ic, mask=ahead < end, other=-1)
        live = (entry < end) & (tokens >= 0) & (tokens < length)
        k = _load_kv_tile(k_row, tokens, live, offs_d, stride_kt, stride_kd, NATIVE_DOT)
        v = _load_kv_tile(v_row, tokens, live, offs_d, stride_vt, stride_vd, NATIVE_DOT)
        m, l_sum, acc = _online_softmax_step(q, k, v, live, m, l_sum, acc, qk_scale, NATIVE_DOT, INPUT_PRECISION,
                                             PRECISE_PV)
    return m, l_sum, acc


@triton.jit
def token_sparse_decode_split_kernel(
    q_ptr, k_ptr, v_ptr, ids_ptr, counts_ptr, lengths_ptr, out_ptr, lse_ptr,
    qk_scale, num_kv_heads, capacity, entries_per_split,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ib, stride_ih, stride_ic,  # stride_ih = 0: one list shared by every KV head
    stride_cb, stride_ch,  # stride_ch = 0 likewise
    stride_len,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh, stride_ls,
    arrivals_ptr,  # [B * Hkv] int32 zeros (FUSED_MERGE), left zeroed
    merged_out_ptr, merged_lse_ptr,  # [B, Hq, D], [B, Hq] (FUSED_MERGE)
    stride_mb, stride_mh, stride_md, stride_mlb, stride_mlh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, TILE_TOKENS: tl.constexpr,
    NATIVE_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr, PRECISE_PV: tl.constexpr,
    FUSED_MERGE: tl.constexpr,  # the last split of a row to finish merges the row (no merge launch)
    SPLITS_PAD: tl.constexpr,  # next power of two >= the number of splits (FUSED_MERGE)
    MERGE_GROUP: tl.constexpr,  # next power of two >= GROUP (FUSED_MERGE)
    SPLIT_CHUNK: tl.constexpr,  # splits the merge reads per load (FUSED_MERGE)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    """Attention of one (batch, kv head)'s query group over one split of its token list.

    grid = (num_splits, B * Hkv). Split s covers list entries
    [s * entries_per_split, (s + 1) * entries_per_split) ∩ [0, count), walked in tiles of
    TILE_TOKENS gathered K/V rows. Writes the split's state to out[b, head, s, :] [B, Hq, S, D]
    and lse[b, head, s] (S = 1 with stride 0 when the launch has a single split).
    """
    pdl_prologue(PDL)
    split = tl.program_id(0)
    row = tl.program_id(1)
    batch, kv_head, count, length, q, ids_row, k_row, v_row = _group_row(
        row, q_ptr, k_ptr, v_ptr, ids_ptr, counts_ptr, lengths_ptr, num_kv_heads, capacity,
        stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_vb, stride_vh, stride_ib, stride_ih,
        stride_cb, stride_ch, stride_len, GROUP, GROUP_PAD, HEAD_DIM, NATIVE_DOT)
    begin = split * entries_per_split
    end = tl.minimum(begin + entries_per_split, count)

    m, l_sum, acc = _attend_token_list(q, ids_row, stride_ic, k_row, v_row, stride_kt, stride_kd, stride_vt,
                                       stride_vd, begin, end, capacity, length, qk_scale,
                                       GROUP_PAD, HEAD_DIM, TILE_TOKENS, NATIVE_DOT, INPUT_PRECISION, PRECISE_PV)
    _store_split(out_ptr, lse_ptr, batch, kv_head, split, row, m, l_sum, acc,
                 stride_ob, stride_oh, stride_os, stride_od, stride_lb, stride_lh, stride_ls,
                 arrivals_ptr, merged_out_ptr, merged_lse_ptr, stride_mb, stride_mh, stride_md, stride_mlb, stride_mlh,
                 GROUP, GROUP_PAD, HEAD_DIM, FUSED_MERGE, SPLITS_PAD, MERGE_GROUP, SPLIT_CHUNK)


@triton.jit
def token_scores_kernel(
    q_ptr, k_ptr, ids_ptr, counts_ptr, lengths_ptr, scores_ptr,
    scale, num_kv_heads, capacity, entries_per_program,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_ib, stride_ih, stride_ic,
    stride_cb, stride_ch,
    stride_len,
    stride_sb, stride_sh, stride_sc,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, TILE_TOKENS: tl.constexpr,
    NATIVE_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """scale · q·k of one (batch, kv head)'s query group against the tokens of one chunk of its list.

    grid = (ceil(C / entries_per_program), B * Hkv). Writes scores[b, head, e] for every entry e of
    the chunk up to the capacity C: the natural-log score of a live entry (e < count, 0 <= id <
    length), -inf for every other. K rows only: a token's value row stays in the cache.
    """
    pdl_prologue(PDL)
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    # _group_row's v pointer is unused here: k_ptr and its strides stand in for it
    batch, kv_head, count, length, q, ids_row, k_row, _ = _group_row(
        row, q_ptr, k_ptr, k_ptr, ids_ptr, counts_ptr, lengths_ptr, num_kv_heads, capacity,
        stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kb, stride_kh, stride_ib, stride_ih,
        stride_cb, stride_ch, stride_len, GROUP, GROUP_PAD, HEAD_DIM, NATIVE_DOT)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, TILE_TOKENS)
    heads = kv_head * GROUP + offs_g
    begin = chunk * entries_per_program
    end = tl.minimum(begin + entries_per_program, capacity)
    for start in range(begin, end, TILE_TOKENS):
        entry = start + offs_t
        listed = entry < tl.minimum(end, count)
        tokens = tl.load(ids_row + entry * stride_ic, mask=listed, other=-1).to(tl.int64)
        live = listed & (tokens >= 0) & (tokens < length)
        k = _load_kv_tile(k_row, tokens, live, offs_d, stride_kt, stride_kd, NATIVE_DOT)
        if NATIVE_DOT:
            s = tl.dot(q, tl.trans(k))
        else:
            s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        s = tl.where(live[None, :], s * scale, float("-inf"))  # [GROUP_PAD, TILE]
        tl.store(scores_ptr + batch * stride_sb + heads[:, None] * stride_sh + entry[None, :] * stride_sc, s,
                 mask=(offs_g < GROUP)[:, None] & (entry < end)[None, :])
