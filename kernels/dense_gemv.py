"""Launcher for the fused decode projections (checks, grid, tile sizes); the kernel is in
`prr.kernels.dense_gemv_jit`. The math is prr.model.layer_math's:

    norm_weight given:  y = F.linear(rms_norm(x, norm_weight, eps), weight, bias)
    swiglu:             y = silu(gate) * up,  [gate | up] = that projection's two halves
    residual given:     residual += y  (in place; the residual stream of a decoder layer)

except that the RMSNorm's 1 / rms factor scales the dot products instead of each input (one
pass over x; the reference rounds the normalised x to the model dtype first: the two agree to
the model dtype's rounding).
"""

from __future__ import annotations

import os

import torch
import triton
from torch import Tensor

from .dense_gemv_jit import _dense_gemv_kernel, _dense_rows_kernel
from .pdl import launch_kwargs

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# (BLOCK_N, BLOCK_K, num_warps) that measured fastest at batch 1 on the H200 per
# (out_features, in_features, swiglu) of the Llama-3.1-8B shape (experiments/bench_gemv.py,
# results/h200/bench_gemv.csv: 40 tile configs per shape). Tiles that suit one shape can be 2x
# slower on another (gate_up at (4, 1024, 4): 110 µs against 60), hence a table. (A persistent
# GEMV, programs walking several row tiles, was tried for o_proj and lm_head and removed: 304 µs
# for lm_head in bench_gemv once in this file, and within noise per token.)
TUNED_TILES = {
    (6144, 4096, False): (16, 512, 4),  # q|k|v
    (4096, 4096, False): (2, 2048, 2),  # o_proj
    (14336, 4096, True): (1, 512, 2),  # gate|up with SwiGLU
    (4096, 14336, False): (2, 2048, 2),  # down
    (128256, 4096, False): (16, 256, 4),  # lm_head
}
# Every other shape: the config whose worst ratio to cuBLAS over those five shapes was lowest
# (1.08x; 0.99x on average).
GENERIC_TILES = (2, 512, 4)


# More than one row (M >= 2): 16 rows per program (the smallest tensor-core tile), these
# (BLOCK_N, BLOCK_K, num_warps) unless given: the best of 18 on the H200 at batch 8
# (bench_gemv_rows.csv), and still 1.05-1.94x cuBLAS's time there (o_proj 1.05x, q|k|v 1.94x),
# which is why runtime.projections=auto keeps cuBLAS above batch 1.
ROWS_PER_PROGRAM = 16
ROW_TILES = (64, 256, 4)


def default_row_tiles(dtype: torch.dtype) -> tuple[int, int, int]:
    """ROW_TILES for 2-byte dtypes; fp32 halves BLOCK_K so the pipelined tiles fit in shared
    memory (fp32 SwiGLU at (64, 256): 306 KiB > the H200's 227 KiB; at (64, 128): 153 KiB, sm_90
    compile of Triton 3.6)."""
    block_n, block_k, warps = ROW_TILES
    return block_n, block_k * 2 // dtype.itemsize, warps


