"""Launcher for the lightning indexer's scores (checks, allocation, grid); the kernel is in
`prr.kernels.indexer_score_jit`, the reference is
`prr.kernels.reference_indexer.indexer_scores_reference`, the key append `prr.kernels.indexer_keys`.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from .indexer_keys import check_index_cache, check_per_row
from .indexer_score_jit import _indexer_score_kernel
from .pdl import launch_kwargs
from .sparse_decode import _check_device, _interpreting, _num_sms

QUERY_DTYPES = (torch.bfloat16, torch.float32)
MAX_INDEX_HEADS = 128
DEFAULT_BLOCK_T = 64  # a [64, d_I] key tile: one warpgroup's wgmma M on Hopper
# Programs per SM by default: all resident at once (one wave; compiled for sm_90, the default tile
# takes ~66 KB of shared memory with bf16 keys, ~34 KB with fp8, so 3 resident a SM; 4 a SM would
# leave a partial second wave), each streaming its tiles NUM_STAGES - 1 ahead. Chosen from the compiled
# shared memory, not yet timed: experiments/bench_indexer.py --tune times 1, 2, 4 and 8 a SM.
PROGRAMS_PER_SM = 2


def indexer_scores(
    q: Tensor,
    weights: Tensor,
    keys: Tensor,
    scales: Tensor | None,
    lengths: Tensor,
    *,
    out: Tensor | None = None,
    block_t: int = DEFAULT_BLOCK_T,
    splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> Tensor:
    """The lightning indexer's token scores over the index-key cache, one launch.

    q: [B, H_I, d_I] bf16/fp32 index queries; weights: [B, H_I] fp32 head weights; keys:
    [B, T_max, d_I] bf16 (scales None) or float8_e4m3fn with scales [B, T_max] fp32 (per-token
    absmax / 448, kernels/indexer_keys.py); lengths: [B] int32/int64 valid tokens per row (clamped
    to [0, T_max] in the kernel, never read on the host).
    -> scores [B, T_max] fp32: Σ_h w[b, h] · ReLU(scale[b, t] · (q[b, h] · k[b, t])) for t < lengths[b],
    -inf from lengths[b] on (reference_indexer.indexer_scores_reference).
    Tensor cores: bf16 q is exact; fp32 q is split into two bf16 parts (about 16 significant bits, far
    below the keys' own bf16 / e4m3 rounding); products are exact and accumulate in fp32.
    The result of a token does not depend on B, T_max or `splits` (no cross-tile reduction).
    Tuning: block_t (tokens per tile, a power of two >= 16), splits (programs per row; default
    enough for PROGRAMS_PER_SM programs per SM over the batch, at most one per tile), num_warps,
    num_stages. `out` may be a preallocated [B, T_max] fp32 tensor. No host syncs: CUDA-graph safe.
    """
    check_index_cache(keys, scales)
    batch, max_tokens, index_dim = keys.shape
    if q.dim() != 3 or q.shape[0] != batch or q.shape[2] != index_dim:
        raise ValueError(f"q must be [B, H_I, d_I]=[{batch}, H_I, {index_dim}] (the keys' B and d_I); "
                         f"got {tuple(q.shape)}")
    if q.dtype not in QUERY_DTYPES:
        raise ValueError(f"q must be bf16 or fp32; got {q.dtype}")
    num_heads = q.shape[1]
    if not 1 <= num_heads <= MAX_INDEX_HEADS:
        raise ValueError(f"H_I={num_heads} index heads is not supported: 1 <= H_I <= {MAX_INDEX_HEADS}")
    if weights.shape != (batch, num_heads) or weights.dtype != torch.float32:
        raise ValueError(f"weights must be fp32 [B, H_I]=[{batch}, {num_heads}]; "
                         f"got {weights.dtype} {tuple(weights.shape)}")
    _check_device(keys, q, weights, lengths, *([] if scales is None else [scales]))
    check_per_row("lengths", lengths, batch, keys.device)
    if not isinstance(block_t, int) or block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"block_t={block_t} must be a power of two >= 16 (the tensor-core dot's M)")
    if splits is not None and (not isinstance(splits, int) or splits < 1):
        raise ValueError(f"splits={splits} must be a positive int (programs per row) or None")
    if out is None:
        out = torch.empty(batch, max_tokens, dtype=torch.float32, device=keys.device)
    elif out.shape != (batch, max_tokens) or out.dtype != torch.float32 or out.device != keys.device:
        raise ValueError(f"out must be fp32 [{batch}, {max_tokens}] on {keys.device}; "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    if batch == 0 or max_tokens == 0:
        return out
    tiles = triton.cdiv(max_tokens, block_t)
    if splits is None:
        splits = triton.cdiv(PROGRAMS_PER_SM * _num_sms(keys.device), batch)
    splits = min(splits, tiles)
    fp8 = scales is not None
    _indexer_score_kernel[(splits, batch)](
        q, weights, keys, scales if fp8 else keys, lengths, out,
        max_tokens, num_heads,
        *q.stride(), *weights.stride(), *keys.stride(), *(scales.stride() if fp8 else (0, 0)), *out.stride(),
        FP8=fp8, SPLIT_Q=q.dtype == torch.float32, DOT_FP32=_interpreting(),
        BLOCK_T=block_t, BLOCK_H=max(16, triton.next_power_of_2(num_heads)), HEAD_DIM=index_dim,
        NUM_STAGES=num_stages, num_warps=num_warps,
        **launch_kwargs(keys.device),
    )  # fmt: skip
    return out

