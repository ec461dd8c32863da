"""Launcher for keeping a layer's A in reuse=steps' static buffers in one launch (checks, grid); the
kernel is in `prr.kernels.keep_selection_jit`. A selecting step of a reuse=steps run copies each
layer's A, count and scores into the buffers the step between selections reads: as torch ops that
was four launches per layer (the ids, their zero padding, the count, the scores; ~5.7 µs a layer in
a CUDA graph, Quest, block 64, K = 8, 32K, H100), and a selecting step ran 2.8% over serial DSA.

Torch reference: kernels/reference_keep_selection.py.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from .keep_selection_jit import _keep_selection_kernel
from .pdl import launch_kwargs

ID_DTYPES = (torch.int32, torch.int64)
SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_SCORES = 1024


def _check_out(name: str, t: Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """An output buffer: `shape`, `dtype`, contiguous (the kernel writes rows of it by position), on `device`."""
    if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != device:
        raise ValueError(f"{name} must be a contiguous {dtype} {list(shape)} tensor on {device}; got "
                         f"{t.dtype} {tuple(t.shape)} (contiguous={t.is_contiguous()}) on {t.device}")


def keep_selection(indices: Tensor, count: Tensor, scores: Tensor | None, out_indices: Tensor, out_count: Tensor,
                   out_scores: Tensor | None) -> None:
    """indices [B, Hkv, C] int32 / int64 (copied as they are, padding past count included) ->
    out_indices [B, Hkv, width] int32 (zeros past C; width >= C); count [B, Hkv] int32 / int64 ->
    out_count [B, Hkv] int32; scores [B, Hkv, NB] fp32 / bf16 / fp16 -> out_scores [B, Hkv, NB]
    fp32 (None: skipped, out_scores may be None). Outputs contiguous, apart from the inputs; in
    place, as `keep_selection_reference`. No host sync: it runs inside CUDA-graph capture."""
    if indices.dim() != 3 or indices.dtype not in ID_DTYPES:
        raise ValueError(f"indices must be an int32 or int64 [B, Hkv, C] tensor; got {indices.dtype} "
                         f"{tuple(indices.shape)}")
    batch, num_kv_heads, capacity = indices.shape
    device = indices.device
    if count.shape != (batch, num_kv_heads) or count.dtype not in ID_DTYPES or count.device != device:
        raise ValueError(f"count must be an int32 or int64 [B, Hkv]=[{batch}, {num_kv_heads}] tensor on {device}; "
                         f"got {count.dtype} {tuple(count.shape)} on {count.device}")
    if out_indices.dim() != 3 or out_indices.shape[-1] < capacity:
        raise ValueError(f"out_indices' width must be >= C={capacity} (it holds A, then zeros); got "
                         f"{tuple(out_indices.shape)}")
    width = out_indices.shape[-1]
    _check_out("out_indices", out_indices, (batch, num_kv_heads, width), torch.int32, device)
    _check_out("out_count", out_count, (batch, num_kv_heads), torch.int32, device)
    num_scores = 0
    if scores is not None:
        if scores.dim() != 3 or scores.shape[:2] != (batch, num_kv_heads) or scores.dtype not in SCORE_DTYPES \
                or scores.device != device:
            raise ValueError(f"scores must be a float [B, Hkv, NB]=[{batch}, {num_kv_heads}, NB] tensor on {device} "
                             f"(or None: not kept); got {scores.dtype} {tuple(scores.shape)} on {scores.device}")
        if out_scores is None:
            raise ValueError("scores were given without out_scores: pass the buffer they are kept in")
        num_scores = scores.shape[-1]
        _check_out("out_scores", out_scores, tuple(scores.shape), torch.float32, device)
    if batch == 0 or num_kv_heads == 0:
        return
    src_scores = scores if scores is not None else out_indices  # (a pointer the kernel does not read)
    _keep_selection_kernel[(num_kv_heads, batch)](
        indices, count, src_scores, out_indices, out_count, out_scores if scores is not None else out_indices,
        num_kv_heads, capacity, width, num_scores,
        *indices.stride(), *count.stride(), *(scores.stride() if scores is not None else (0, 0, 0)),
        BLOCK_OUT=triton.next_power_of_2(max(width, 1)),
        BLOCK_SCORES=min(BLOCK_SCORES, triton.next_power_of_2(max(num_scores, 1))), HAS_SCORES=scores is not None,
        num_warps=4, **launch_kwargs(device),
    )  # fmt: skip
