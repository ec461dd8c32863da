"""PRR's repair and merge in one launch (`repair_and_merge`).

After selection, exact-mode PRR needs three dependent launches: `prr_merge.repair_plan`
(A \\ P compacted, keep = P ∩ A), the repair's split attention over A \\ P, and
`prr_merge.merge_speculation` (kept per-block speculative states ⊕ the repair). On the H200
that tail took 12-13 µs per layer at batch 1 even at a 100% hit rate, most of it launch
latency (bench_decode_stage.csv: PRR minus select ∥ speculate). Here one launch does all three:

- grid = (S, B * Hkv), split s of a row owns A entries [s * E, (s + 1) * E) and P entries
  [s * E_P, (s + 1) * E_P) (the split plan of serial DSA's attention over A, so a 0% hit rate
  parallelises like serial DSA);
- it finds which of its A entries are not in P (compared against the whole P row), compacts
  them into its own slice of a workspace list and attends them (the split kernel's tile loop);
- it finds which of its P entries are in A (keep, also written out for hit counting) and
  folds those speculative states into its own state (online softmax over states);
- the last split of a row to finish merges the row's S states (the arrival counter and tail
  of sparse_decode's fused merge) into the output, in the model dtype.

Token lists (block size 1, selector=indexer) may pass token states instead (part_out=None): P's
scores from token_sparse_decode.token_scores, and step 3 folds each kept token's score with its
value row read from the cache (keep computed first, LIST_CHUNK entries at a time, then the kept
tokens a tile at a time through the attention's own fold): [B, Hq, |P|] scores instead of
[B, Hq, |P|, D] states.

Exact: out = ⊕_{a ∈ A} attention over block a, whatever P is (P's entries not in A are
dropped, A's entries not in P are recomputed), as the three launches give.
A and P need not be sorted; entries must be distinct within a list (as selection and the
predictors produce them). Torch reference: kernels/reference_prr_repair.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import sparse_decode as sd
from .pdl import launch_kwargs, pdl_prologue
from .sparse_decode import (
    MAX_FUSED_MERGE_SPLITS,
    MERGE_TILE_ELEMENTS,
    _check_device,
    _interpreting,
    _next_power_of_two,
    _split_plan,
)
from .sparse_decode_jit import (
    LOG2E,  # host side only: a jit function cannot read a plain global
    _attend_list,
    _load_kv_tile,
    _load_query_group,
    _merge_row_splits,
    _online_softmax_fold,
    _store_state,
)

LIST_CHUNK = 8  # list entries compared against the other list at once ([8, 512] at an 8K budget of 16)
STATE_ELEMENTS = 8192  # fp32 elements of speculative states loaded at once
# Default split plan (H200, bf16, Llama-3.1-8B shape, experiments/bench_decode.py --parts repair_splits): a
# split folds at most this many speculative states (32 per split took 0.70-0.90x the time of 16
# or fewer wherever both were timed) and a row gets at least ceil(SMs / rows) splits (batch 1: 16
# splits of 8 blocks ran 33.99 µs at 128K, block 64, 8K, against 35.87 with serial DSA's 64).
MAX_STATES_PER_SPLIT = 16
# Beyond this many programs per SM the fused tail lost to the three launches (batch 8, 8K budget
# of blocks of 16: 512 P entries per row, 182.8-248.7 µs against 170.4).
MAX_PROGRAMS_PER_SM = 4
TOKEN_TILE = 32  # token states: list entries a tile of the fold and of the repair's attention


@triton.jit
def _keep_entries(pred_row, keep_row, c, p_stop, n_pred, a_all):
    """P entries c [CHUNK] (those < p_stop: this split's) kept = valid (< n_pred) and in A (a_all
    [SEL_PAD], -2 past its count): stored to keep_row[c] as int8 and returned [CHUNK] bool."""
    valid = c < tl.minimum(p_stop, n_pred)
    p = tl.load(pred_row + c, mask=valid, other=-1)  # -1 matches no entry of A
    kept = valid & (tl.max((p[:, None] == a_all[None, :]).to(tl.int32), axis=1) != 0)
    tl.store(keep_row + c, kept.to(tl.int8), mask=c < p_stop)
    return kept


@triton.jit
def _repair_and_merge_kernel(
    q_ptr, k_ptr, v_ptr, sel_ptr, sel_cnt_ptr, pred_ptr, pred_cnt_ptr, lengths_ptr,
    part_out_ptr, part_lse_ptr,  # speculation: [B, Hq, C_P, D], [B, Hq, C_P] fp32
    miss_ptr,  # [B * Hkv, C_A] int32 workspace: each split's misses, compacted in its own slice
    keep_ptr,  # [B * Hkv, C_P] int8 out: P entry valid and in A
    split_out_ptr, split_lse_ptr,  # [B, Hq, S, D], [B, Hq, S] fp32: each split's state
    arrivals_ptr,  # [B * Hkv] int32 zeros, left zeroed
    out_ptr, lse_ptr,  # [B, Hq, D] out dtype, [B, Hq] fp32
    qk_scale, num_kv_heads, sel_cap, pred_cap, entries_per_split, preds_per_split,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_len,
    stride_pob, stride_poh, stride_poc, stride_pod,
    stride_plb, stride_plh, stride_plc,
    stride_sob, stride_soh, stride_sos, stride_sod,
    stride_slb, stride_slh, stride_sls,
    stride_ob, stride_oh, stride_od, stride_olb, stride_olh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_TOKENS: tl.constexpr,
    NATIVE_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr, PRECISE_PV: tl.constexpr,
    SEL_PAD: tl.constexpr, PRED_PAD: tl.constexpr,  # next powers of two >= C_A, C_P
    LIST_CHUNK: tl.constexpr,  # entries of one list compared against the other list at once
    STATE_CHUNK: tl.constexpr,  # speculative states folded in at once
    SPLITS_PAD: tl.constexpr, MERGE_GROUP: tl.constexpr, SPLIT_CHUNK: tl.constexpr,  # the row's merge
    TOKEN_STATES: tl.constexpr,  # P's states are token scores (part_lse only); values from the cache
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    split = tl.program_id(0)
    row = tl.program_id(1)
    batch = (row // num_kv_heads).to(tl.int64)
    kv_head = (row % num_kv_heads).to(tl.int64)
    n_sel = tl.minimum(tl.maximum(tl.load(sel_cnt_ptr + row), 0), sel_cap)
    n_pred = tl.minimum(tl.maximum(tl.load(pred_cnt_ptr + row), 0), pred_cap)
    length = tl.load(lengths_ptr + batch * stride_len).to(tl.int64)
    sel_row = sel_ptr + row.to(tl.int64) * sel_cap
    pred_row = pred_ptr + row.to(tl.int64) * pred_cap
    miss_row = miss_ptr + row.to(tl.int64) * sel_cap
    offs_chunk = tl.arange(0, LIST_CHUNK)

    # 1. This split's A entries that P lacks, compacted into [e0, e0 + n_miss) of the workspace.
    offs_p = tl.arange(0, PRED_PAD)
    p_all = tl.load(pred_row + offs_p, mask=offs_p < n_pred, other=-1)  # [PRED_PAD]; -1 matches no block
    e0 = split * entries_per_split
    e_end = tl.minimum(e0 + entries_per_split, n_sel)
    n_miss = 0
    for c0 in range(e0, e_end, LIST_CHUNK):
        e = c0 + offs_chunk
        ok = e < e_end
        a = tl.load(sel_row + e, mask=ok, other=-2)
        in_p = tl.max((a[:, None] == p_all[None, :]).to(tl.int32), axis=1)
        missed = ok & (in_p == 0)
        slot = n_miss + tl.cumsum(missed.to(tl.int32), axis=0) - 1
        tl.store(miss_row + e0 + slot, a, mask=missed)
        n_miss += tl.sum(missed.to(tl.int32), axis=0)
    tl.debug_barrier()  # the compacted list is read back by every thread of the program

    # 2. Attention over the misses.
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    q = _load_query_group(q_ptr, batch, kv_head, offs_g, offs_d, stride_qb, stride_qh, stride_qd,
                          GROUP, NATIVE_DOT)
    k_row = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_row = v_ptr + batch * stride_vb + kv_head * stride_vh
    m, l_sum, acc = _attend_list(q, miss_row, 1, k_row, v_row, stride_kt, stride_kd, stride_vt, stride_vd,
                                 e0, e0 + n_miss, sel_cap, length, qk_scale,
                                 GROUP_PAD, HEAD_DIM, BLOCK_SIZE, TILE_TOKENS, NATIVE_DOT, INPUT_PRECISION, PRECISE_PV)

    # 3. This split's P entries that A holds: keep, and their states folded into (m, l_sum, acc).
    offs_a = tl.arange(0, SEL_PAD)
    a_all = tl.load(sel_row + offs_a, mask=offs_a < n_sel, other=-2)  # [SEL_PAD]
    heads = kv_head * GROUP + offs_g
    g_ok = offs_g < GROUP
    p0 = split * preds_per_split
    p_stop = tl.minimum(p0 + preds_per_split, pred_cap)  # keep is written up to the capacity
    if TOKEN_STATES:
        # keep first, LIST_CHUNK entries against A at a time (as step 1), then the kept tokens a tile
        # at a time: the stored score, the value row from the cache (the attention's own fold)
        for c0 in range(p0, p_stop, LIST_CHUNK):
            _keep_entries(pred_row, keep_ptr + row.to(tl.int64) * pred_cap, c0 + offs_chunk, p_stop, n_pred, a_all)
        tl.debug_barrier()  # keep is read back by every thread of the program
        offs_t = tl.arange(0, TILE_TOKENS)
        p_end = tl.minimum(p_stop, n_pred)
        for c0 in range(p0, p_end, TILE_TOKENS):
            c = c0 + offs_t
            in_split = c < p_end
            kept = tl.load(keep_ptr + row.to(tl.int64) * pred_cap + c, mask=in_split, other=0) != 0
            tokens = tl.load(pred_row + c, mask=kept, other=-1).to(tl.int64)
            live = kept & (tokens >= 0) & (tokens < length)
            s2 = tl.load(part_lse_ptr + batch * stride_plb + heads[:, None] * stride_plh + c[None, :] * stride_plc,
                         mask=g_ok[:, None] & live[None, :],
                         other=float("-inf")) * 1.4426950408889634  # log2(e): log2 units, as m
            v = _load_kv_tile(v_row, tokens, live, offs_d, stride_vt, stride_vd, NATIVE_DOT)
            m, l_sum, acc = _online_softmax_fold(s2, v, m, l_sum, acc, NATIVE_DOT, INPUT_PRECISION, PRECISE_PV)
    else:
        offs_s = tl.arange(0, STATE_CHUNK)
        for c0 in range(p0, p_stop, STATE_CHUNK):
            c = c0 + offs_s
            kept = _keep_entries(pred_row, keep_ptr + row.to(tl.int64) * pred_cap, c, p_stop, n_pred, a_all)
            live = g_ok[:, None] & kept[None, :]  # [GROUP_PAD, STATE_CHUNK]
            lse2 = tl.load(part_lse_ptr + batch * stride_plb + heads[:, None] * stride_plh + c[None, :] * stride_plc,
                           mask=live, other=float("-inf")) * 1.4426950408889634  # log2(e): log2 units, as m
            m_new = tl.maximum(m, tl.max(lse2, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)  # 0 while m = -inf
            w = tl.exp2(lse2 - m_safe[:, None])  # 0 where dropped or empty
            o = tl.load(part_out_ptr + batch * stride_pob + heads[:, None, None] * stride_poh
                        + c[None, :, None] * stride_poc + offs_d[None, None, :] * stride_pod,
                        mask=(live & (w > 0.0))[:, :, None], other=0.0)  # [GROUP_PAD, STATE_CHUNK, D]
            acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, axis=1)
            l_sum = l_sum * alpha + tl.sum(w, axis=1)
            m = m_new

    # 4. The split's state; the row's last split merges the row.
    _store_state(split_out_ptr, split_lse_ptr, batch, kv_head, split, offs_g, offs_d, m, l_sum, acc,
                 stride_sob, stride_soh, stride_sos, stride_sod, stride_slb, stride_slh, stride_sls, GROUP)
    tl.debug_barrier()  # every thread's stores precede the arrival (release covers them)
    arrived = tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        _merge_row_splits(split_out_ptr, split_lse_ptr, out_ptr, lse_ptr, batch, kv_head, tl.num_programs(0),
                          offs_d, stride_sob, stride_soh, stride_sos, stride_sod, stride_slb, stride_slh, stride_sls,
                          stride_ob, stride_oh, stride_od, stride_olb, stride_olh,
                          GROUP, MERGE_GROUP, HEAD_DIM, SPLITS_PAD, SPLIT_CHUNK)
        tl.store(arrivals_ptr + row, 0)  # re-armed for the next launch (all arrivals are in)


def default_splits(sel_cap: int, pred_cap: int, rows: int, device: torch.device | str) -> int:
    """Splits per row `repair_and_merge` launches by default, for C_A = sel_cap, C_P = pred_cap
    and rows = B * Hkv: at most MAX_STATES_PER_SPLIT speculative states per split, at least one
    program per SM, at most one split per A entry (and the fused merge's limit)."""
    sms = sd._num_sms(torch.device(device))
    wanted = max(-(-pred_cap // MAX_STATES_PER_SPLIT), -(-sms // max(rows, 1)))
    return max(1, min(sel_cap, wanted, MAX_FUSED_MERGE_SPLITS))


def fused_tail_pays(sel_cap: int, pred_cap: int, rows: int, device: torch.device | str) -> bool:
    """Whether the default plan stays within MAX_PROGRAMS_PER_SM programs per SM, where the one
    launch measured faster than the three (StaticPlan.fused_repair="auto")."""
    sms = sd._num_sms(torch.device(device))
    return rows * default_splits(sel_cap, pred_cap, rows, device) <= MAX_PROGRAMS_PER_SM * sms


def repair_and_merge(
    q: Tensor, k_cache: Tensor, v_cache: Tensor,
    sel_idx: Tensor, sel_cnt: Tensor, pred_idx: Tensor, pred_cnt: Tensor, lengths: Tensor,
    part_out: Tensor | None, part_lse: Tensor, block_size: int, scale: float,
    *, out_dtype: torch.dtype = torch.float32, arrivals: Tensor | None = None,
    tokens_per_split: int | None = None, num_warps: int = 4,
) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, Hq, D]; k_cache, v_cache [B, Hkv, T_max, D] (as sparse_decode); A: sel_idx
    [B, Hkv, C_A] int32, sel_cnt [B, Hkv] int32; P: pred_idx [B, Hkv, C_P] int32, pred_cnt
    [B, Hkv] int32; lengths [B]; part_out [B, Hq, C_P, D], part_lse [B, Hq, C_P] fp32: the
    per-block states of P (sparse_decode per_block=True over pred_idx). Token lists (block_size 1)
    may pass part_out=None with part_lse = token_sparse_decode.token_scores over P: a token's state
    is (v_t, part_lse), and each kept token's value row is read from v_cache here.
    arrivals: [B * Hkv] int32 zeros (left zeroed; one per stream), allocated when None.
    tokens_per_split: tokens of A per program; None: `default_splits` (token states: the split plan
    of serial DSA's attention over A, token_sparse_decode's).
    -> (out [B, Hq, D] out_dtype, lse [B, Hq] fp32, keep [B, Hkv, C_P] bool): out, lse =
    attention over A's blocks = (⊕ kept states of P) ⊕ attention over A \\ P."""
    token_states = part_out is None
    _check_device(q, k_cache, v_cache, sel_idx, sel_cnt, pred_idx, pred_cnt, lengths, part_lse,
                  *(() if token_states else (part_out,)))
    batch, num_heads, head_dim = q.shape
    if k_cache.dim() != 4 or k_cache.shape[0] != batch or k_cache.shape[-1] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} and the caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} "
                         f"do not fit [B, Hq, D] and [B, Hkv, T_max, D]")
    if head_dim not in sd.SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim D={head_dim} is not supported; supported: {sd.SUPPORTED_HEAD_DIMS}")
    num_kv_heads = k_cache.shape[1]
    if num_kv_heads == 0 or num_heads % num_kv_heads or num_heads // num_kv_heads > sd.MAX_GROUP:
        raise ValueError(f"Hq={num_heads} must be a multiple of Hkv={num_kv_heads}, at most {sd.MAX_GROUP} per KV head")
    if type(block_size) is not int or block_size != 1:  # 1: token lists (selector=indexer)
        sd._check_block_size(block_size)
    if token_states and block_size != 1:
        raise ValueError(f"part_out=None (token states: values read from the cache) needs block_size 1, got {block_size}")
    sel_cap, pred_cap = sel_idx.shape[-1], pred_idx.shape[-1]
    for name, t, shape in (("sel_idx", sel_idx, (batch, num_kv_heads, sel_cap)), ("sel_cnt", sel_cnt, (batch, num_kv_heads)),
                           ("pred_idx", pred_idx, (batch, num_kv_heads, pred_cap)),
                           ("pred_cnt", pred_cnt, (batch, num_kv_heads))):
        if t.dtype != torch.int32 or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 tensor of shape {shape}; got {t.dtype} {tuple(t.shape)}")
    sd._check_int_tensor("lengths", lengths, (batch,), (torch.int32, torch.int64))
    if part_lse.shape != (batch, num_heads, pred_cap) or part_lse.dtype != torch.float32 or not token_states and (
            part_out.shape != (batch, num_heads, pred_cap, head_dim) or part_out.dtype != torch.float32):
        raise ValueError(f"part_out / part_lse must be fp32 [B, Hq, C_P, D] / [B, Hq, C_P] = "
                         f"{(batch, num_heads, pred_cap, head_dim)}; got "
                         f"{'None' if token_states else (part_out.dtype, tuple(part_out.shape))} / "
                         f"{part_lse.dtype} {tuple(part_lse.shape)}")
    if out_dtype not in sd.SUPPORTED_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} is not supported; use one of fp16, bf16, fp32")
    if sel_cap < 1:
        raise ValueError("sel_idx has no entries (C_A = 0): nothing to select, nothing to repair")

    device = q.device
    group = num_heads // num_kv_heads
    rows = batch * num_kv_heads
    if tokens_per_split is None and not token_states:
        tokens_per_split = block_size * -(-sel_cap // default_splits(sel_cap, pred_cap, rows, device))
    # Token states: tiles of 32 tokens (compiled for sm_90 at 2,048-entry lists, tile 128 spilled 368 B a
    # thread, tile 32 none; not timed yet). Blocks: the split plan's tile.
    tile_tokens, entries, num_splits = _split_plan(sel_cap, rows, block_size, head_dim, k_cache.element_size(),
                                                   TOKEN_TILE if token_states else None, tokens_per_split, device)
    if num_splits > MAX_FUSED_MERGE_SPLITS:
        raise ValueError(f"repair_and_merge merges {num_splits} splits per row in an unrolled tail of at most "
                         f"{MAX_FUSED_MERGE_SPLITS}: raise tokens_per_split (the engine's "
                         f"runtime repair_tokens_per_split; now {tokens_per_split}) or lower A's capacity ({sel_cap})")
    preds_per_split = max(1, -(-pred_cap // num_splits))
    split_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    split_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=device)
    out = torch.empty(batch, num_heads, head_dim, dtype=out_dtype, device=device)
    lse = torch.empty(batch, num_heads, dtype=torch.float32, device=device)
    keep = torch.empty(batch, num_kv_heads, pred_cap, dtype=torch.bool, device=device)
    miss = torch.empty(rows, sel_cap, dtype=torch.int32, device=device)
    arrivals = sd.arrival_counters(arrivals, rows, device)
    if rows == 0:
        return out, lse, keep
    native_ok = q.dtype == k_cache.dtype and k_cache.dtype in (torch.float16, torch.bfloat16)
    native_dot = native_ok and not (_interpreting() and k_cache.dtype == torch.bfloat16)
    group_pad = max(16, _next_power_of_two(group))
    merge_group = _next_power_of_two(group)
    pred_pad = _next_power_of_two(max(pred_cap, 2))
    _repair_and_merge_kernel[(num_splits, rows)](
        q, k_cache, v_cache, sel_idx, sel_cnt, pred_idx, pred_cnt, lengths,
        part_lse if token_states else part_out, part_lse, miss, keep.view(torch.int8), split_out, split_lse,
        arrivals, out, lse,
        float(scale) * LOG2E, num_kv_heads, sel_cap, pred_cap, entries, preds_per_split,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), lengths.stride(0),
        *((0,) * 4 if token_states else part_out.stride()), *part_lse.stride(), *split_out.stride(),
        *split_lse.stride(),
        *out.stride(), *lse.stride(),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, TILE_TOKENS=tile_tokens,
        NATIVE_DOT=bool(native_dot), INPUT_PRECISION="ieee" if torch.float32 in (q.dtype, k_cache.dtype) else "tf32",
        PRECISE_PV=True, SEL_PAD=_next_power_of_two(max(sel_cap, 2)), PRED_PAD=pred_pad, LIST_CHUNK=LIST_CHUNK,
        STATE_CHUNK=max(1, min(_next_power_of_two(preds_per_split), STATE_ELEMENTS // (group_pad * head_dim))),
        SPLITS_PAD=_next_power_of_two(num_splits), MERGE_GROUP=merge_group,
        SPLIT_CHUNK=min(_next_power_of_two(num_splits), max(1, MERGE_TILE_ELEMENTS // (merge_group * head_dim))),
        TOKEN_STATES=token_states, num_warps=num_warps, **launch_kwargs(device),
    )  # fmt: skip
    return out, lse, keep
