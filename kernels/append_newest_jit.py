"""Triton kernel adding each row's newest block to its block list (reuse=steps between
selections): one program per (KV head, row) loads the row's C ids, tests whether the newest block
is among the valid ones, and writes the union ascending by rank counting (an id's position is the
number of smaller ids in the union: ids are distinct), then the zero padding; the row is loaded
whole before the first store, so the output may be the input (in place). Launcher:
`prr.kernels.append_newest`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_prologue

ABSENT = tl.constexpr(2**31 - 1)  # the key of an empty candidate slot: sorts past every block id


@triton.jit
def _candidates(row_ptr, offs, count, capacity, stride_ic, newest, newest_absent):
    """Candidate keys at slots `offs` of the row's C + 1: slot i < count holds A's i-th id, slot C
    the newest block unless A holds it, every other slot ABSENT (int32)."""
    in_a = (offs < capacity) & (offs < count)
    ids = tl.load(row_ptr + offs * stride_ic, mask=in_a, other=0).to(tl.int32)
    keys = tl.where(in_a, ids, ABSENT)
    return tl.where((offs == capacity) & newest_absent, newest, keys)


@triton.jit
def _append_newest_kernel(
    idx_ptr,  # [B, Hkv, C] int32 / int64: A's ids, distinct, any order; past count padding
    count_ptr,  # [B, Hkv] int32 / int64
    num_blocks_ptr,  # [B] int32 / int64: row b's newest block is num_blocks[b] - 1
    out_idx_ptr,  # [B, Hkv, W] int32 contiguous: the union ascending, zero padded
    out_count_ptr,  # [B, Hkv] int32 contiguous
    num_kv_heads,  # Hkv
    capacity,  # C
    width,  # W
    stride_ib, stride_ih, stride_ic,
    stride_cb, stride_ch,
    BLOCK: tl.constexpr,  # next power of two >= C + 1: A's slots and the newest's
    CHUNK: tl.constexpr,  # candidates compared against all at a time (BLOCK x CHUNK in registers)
    BLOCK_OUT: tl.constexpr,  # next power of two >= W
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    head = tl.program_id(0)
    batch = tl.program_id(1)
    row_ptr = idx_ptr + batch.to(tl.int64) * stride_ib + head.to(tl.int64) * stride_ih
    count = tl.load(count_ptr + batch * stride_cb + head * stride_ch).to(tl.int32)
    newest = tl.load(num_blocks_ptr + batch).to(tl.int32) - 1
    offs = tl.arange(0, BLOCK)
    in_a = (offs < capacity) & (offs < count)
    ids = tl.load(row_ptr + offs * stride_ic, mask=in_a, other=0).to(tl.int32)
    newest_absent = tl.sum(((ids == newest) & in_a).to(tl.int32), axis=0) == 0
    keys = _candidates(row_ptr, offs, count, capacity, stride_ic, newest, newest_absent)  # [BLOCK]
    # rank = how many candidates are smaller (ABSENT is smaller than none): the slot in ascending order
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    for start in tl.static_range(0, BLOCK, CHUNK):
        others = _candidates(row_ptr, start + tl.arange(0, CHUNK), count, capacity, stride_ic, newest, newest_absent)
        rank += tl.sum((others[None, :] < keys[:, None]).to(tl.int32), axis=1)
    present = keys != ABSENT
    size = tl.sum(present.to(tl.int32), axis=0)
    out_row = out_idx_ptr + (batch * num_kv_heads + head).to(tl.int64) * width
    # out may be the input (reuse=steps' buffer, in place): every thread's loads of the row precede any store
    tl.debug_barrier()
    # ranks of the union are 0..size-1, the padding size..W-1: the two stores never meet
    tl.store(out_row + rank, keys, mask=present & (rank < width))
    pad = tl.arange(0, BLOCK_OUT)
    tl.store(out_row + pad, tl.zeros([BLOCK_OUT], dtype=tl.int32), mask=(pad >= size) & (pad < width))
    tl.store(out_count_ptr + batch * num_kv_heads + head, size)
