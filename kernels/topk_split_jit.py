"""Triton kernels for split-row block top-K: many programs per (batch row, KV head). Launcher
with checks: `prr.kernels.topk.topk_select(..., split=CHUNK)`; the one-program-per-row kernels
and the jit helpers reused here are in `prr.kernels.topk_jit`.

Phase 1 (`_topk_chunk_kernel`, one program per (row, KV head, chunk)): the row is cut into
C = cdiv(N, CHUNK) chunks; each program keys its chunk exactly as the row kernel keys the row
(`_order_keys`: forced blocks +inf, blocks >= nb and -inf scores invalid) and selects its top
KC = min(k, CHUNK) blocks with the row kernel's radix select (`_select_row`), writing their
block ids, ascending, into a scratch [B * Hkv, C, KC] and their number into [B * Hkv, C].
Phase 2 (`_topk_merge_kernel`, one program per (row, KV head)): the C * KC candidate ids,
chunk after chunk, are re-keyed from the scores (`_order_keys` on the ids: same keys as in
phase 1, no keys stored) and the final top-k selected over them by `_select_row` again,
written in ascending block order, padded with 0, with counts: topk_select's contract.

Why it is exact: valid blocks are totally ordered by (key descending, block id ascending),
the order `prr.blocks.top_blocks` selects by. A block b of the global top-k has fewer than
k blocks before it in that order, so fewer than min(k, CHUNK) of its own chunk: b is in its
chunk's top-KC, and the union of the chunks' top-KC sets holds the whole global top-k. The
top-k of a superset of the top-k (within the valid blocks) is the top-k. Ties: `_select_row`
takes equal keys in lane order, and the candidates sit in ascending block order (chunks
ascending, each chunk's ids ascending), so lane order is block order, as in the full row.
Counts: the candidates hold min(k, #valid) valid blocks at least (a chunk keeps all its
valid blocks unless it keeps k), so min(k, #valid candidates) = min(k, #valid blocks).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_prologue
from .topk_jit import _order_keys, _select_row


@triton.jit
def _topk_chunk_kernel(
    scores_ptr,  # [B, Hkv, N] fp32 (fp16/bf16 are widened exactly)
    num_blocks_ptr,  # [B] int32/int64 blocks in each row's context
    cand_ids_ptr,  # [B * Hkv, C, KC] int32 out: each chunk's selected block ids, ascending, then 0
    cand_counts_ptr,  # [B * Hkv, C] int32 out: valid entries of each chunk
    num_cols,  # N
    num_kv_heads,  # Hkv
    num_chunks,  # C = cdiv(N, CHUNK)
    kc,  # KC = min(k, CHUNK): candidates kept per chunk
    sink_blocks,
    recent_blocks,
    stride_sb, stride_sh, stride_sn,
    CHUNK: tl.constexpr,  # blocks per chunk (a power of two): one chunk lives in registers
    RADIX_BITS: tl.constexpr,
    PAD_BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    chunk = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    num_blocks = tl.minimum(tl.maximum(tl.load(num_blocks_ptr + batch).to(tl.int32), 0), num_cols)
    row_base = batch.to(tl.int64) * stride_sb + kv_head.to(tl.int64) * stride_sh
    slot = (batch * num_kv_heads + kv_head) * num_chunks + chunk  # this chunk's entry of [B * Hkv, C]

    offs = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK] block ids; >= N past the row's end (invalid)
    keys, valid = _order_keys(scores_ptr, row_base, offs, stride_sn, num_blocks, sink_blocks, recent_blocks, num_cols,
                              False)
    # The row kernel's select with k = k_out = KC: ids ascending into cand_ids[slot], count into cand_counts[slot]
    _select_row(keys, valid, offs, kc, kc, slot.to(tl.int64) * kc, slot, cand_ids_ptr, cand_counts_ptr,
                RADIX_BITS, PAD_BLOCK)


@triton.jit
def _topk_merge_kernel(
    scores_ptr,  # [B, Hkv, N] fp32 (re-read at the candidates' ids only)
    num_blocks_ptr,  # [B] int32/int64
    cand_ids_ptr,  # [B * Hkv, C, KC] int32 from _topk_chunk_kernel
    cand_counts_ptr,  # [B * Hkv, C] int32 from _topk_chunk_kernel
    idx_out_ptr,  # [B, Hkv, K_out] int32 contiguous, K_out = min(k, N)
    count_out_ptr,  # [B, Hkv] int32 contiguous
    num_cols,  # N
    num_kv_heads,
    num_chunks,  # C
    kc,  # KC
    k,
    k_out,
    sink_blocks,
    recent_blocks,
    stride_sb, stride_sh, stride_sn,
    BLOCK: tl.constexpr,  # next power of two >= C * KC: all candidates live in registers
    RADIX_BITS: tl.constexpr,
    PAD_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)  # waits for phase 1's stores (a plain launch is stream-ordered anyway)
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    num_blocks = tl.minimum(tl.maximum(tl.load(num_blocks_ptr + batch).to(tl.int32), 0), num_cols)
    row_base = batch.to(tl.int64) * stride_sb + kv_head.to(tl.int64) * stride_sh
    row = batch * num_kv_heads + kv_head

    lane = tl.arange(0, BLOCK)  # [BLOCK] candidate positions: chunk-major, so block ids ascend
    chunk = lane // kc
    in_range = lane < num_chunks * kc
    n_chunk = tl.load(cand_counts_ptr + row * num_chunks + chunk, mask=in_range, other=0)  # [BLOCK]
    live = in_range & (lane - chunk * kc < n_chunk)  # a chunk's entries past its count are padding
    ids = tl.load(cand_ids_ptr + row.to(tl.int64) * num_chunks * kc + lane, mask=live, other=0)  # [BLOCK]
    keys, valid = _order_keys(scores_ptr, row_base, ids, stride_sn, num_blocks, sink_blocks, recent_blocks, num_cols,
                              False)
    valid = valid & live  # dead lanes carry id 0: never a candidate
    keys = tl.where(valid, keys, tl.zeros_like(keys))
    out_row = row.to(tl.int64) * k_out
    _select_row(keys, valid, ids, k, k_out, out_row, row, idx_out_ptr, count_out_ptr, RADIX_BITS, PAD_BLOCK)