def _overlap(a: Tensor, b: Tensor) -> bool:
    """Whether the bytes a and b span intersect (bounds of each view's extent)."""
    def span(t: Tensor) -> tuple[int, int]:
        extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1 if t.numel() else 0
        return t.data_ptr(), t.data_ptr() + extent * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def default_tiles(out_features: int, in_features: int, swiglu: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an out_features x in_features projection (out_features
    counts SwiGLU's outputs, half the weight's rows): the tuned entry, else GENERIC_TILES with
    the K tile no wider than the input."""
    tuned = TUNED_TILES.get((out_features, in_features, swiglu))
    if tuned is not None:
        return tuned
    block_n, block_k, warps = GENERIC_TILES
    if _interpreting():  # CPU tests: 8x fewer programs to interpret (any tile size is exact)
        block_n = 16
    return block_n, min(block_k, triton.next_power_of_2(max(in_features, 16))), warps


def dense_gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, norm_weight: Tensor | None = None,
               eps: float = 1e-6, residual: Tensor | None = None, swiglu: bool = False,
               tiles: tuple[int, int, int] | None = None, out: Tensor | None = None) -> Tensor:
    """x: [M, K]; weight: [N_w, K] (nn.Linear layout, last dim contiguous); bias: [N_w] or None;
    norm_weight: [K] RMSNorm weight applied to x first (None: x as it is);
    swiglu: weight is [gate | up] with N_w = 2 N, the output silu(gate) * up;
    residual: [M, N] in x's dtype, updated in place with the projection (and returned).
    -> y [M, N] in x's dtype (N = N_w, or N_w / 2 with swiglu); out: [M, N] in x's dtype with a
    contiguous last dim, written instead of a new y (a captured step's static slot; not with residual).
    tiles: (BLOCK_N, BLOCK_K, num_warps) instead of `default_tiles` (M = 1) or `default_row_tiles` (M >= 2;
    both powers of two >= 16 there); benchmarks tune them."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K] with one K; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one of {SUPPORTED_DTYPES}; got {x.dtype} and {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"x and weight need a contiguous last dim; got strides {x.stride()} and {weight.stride()}")
    M, K = x.shape
    n_w = weight.shape[0]
    if swiglu and n_w % 2:
        raise ValueError(f"swiglu needs a [gate | up] weight with an even number of rows; got {n_w}")
    N = n_w // 2 if swiglu else n_w
    for name, t, shape in (("bias", bias, (n_w,)), ("norm_weight", norm_weight, (K,)), ("residual", residual, (M, N))):
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}; got {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}; put them on one device")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim; got strides {t.stride()}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}; put them on one device")
    if residual is not None:
        if residual.dtype != x.dtype:
            raise ValueError(f"residual must be in x's dtype {x.dtype}; got {residual.dtype}")
        if _overlap(residual, x):
            raise ValueError("residual must not overlap x in memory (programs would read rows others already updated)")
        if out is not None:
            raise ValueError("pass residual (updated in place) or out (overwritten), not both")
        y = residual
    elif out is not None:
        if tuple(out.shape) != (M, N) or out.dtype != x.dtype or out.device != x.device or out.stride(-1) != 1:
            raise ValueError(f"out must be [M, N]=[{M}, {N}] in x's dtype {x.dtype} on {x.device} with a contiguous "
                             f"last dim; got {out.dtype} {tuple(out.shape)} on {out.device}")
        if _overlap(out, x):
            raise ValueError("out must not overlap x in memory (programs would read rows others already wrote)")
        y = out
    else:
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        raise ValueError("in_features K must be >= 1")
    args = (x, norm_weight if norm_weight is not None else x, weight, bias if bias is not None else weight, y)
    flags = dict(NORM=norm_weight is not None, HAS_BIAS=bias is not None, RESIDUAL=residual is not None,
                 SWIGLU=swiglu, **launch_kwargs(x.device))
    if M == 1:  # a GEMV: the weight streamed once
        block_n, block_k, num_warps = tiles or default_tiles(N, K, swiglu)
        _dense_gemv_kernel[(triton.cdiv(N, block_n), 1)](
            *args, N, K, float(eps), x.stride(0), weight.stride(0), y.stride(0),
            EVEN_K=K % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, **flags)
        return y
    # Several rows: tensor-core tiles of ROWS_PER_PROGRAM rows, each weight tile read once per tile
    # of rows (the GEMV kernel would read it once per row).
    block_n, block_k, num_warps = tiles or default_row_tiles(x.dtype)
    if min(block_n, block_k) < 16 or block_n & (block_n - 1) or block_k & (block_k - 1):
        raise ValueError(f"tiles={tiles}: with M={M} rows BLOCK_N and BLOCK_K must be powers of two >= 16")
    _dense_rows_kernel[(triton.cdiv(N, block_n), triton.cdiv(M, ROWS_PER_PROGRAM))](
        *args, M, N, K, float(eps), x.stride(0), weight.stride(0), y.stride(0),
        # bf16 arithmetic is wrong in the interpreter (DESIGN.md §3): fp32 operands there
        NATIVE_DOT=x.dtype != torch.float32 and not (_interpreting() and x.dtype == torch.bfloat16),
        BLOCK_M=ROWS_PER_PROGRAM, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=3, **flags)
    return y
