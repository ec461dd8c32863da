"""Launcher for adding each row's newest block to a block list in one launch (checks, grid); the
kernel is in `prr.kernels.append_newest_jit`. reuse=steps between selections attends a layer's
last A plus the newest block: as torch ops (a membership mask over every block of the cache and
a stable sort of it) that was 26 launches per layer inside the captured step, and the step
between selections ran slower than a selecting one (Quest, block 64, K = 8, 32K, H100).

Torch reference: kernels/reference_append_newest.py.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from .append_newest_jit import _append_newest_kernel
from .pdl import launch_kwargs

ID_DTYPES = (torch.int32, torch.int64)


def checked_out(out: tuple[Tensor, Tensor], indices: Tensor, count: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """`append_newest_block`'s out= -> (indices, count) once they can take the result: contiguous int32
    [B, Hkv, width] and [B, Hkv] on the inputs' device, each the input itself or apart from it (a
    program loads its whole row before it stores: in place is safe, a shifted overlap is not)."""
    if not isinstance(out, tuple) or len(out) != 2:
        raise ValueError(f"out must be a tuple (indices, count); got {type(out).__name__}")
    batch, num_kv_heads = indices.shape[:2]
    for name, t, shape, source in (("out[0] (indices)", out[0], (batch, num_kv_heads, width), indices),
                                   ("out[1] (count)", out[1], (batch, num_kv_heads), count)):
        if tuple(t.shape) != shape or t.dtype != torch.int32 or not t.is_contiguous() or t.device != indices.device:
            raise ValueError(f"{name} must be a contiguous int32 {list(shape)} tensor on {indices.device}; got "
                             f"{t.dtype} {tuple(t.shape)} (contiguous={t.is_contiguous()}) on {t.device}")
        if t.data_ptr() == source.data_ptr() and (t.shape != source.shape or t.stride() != source.stride()
                                                  or t.dtype != source.dtype):
            raise ValueError(f"{name} starts where its input does but is not that input ({source.dtype} "
                             f"{tuple(source.shape)} strides {source.stride()}): pass the input itself or a "
                             "separate buffer")
    return out


def append_newest_block(indices: Tensor, count: Tensor, num_blocks: Tensor, width: int,
                        out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """indices [B, Hkv, C] int32 / int64 (distinct block ids in any order, e.g. ascending or a
    predictor's best first; the first count [B, Hkv] valid, the rest any value); num_blocks [B]
    int32 / int64 (>= 1: row b's newest block is num_blocks[b] - 1); width >= C: the output's
    capacity; out: (indices [B, Hkv, width] int32, count [B, Hkv] int32) contiguous to write
    (reuse=steps' static buffers), the inputs themselves (in place) or apart from them.
    -> (A ∪ {newest} [B, Hkv, width] int32 ascending, zero padded; its size [B, Hkv] int32), as
    `append_newest_reference`; `out` when given. A union over width keeps its width smallest ids
    and its true size; not checked on the host (that would sync): callers size width to fit. No
    host sync: it runs inside CUDA-graph capture."""
    if indices.dim() != 3 or indices.dtype not in ID_DTYPES:
        raise ValueError(f"indices must be an int32 or int64 [B, Hkv, C] tensor; got {indices.dtype} "
                         f"{tuple(indices.shape)}")
    batch, num_kv_heads, capacity = indices.shape
    if count.shape != (batch, num_kv_heads) or count.dtype not in ID_DTYPES:
        raise ValueError(f"count must be an int32 or int64 [B, Hkv]=[{batch}, {num_kv_heads}] tensor; got "
                         f"{count.dtype} {tuple(count.shape)}")
    if num_blocks.shape != (batch,) or num_blocks.dtype not in ID_DTYPES:
        raise ValueError(f"num_blocks must be an int32 or int64 [B]=[{batch}] tensor; got {num_blocks.dtype} "
                         f"{tuple(num_blocks.shape)}")
    for name, t in (("count", count), ("num_blocks", num_blocks)):
        if t.device != indices.device:
            raise ValueError(f"{name} is on {t.device}, indices on {indices.device}; put them on one device")
    if not isinstance(width, int) or width < capacity:
        raise ValueError(f"width={width!r} must be an int >= C={capacity} (the output holds A and the newest block)")
    if out is None:
        out_idx = torch.empty(batch, num_kv_heads, width, dtype=torch.int32, device=indices.device)
        out_count = torch.empty(batch, num_kv_heads, dtype=torch.int32, device=indices.device)
    else:
        out_idx, out_count = checked_out(out, indices, count, width)
    if batch == 0 or num_kv_heads == 0:
        return out_idx, out_count
    block = triton.next_power_of_2(capacity + 1)
    _append_newest_kernel[(num_kv_heads, batch)](
        indices, count, num_blocks, out_idx, out_count, num_kv_heads, capacity, width,
        *indices.stride(), *count.stride(),
        BLOCK=block, CHUNK=min(block, 32), BLOCK_OUT=triton.next_power_of_2(max(width, 1)),
        num_warps=4 if block >= 128 else 1, **launch_kwargs(indices.device),
    )  # fmt: skip
    return out_idx, out_count
