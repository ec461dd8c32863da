"""Launcher for a decode step's lightning-indexer inputs (checks, grid); the kernel is in
`prr.kernels.indexer_step_jit`, the reference is `prr.kernels.reference_indexer.indexer_step_reference`.

A decode step projects each row's normed hidden state x once by the stacked weights
[W_q; W_k; W_w] (prr.selectors.indexer_weights.LayerIndexer.step_weight); this one launch turns
that projection into the step's index queries and head weights (fp32 slots the scores read) and
appends the token's index key to the index-key cache.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .indexer_keys import check_index_cache, check_per_row
from .indexer_score import MAX_INDEX_HEADS
from .indexer_step_jit import _indexer_step_kernel
from .pdl import launch_kwargs
from .sparse_decode import _check_device

PROJECTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def indexer_step_inputs(projection: Tensor, positions: Tensor, inv_freq: Tensor, norm_weight: Tensor,
                        norm_bias: Tensor, eps: float, rope_dim: int, query: Tensor, head_weights: Tensor,
                        key_cache: Tensor, key_scales: Tensor | None) -> None:
    """In place: query [B, H_I, d_I] fp32 <- RoPE(x W_qᵀ); head_weights [B, H_I] fp32 <- x W_wᵀ;
    key_cache[b, positions[b]] <- RoPE(LayerNorm(x W_kᵀ)) (bf16, or fp8 with key_scales as
    kernels.indexer_keys.index_key_append stores it). projection: [B, H_I·d_I + d_I + H_I]
    fp16/bf16/fp32, x [W_q; W_k; W_w]ᵀ; positions [B] int32/int64 (outside [0, T_max): no key
    written); inv_freq [rope_dim // 2] fp32; norm_weight, norm_bias [d_I]; rope_dim even, <= d_I.
    One launch, static shapes, no host syncs: it runs inside CUDA graphs."""
    check_index_cache(key_cache, key_scales)
    batch, max_tokens, index_dim = key_cache.shape
    if query.dim() != 3 or query.shape[0] != batch or query.shape[2] != index_dim or query.dtype != torch.float32:
        raise ValueError(f"query must be fp32 [B, H_I, d_I]=[{batch}, H_I, {index_dim}]; got {query.dtype} "
                         f"{tuple(query.shape)}")
    index_heads = query.shape[1]
    if index_heads > MAX_INDEX_HEADS:
        raise ValueError(f"H_I={index_heads} > the kernel's {MAX_INDEX_HEADS}")
    if head_weights.shape != (batch, index_heads) or head_weights.dtype != torch.float32:
        raise ValueError(f"head_weights must be fp32 [B, H_I]=[{batch}, {index_heads}]; got {head_weights.dtype} "
                         f"{tuple(head_weights.shape)}")
    width = index_heads * index_dim + index_dim + index_heads
    if projection.shape != (batch, width) or projection.dtype not in PROJECTION_DTYPES or projection.stride(1) != 1:
        raise ValueError(f"projection must be [B, H_I*d_I + d_I + H_I]=[{batch}, {width}] fp16/bf16/fp32 with unit "
                         f"stride in its last dim; got {projection.dtype} {tuple(projection.shape)}")
    if rope_dim % 2 or not 0 <= rope_dim <= index_dim:
        raise ValueError(f"rope_dim={rope_dim} must be even and in [0, d_I={index_dim}]")
    if inv_freq.shape != (rope_dim // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq must be fp32 [rope_dim // 2]=[{rope_dim // 2}]; got {inv_freq.dtype} "
                         f"{tuple(inv_freq.shape)}")
    for name, t in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
        if t.shape != (index_dim,) or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [d_I]=[{index_dim}]; got {tuple(t.shape)}")
    if query.stride(2) != 1 or head_weights.stride(1) != 1:
        raise ValueError(f"query and head_weights must have unit stride in their last dim (the kernel's stores); got "
                         f"strides {query.stride()} and {head_weights.stride()}")
    _check_device(key_cache, projection, positions, query, head_weights, norm_weight, norm_bias, inv_freq,
                  *([] if key_scales is None else [key_scales]))
    check_per_row("positions", positions, batch, key_cache.device)
    if batch == 0:
        return
    fp8 = key_scales is not None
    scales = key_scales if fp8 else key_cache  # never dereferenced without FP8
    # (rope_dim 0: inv_freq is empty; another pointer stands in, never read: every lane's load is masked)
    freqs = inv_freq if rope_dim else norm_weight
    _indexer_step_kernel[(batch, index_heads + 1)](
        projection, positions, freqs, norm_weight, norm_bias, query, head_weights, key_cache, scales,
        max_tokens, float(eps),
        projection.stride(0), query.stride(0), query.stride(1), head_weights.stride(0),
        *key_cache.stride(), *(key_scales.stride() if fp8 else (0, 0)),
        INDEX_HEADS=index_heads, INDEX_DIM=index_dim, ROPE_DIM=rope_dim, FP8=fp8,
        num_warps=1 if index_dim <= 128 else 2, **launch_kwargs(key_cache.device),
    )  # fmt: skip
