"""Launchers for InfLLM-v2's selection kernels (checks, allocation, grid); the kernels are in
`prr.kernels.infllm_v2_jit`, the torch references (the definitions) in
`prr.kernels.reference_infllm_v2`.

Layout is prr's (`InfLLMV2Selector`): compressed keys [B, Hkv, W, D] in the cache's dtype, window w
at index w (W = 4 * NB_max); query head h belongs to KV head h // G, as in `q.view(B, Hkv, G, D)`.
"""

from __future__ import annotations

import math

import torch
import triton
from torch import Tensor

from .infllm_v2_jit import _compress_append_kernel, _lse_kernel, _pool_kernel
from .reference_infllm_v2 import BLOCK, STRIDE, WINDOW
from .sparse_decode import _interpreting

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
# The lse pass's default tiling (experiments/profile_infllm_v2.py --sweep on an H100, 2026-12-07:
# experiments/results/h100/session5_20261207/profile_infllm_v2.md): ranges of windows per row and KV head (the pool pass merges their
# partials in registers), windows per tile, warps, tl.dot or FMA chunks.
MAX_SPLITS = 64
BLOCK_W = 32
LSE_WARPS = 4
DOT = True
BLOCK_N = 32  # blocks per program of the pool pass


def _check(compressed: Tensor, per_row: Tensor, name: str) -> None:
    if compressed.dim() != 4 or compressed.dtype not in FLOAT_DTYPES:
        raise ValueError(f"compressed must be a float [B, Hkv, W, D] tensor; got {compressed.dtype} "
                         f"{tuple(compressed.shape)}")
    if not 1 <= compressed.shape[3] <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim={compressed.shape[3]} is not supported: the kernels take 1 <= D <= {MAX_HEAD_DIM}")
    if per_row.shape != (compressed.shape[0],) or per_row.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32 or int64 tensor of shape [B]=[{compressed.shape[0]}]; "
                         f"got {per_row.dtype} {tuple(per_row.shape)}")
    if per_row.device != compressed.device:
        raise ValueError(f"{name} is on {per_row.device}, the compressed keys on {compressed.device}")


def infllm_v2_compress_append(compressed: Tensor, keys: Tensor, positions: Tensor) -> None:
    """One token per row was appended at positions [B] (device ints): the window it completes
    (when (p + 1) % 16 == 0 and p >= 31: window (p + 1 - 32) / 16) gets the mean of its 32 keys,
    in place. compressed [B, Hkv, W, D]; keys [B, Hkv, T, D] the cache's, holding the token.
    Equals `reference_infllm_v2.compress_append_reference` (fp32 means, stored in compressed's dtype)."""
    _check(compressed, positions, "positions")
    b, h, w_max, d = compressed.shape
    if keys.dim() != 4 or keys.shape[:2] != (b, h) or keys.shape[3] != d or keys.device != compressed.device:
        raise ValueError(f"keys must be [B, Hkv, T, D]=[{b}, {h}, T, {d}] on {compressed.device}; "
                         f"got {tuple(keys.shape)} on {keys.device}")
    if b == 0 or h == 0 or w_max == 0:
        return
    _compress_append_kernel[(h, b)](
        compressed, keys, positions, w_max, d, *compressed.stride(), *keys.stride(),
        WINDOW=WINDOW, STRIDE=STRIDE, BLOCK_D=triton.next_power_of_2(d), num_warps=1 if d <= 128 else 2,
    )


def infllm_v2_score(q: Tensor, compressed: Tensor, lengths: Tensor, max_blocks: int,
                    scale: float | None = None, *, block_w: int = BLOCK_W, max_splits: int = MAX_SPLITS,
                    num_warps: int = LSE_WARPS, dot: bool = DOT) -> Tensor:
    """InfLLM-v2's block scores S_cmp: q [B, Hq, D] (post-RoPE), compressed [B, Hkv, W, D], lengths
    [B] int32 tokens per row -> [B, Hkv, max_blocks] fp32: per block of 64 tokens, the max over the
    complete windows overlapping it of the group's summed softmax probabilities (scale 1/sqrt(D) by
    default); 0 for a block with none complete, -inf past the context. Two launches (the lse pass
    over split window ranges, storing each head's logits, then the pooled scores from those logits);
    equals `infllm_v2_score_reference` up to fp32 summation order. block_w (windows per tile),
    max_splits (window ranges, one program each per row and KV head), num_warps and dot (tl.dot
    or fp32 FMA chunks) are the lse pass's tiling (experiments/profile_infllm_v2.py sweeps them)."""
    _check(compressed, lengths, "lengths")
    b, h, w_max, d = compressed.shape
    if q.dim() != 3 or q.shape[0] != b or q.shape[2] != d or q.shape[1] % h or q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be a float [B, Hq, D] tensor with B={b}, D={d} and Hq a multiple of Hkv={h}; "
                         f"got {q.dtype} {tuple(q.shape)}")
    if q.device != compressed.device:
        raise ValueError(f"q is on {q.device}, the compressed keys on {compressed.device}")
    out = torch.empty(b, h, max_blocks, dtype=torch.float32, device=q.device)
    if b == 0 or h == 0 or max_blocks == 0:
        return out
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if block_w < 16 or block_w & (block_w - 1) or max_splits < 1:
        raise ValueError(f"block_w={block_w} must be a power of two >= 16 and max_splits={max_splits} >= 1")
    group = q.shape[1] // h
    group_pad = max(16, triton.next_power_of_2(group)) if dot else triton.next_power_of_2(group)
    # 16-bit operands enter tl.dot as they are, except bf16 under the interpreter (its bf16 arithmetic is wrong)
    native_dot = q.dtype == compressed.dtype and q.dtype != torch.float32 and not (
        _interpreting() and q.dtype == torch.bfloat16)
    block_d = max(16, triton.next_power_of_2(d)) if dot else triton.next_power_of_2(d)  # (tl.dot: K >= 16)
    d_chunk = min(32, block_d)
    tiles = triton.cdiv(max(w_max, 1), block_w)
    splits = min(max_splits, tiles)
    per_split = triton.cdiv(tiles, splits) * block_w
    splits = triton.cdiv(max(w_max, 1), per_split)
    part_max = torch.empty(b, h, splits, group_pad, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    logits = torch.empty(b, h, group, w_max, dtype=torch.float32, device=q.device)  # each window's, once
    common = dict(GROUP=group, GROUP_PAD=group_pad, WINDOW=WINDOW, STRIDE=STRIDE)
    _lse_kernel[(splits, h, b)](
        q, compressed, lengths, part_max, part_sum, logits, w_max, d, scale, splits, *q.stride(), *compressed.stride(),
        WINDOWS_PER_SPLIT=per_split, BLOCK_W=block_w, BLOCK_D=block_d, D_CHUNK=d_chunk, DOT=dot,
        NATIVE_DOT=native_dot, **common, num_warps=num_warps,
    )
    _pool_kernel[(triton.cdiv(max_blocks, BLOCK_N), h, b)](
        lengths, part_max, part_sum, logits, out, w_max, max_blocks, splits, *out.stride(),
        BLOCK=BLOCK, SPLITS_PAD=triton.next_power_of_2(splits), BLOCK_N=BLOCK_N, **common, num_warps=4,
    )
    return out
