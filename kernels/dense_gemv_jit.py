"""Triton kernel for the dense projections of a decode step, with the work around them fused
in: y = W · f(x) with an optional RMSNorm prologue, bias,
residual-add epilogue, or the SwiGLU epilogue of a fused gate|up weight. At batch 1 each
projection is a GEMV that only streams its weight; the norms, residual adds and SiLU around
it are launches that move almost no bytes but cost a kernel each (DESIGN.md §3: launches,
not bytes, set much of the batch-1 token time). Launcher: `prr.kernels.dense_gemv`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_prologue


@triton.jit
def _weight_tile(rows, cols, K, live_n):
    """rows [BLOCK_N, 1] pointers, cols [BLOCK_K] -> the weight tile, zeros outside [0, K)."""
    return tl.load(rows + cols[None, :], mask=live_n[:, None] & (cols < K)[None, :], other=0.0)


@triton.jit
def _dense_gemv_kernel(
    x_ptr,  # [M, K] input rows (model dtype)
    norm_w_ptr,  # [K] RMSNorm weight (NORM)
    w_ptr,  # [N_w, K] row-major weight (nn.Linear layout); N_w = 2 N for SWIGLU
    bias_ptr,  # [N_w] (HAS_BIAS)
    y_ptr,  # [M, N] output; with RESIDUAL it holds the residual and is updated in place
    N,  # output columns (for SWIGLU: the gate half's rows)
    K,  # input features
    eps,  # RMSNorm epsilon
    stride_xm, stride_wn, stride_ym,
    NORM: tl.constexpr,  # y = W · (norm_w * x * rsqrt(mean(x^2) + eps))
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,  # y <- y + round(W · x + b)
    SWIGLU: tl.constexpr,  # y = round(silu(round(gate))) * round(up), gate rows [0, N), up rows [N, 2 N)
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks on x along K
    BLOCK_N: tl.constexpr,  # weight rows per program
    BLOCK_K: tl.constexpr,  # input features per loop iteration
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pid_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)  # the batch row m
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live_n = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    # (N may arrive as a constexpr: Triton specialises an int argument equal to 1)
    up_rows = w_ptr + (offs_n.to(tl.int64) + N)[:, None] * stride_wn
    y, up, rstd = _gemv_tile(x_ptr + row * stride_xm, norm_w_ptr, w_rows, up_rows, live_n, K, eps,
                             NORM, SWIGLU, EVEN_K, BLOCK_N, BLOCK_K, PDL)
    _epilogue(y, up, rstd, bias_ptr, offs_n, N, y_ptr + row * stride_ym + offs_n, live_n,
              HAS_BIAS, RESIDUAL, SWIGLU)


@triton.jit
def _gemv_tile(x_ptr, norm_w_ptr, w_rows, up_rows, live_n, K, eps,
               NORM: tl.constexpr, SWIGLU: tl.constexpr, EVEN_K: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One row x [K] against BLOCK_N weight rows (w_rows [BLOCK_N, 1] pointers; up_rows: SwiGLU's
    up rows) -> (y, up: [BLOCK_N] fp32 dot products, up = y without SWIGLU; rstd: the RMSNorm
    factor of x, 1.0 without NORM). The kernel's PDL wait is in here: the first weight tile is
    requested before it (weights never depend on the kernel before; with PDL this overlaps that
    kernel's tail), every later one a tile ahead."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    w = _weight_tile(w_rows, offs_k, K, live_n)
    if SWIGLU:
        u = _weight_tile(up_rows, offs_k, K, live_n)
    pdl_prologue(PDL)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs_k
        live_k = cols < K
        if EVEN_K:
            x = tl.load(x_ptr + cols)
        else:
            x = tl.load(x_ptr + cols, mask=live_k, other=0.0)
        xf = x.to(tl.float32)
        if NORM:  # the 1 / rms factor is applied to the dot products at the end (one pass over x)
            squares += xf * xf
            xf = xf * tl.load(norm_w_ptr + cols, mask=live_k, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * xf[None, :]
        w = _weight_tile(w_rows, cols + BLOCK_K, K, live_n)  # past K: masked off, no traffic
        if SWIGLU:
            acc_up += u.to(tl.float32) * xf[None, :]
            u = _weight_tile(up_rows, cols + BLOCK_K, K, live_n)
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    up = tl.sum(acc_up, axis=1) if SWIGLU else y
    rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps) if NORM else 1.0
    return y, up, rstd


@triton.jit
def _epilogue(y, up, rstd, bias_ptr, offs_n, N, y_at, mask, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
              SWIGLU: tl.constexpr):
    """y, up: fp32 dot products ([BLOCK_N] or [BLOCK_M, BLOCK_N]; up only for SWIGLU), rstd: the
    RMSNorm factor (1.0 without, or per row [BLOCK_M, 1]) -> stored at y_at (mask) in its dtype."""
    out_ty = y_at.dtype.element_ty
    y = y * rstd
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    if SWIGLU:
        up = up * rstd
        if HAS_BIAS:
            up += tl.load(bias_ptr + N + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        gate = y.to(out_ty).to(tl.float32)  # the reference rounds each projection, then silu, then the product
        silu = (gate * tl.sigmoid(gate)).to(out_ty).to(tl.float32)
        y = silu * up.to(out_ty).to(tl.float32)
    if RESIDUAL:
        y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32) + y.to(out_ty).to(tl.float32)
    tl.store(y_at, y.to(out_ty), mask=mask)


@triton.jit
def _dense_rows_kernel(
    x_ptr,  # [M, K] input rows (model dtype), M >= 2
    norm_w_ptr,  # [K] RMSNorm weight (NORM)
    w_ptr,  # [N_w, K] row-major weight; N_w = 2 N for SWIGLU
    bias_ptr,  # [N_w] (HAS_BIAS)
    y_ptr,  # [M, N] output; with RESIDUAL it holds the residual and is updated in place
    M, N, K,
    eps,
    stride_xm, stride_wn, stride_ym,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SWIGLU: tl.constexpr,
    NATIVE_DOT: tl.constexpr,  # 16-bit operands into the tensor cores; else fp32 operands, IEEE dot
    BLOCK_M: tl.constexpr,  # batch rows per program (16: the smallest tensor-core tile)
    BLOCK_N: tl.constexpr,  # weight rows per program (>= 16)
    BLOCK_K: tl.constexpr,  # input features per loop iteration (>= 16)
    PDL: tl.constexpr,
):
    """The same math as _dense_gemv_kernel for a few batch rows at once: each weight tile is read
    once for all BLOCK_M rows (tensor-core dots), where the GEMV would read it once per row."""
    pid_n = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    live_m = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    up_rows = w_ptr + (offs_n.to(tl.int64) + N)[:, None] * stride_wn  # (N may be a constexpr 1)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    squares = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    pdl_prologue(PDL)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs_k
        live_k = cols < K
        x = tl.load(x_rows + cols[None, :], mask=live_m[:, None] & live_k[None, :], other=0.0)
        if NORM:  # as in the GEMV: norm weight now, 1 / rms per row at the end
            xf = x.to(tl.float32)
            squares += xf * xf
            x = (xf * tl.load(norm_w_ptr + cols, mask=live_k, other=0.0).to(tl.float32)[None, :]).to(x.dtype)
        w = _weight_tile(w_rows, cols, K, live_n)  # [BLOCK_N, BLOCK_K]
        acc = _dot(x, w, acc, NATIVE_DOT)
        if SWIGLU:
            acc_up = _dot(x, _weight_tile(up_rows, cols, K, live_n), acc_up, NATIVE_DOT)
    rstd = tl.rsqrt(tl.sum(squares, axis=1) / K + eps)[:, None] if NORM else 1.0
    y_at = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    _epilogue(acc, acc_up, rstd, bias_ptr, offs_n[None, :], N, y_at, live_m[:, None] & live_n[None, :],
              HAS_BIAS, RESIDUAL, SWIGLU)


@triton.jit
def _dot(x, w, acc, NATIVE_DOT: tl.constexpr):
    """acc + x [BLOCK_M, BLOCK_K] · w [BLOCK_N, BLOCK_K]^T in fp32."""
    if NATIVE_DOT:
        return tl.dot(x, tl.trans(w), acc)
    return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
