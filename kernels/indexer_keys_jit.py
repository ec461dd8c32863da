"""Triton kernel appending one index key per row to the lightning indexer's key cache (bf16, or
fp8 e4m3 quantized per token inside the kernel). Launcher: `prr.kernels.indexer_keys`;
reference: `prr.kernels.reference_indexer.index_key_append_reference`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_prologue

FP8_MAX = tl.constexpr(448.0)  # the largest finite float8_e4m3fn value
ROUND_TO_INTEGER = tl.constexpr(12582912.0)  # 1.5 * 2^23: (x + it) - it rounds |x| < 2^22 to an integer, ties to even


@triton.jit
def _round_to_e4m3_grid(v):
    """v fp32 with |v| <= 448 -> the nearest float8_e4m3fn value (ties to even), as fp32, with v's sign
    (also where it rounds to zero: -0.0, byte 0x80, as torch stores it).

    Done in fp32 arithmetic that is exact on every backend (bit fields, a power-of-two scaling,
    one rounding to an integer), so that the conversion to fp8 after it never rounds: Triton's
    interpreter rounds fp32 -> fp8 wrongly where the mantissa carries into the exponent, the GPU
    rounds to nearest even; the stored bytes are torch's `.to(torch.float8_e4m3fn)` on both.
    The sign is put back as a bit, not by a float negation: Triton <= 3.6 lowers `-x` to `0 - x`
    (PTX `neg.f32` + `fma.rn.f32 ..., 0f00000000`), which turns -0.0 into +0.0."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # e4m3's smallest normal exponent: below it the spacing stays 2^-9
    # 3 mantissa bits: spacing 2^(exponent - 3), in [2^-9, 2^5]; both factors are exact powers of two.
    spacing = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - exponent + 3) << 23).to(tl.float32, bitcast=True)
    steps = tl.abs(v) * inverse  # exact, < 16
    steps = (steps + ROUND_TO_INTEGER) - ROUND_TO_INTEGER
    magnitude = steps * spacing  # exact, >= +0.0
    sign = (bits >> 31) << 31  # v's sign bit alone (an arithmetic shift: 0 or 0x80000000)
    return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_bf16_grid(v):
    """v fp32 -> the nearest bf16 value (ties to even), as fp32, by integer arithmetic on the bits:
    the GPU converts fp32 -> bf16 to nearest even, Triton's interpreter truncates; after this the
    conversion is exact on both (NaN is not kept: index keys and queries are finite)."""
    bits = v.to(tl.int32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)  # carries into the kept 16 bits when past half, or at half and odd
    return ((bits >> 16) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _store_index_key(key_cache_ptr, key_scales_ptr, k, batch, position, max_tokens, head_dim,
                     stride_cb, stride_ct, stride_cd, stride_sb, stride_st,
                     FP8: tl.constexpr, BLOCK_D: tl.constexpr):
    """k [BLOCK_D] fp32 (lanes >= head_dim 0) -> the cache at (batch, position): rounded to bf16, or
    quantized per token (FP8). Positions outside [0, T_max) write nothing (the caller's error; never
    checked on the host: no sync)."""
    offs_d = tl.arange(0, BLOCK_D)
    in_cache = (position >= 0) & (position < max_tokens)
    write_d = offs_d < tl.where(in_cache, head_dim, 0)  # live_d in the cache, nothing outside
    slot = key_cache_ptr + batch * stride_cb + position * stride_ct + offs_d * stride_cd
    if FP8:
        # Correctly rounded divisions (Triton's `/` may approximate) so the bytes equal torch's quantization.
        scale = tl.math.div_rn(tl.max(tl.abs(k), axis=0), FP8_MAX)
        safe = tl.where(scale > 0, scale, 1.0)  # an all-zero key: scale 0, fp8 zeros
        scaled = tl.where(scale > 0, tl.math.div_rn(k, tl.broadcast_to(safe, (BLOCK_D,))), 0.0)
        scaled = tl.minimum(tl.maximum(scaled, -FP8_MAX), FP8_MAX)  # one rounding of the division past 448
        tl.store(slot, _round_to_e4m3_grid(scaled).to(tl.float8e4nv), mask=write_d)
        tl.store(key_scales_ptr + batch * stride_sb + position * stride_st, scale, mask=in_cache)
    else:
        tl.store(slot, _round_to_bf16_grid(k).to(tl.bfloat16), mask=write_d)


@triton.jit
def _index_key_append_kernel(
    key_cache_ptr,  # [B, T_max, D] bf16 or float8e4nv
    key_scales_ptr,  # [B, T_max] fp32 per-token scales (FP8)
    k_new_ptr,  # [B, D] fp16/bf16/fp32: this step's index key per row
    positions_ptr,  # [B] int32/int64: the token position written in each row
    max_tokens,  # T_max
    head_dim,  # D
    stride_cb, stride_ct, stride_cd,
    stride_sb, stride_st,
    stride_kb, stride_kd,
    FP8: tl.constexpr,  # quantize per token: scale = absmax / 448, key = round(k / scale) in e4m3
    BLOCK_D: tl.constexpr,  # next power of two >= D
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    batch = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + batch).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    live_d = offs_d < head_dim
    k = tl.load(k_new_ptr + batch * stride_kb + offs_d * stride_kd, mask=live_d, other=0.0).to(tl.float32)
    _store_index_key(key_cache_ptr, key_scales_ptr, k, batch, position, max_tokens, head_dim,
                     stride_cb, stride_ct, stride_cd, stride_sb, stride_st, FP8, BLOCK_D)
