"""Launcher for the lightning indexer's index-key append (checks, grid); the kernel is in
`prr.kernels.indexer_keys_jit`, the reference is
`prr.kernels.reference_indexer.index_key_append_reference`.

Index-key cache layout (kernels/reference_indexer.py): keys [B, T_max, d_I] bf16, or
float8_e4m3fn with scales [B, T_max] fp32 (absmax / 448 per token: d_I + 4 bytes a token).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from .indexer_keys_jit import _index_key_append_kernel
from .pdl import launch_kwargs
from .sparse_decode import _check_device

INDEX_KEY_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
NEW_KEY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_INDEX_DIM = 256


def check_index_cache(keys: Tensor, scales: Tensor | None) -> None:
    """Checks of an index-key cache: keys [B, T_max, d_I] bf16 (scales None) or float8_e4m3fn
    with scales [B, T_max] fp32 on the keys' device; d_I a power of two in [16, 256]."""
    if keys.dim() != 3:
        raise ValueError(f"the index keys must be [B, T_max, d_I]; got shape {tuple(keys.shape)}")
    if keys.dtype not in INDEX_KEY_DTYPES:
        raise ValueError(f"the index keys must be bf16 or torch.float8_e4m3fn; got {keys.dtype}")
    index_dim = keys.shape[2]
    if not 16 <= index_dim <= MAX_INDEX_DIM or index_dim & (index_dim - 1):
        raise ValueError(f"d_I={index_dim} must be a power of two in [16, {MAX_INDEX_DIM}] (a tensor-core dot's K)")
    if keys.dtype == torch.bfloat16:
        if scales is not None:
            raise ValueError("bf16 index keys take no scales (scales are for float8_e4m3fn keys): pass None")
        return
    if scales is None:
        raise ValueError("float8_e4m3fn index keys need their per-token scales [B, T_max] fp32; got None")
    if scales.shape != keys.shape[:2] or scales.dtype != torch.float32:
        raise ValueError(f"the scales must be fp32 [B, T_max]={list(keys.shape[:2])}; "
                         f"got {scales.dtype} {tuple(scales.shape)}")
    if scales.device != keys.device:
        raise ValueError(f"the scales are on {scales.device}, the keys on {keys.device}; put them on one device")


def check_per_row(name: str, t: Tensor, batch: int, device: torch.device) -> None:
    """t must be [B] int32/int64 on `device` (per-row positions or lengths)."""
    if t.shape != (batch,) or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32 tensor of shape [B]=[{batch}]; got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the index keys on {device}; put them on one device")


def index_key_append(key_cache: Tensor, key_scales: Tensor | None, k_new: Tensor, positions: Tensor) -> None:
    """Write this step's index key of each row into the cache at positions[b], in place.

    key_cache: [B, T_max, d_I] bf16, or float8_e4m3fn with key_scales [B, T_max] fp32 (None for bf16);
    k_new: [B, d_I] fp16/bf16/fp32; positions: [B] int32/int64 (positions outside [0, T_max) write
    nothing: never checked on the host, that would sync). bf16: k_new rounded to bf16. fp8: quantized
    in the kernel, scale = absmax / 448 and key = k / scale rounded to nearest even, the same bytes
    and scales as reference_indexer.quantize_index_keys_reference. One launch, static shapes, no host
    syncs: it runs inside CUDA graphs.
    """
    check_index_cache(key_cache, key_scales)
    batch, max_tokens, index_dim = key_cache.shape
    if k_new.shape != (batch, index_dim):
        raise ValueError(f"k_new must be [B, d_I]=[{batch}, {index_dim}]; got {tuple(k_new.shape)}")
    if k_new.dtype not in NEW_KEY_DTYPES:
        raise ValueError(f"k_new must be fp16, bf16 or fp32; got {k_new.dtype}")
    _check_device(key_cache, k_new, positions, *([] if key_scales is None else [key_scales]))
    check_per_row("positions", positions, batch, key_cache.device)
    if batch == 0:
        return
    fp8 = key_scales is not None
    scales = key_scales if fp8 else key_cache  # never dereferenced without FP8
    _index_key_append_kernel[(batch,)](
        key_cache, scales, k_new, positions,
        max_tokens, index_dim,
        *key_cache.stride(), *(key_scales.stride() if fp8 else (0, 0)), *k_new.stride(),
        FP8=fp8, BLOCK_D=triton.next_power_of_2(index_dim), num_warps=1 if index_dim <= 128 else 2,
        **launch_kwargs(key_cache.device),
    )  # fmt: skip
