"""Launchers for LESS's kernels (checks, allocation, grid): the compensation (`less_compensation`,
two launches) and the decode token's metadata update (`less_append`, one launch); the kernels are
in `prr.kernels.less_jit`, the torch references in `prr.kernels.reference_less`.

Layouts are prr's (`LessSelector`'s cache slots): summaries S_b [B, Hkv, NB_max, m, D], s_b and
their offsets c_b [B, Hkv, NB_max, m], totals S_tot [B, Hkv, m, D], s_tot and c_tot [B, Hkv, m],
the key centre [B, Hkv, D], random-feature directions w [Hkv, m, D]. Summaries may be fp32 or
bf16 (a compact state); offsets and totals are fp32.
"""

from __future__ import annotations

import math

import torch
import triton
from torch import Tensor

from .less_jit import _less_append_kernel, _less_finish_kernel, _less_partial_kernel
from .pdl import launch_kwargs

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SUMMARY_DTYPES = (torch.float32, torch.bfloat16)
MIN_RELATIVE_MASS = 1e-6


def _check(name: str, t: Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], device) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype not in dtypes:
        raise ValueError(f"{name} must be {[str(d).replace('torch.', '') for d in dtypes]} of shape {list(shape)}; "
                         f"got {t.dtype} {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q on {device}; put them on one device")


def _check_power_of_two(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{name}={value!r} must be a power of two")


def less_compensation(
    q: Tensor,
    w: Tensor | None,
    indices: Tensor,
    counts: Tensor,
    lengths: Tensor,
    block_size: int,
    big: Tensor,
    small: Tensor,
    offset: Tensor,
    big_tot: Tensor,
    small_tot: Tensor,
    offset_tot: Tensor,
    center: Tensor,
    scale: float,
    *,
    q_logits: Tensor | None = None,
    min_relative_mass: float = MIN_RELATIVE_MASS,
    m_block: int = 16,
    d_block: int = 32,
    c_block: int = 8,
    num_warps: int = 4,
) -> tuple[Tensor, Tensor]:
    """LESS's estimate of the attention over the blocks outside A.

    q: [B, Hkv, G, D] fp16/bf16/fp32 (post-RoPE); w: [Hkv, m, D] fp32 random-feature directions,
    or None with q_logits [B, Hkv, G, m] fp32 given (a trained map's log-features of q);
    indices [B, Hkv, C] int32 and counts [B, Hkv] int32: A (distinct block ids inside each row's
    context, padding past counts); lengths [B] int32/int64 tokens of each row's context;
    big, small, offset, big_tot, small_tot, offset_tot, center: the summaries (module docstring);
    scale: of q·k (1/sqrt(D) in prr).
    -> (out [B, Hkv, G, D] fp32, lse [B, Hkv, G] fp32, natural log of the estimated Σ exp(scale q·k)
       over the unselected tokens; out = 0, lse = -inf where every block is selected or the
       estimate is below min_relative_mass of the estimated total): `LessSelector.compensation`.
    Tuning: m_block features and d_block columns of S per program, c_block blocks per gather.
    """
    if q.dim() != 4 or q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be fp16/bf16/fp32 [B, Hkv, G, D]; got {q.dtype} {list(q.shape)}")
    batch, num_kv_heads, group, head_dim = q.shape
    if big.dim() != 5:
        raise ValueError(f"big (S_b) must be [B, Hkv, NB_max, m, D]; got {list(big.shape)}")
    max_blocks, num_features = big.shape[2], big.shape[3]
    dev = q.device
    _check("big (S_b)", big, (batch, num_kv_heads, max_blocks, num_features, head_dim), SUMMARY_DTYPES, dev)
    _check("small (s_b)", small, (batch, num_kv_heads, max_blocks, num_features), SUMMARY_DTYPES, dev)
    _check("offset (c_b)", offset, (batch, num_kv_heads, max_blocks, num_features), (torch.float32,), dev)
    _check("big_tot (S_tot)", big_tot, (batch, num_kv_heads, num_features, head_dim), (torch.float32,), dev)
    _check("small_tot (s_tot)", small_tot, (batch, num_kv_heads, num_features), (torch.float32,), dev)
    _check("offset_tot (c_tot)", offset_tot, (batch, num_kv_heads, num_features), (torch.float32,), dev)
    _check("center", center, (batch, num_kv_heads, head_dim), (torch.float32,), dev)
    if indices.dim() != 3 or indices.shape[:2] != (batch, num_kv_heads) or indices.dtype != torch.int32:
        raise ValueError(f"indices must be int32 [B, Hkv, C]=[{batch}, {num_kv_heads}, C]; got {indices.dtype} "
                         f"{list(indices.shape)}")
    _check("counts", counts, (batch, num_kv_heads), (torch.int32,), dev)
    _check("lengths", lengths, (batch,), (torch.int32, torch.int64), dev)
    if (w is None) == (q_logits is None):
        raise ValueError("give exactly one of w (random features) and q_logits (a trained map's log-features of q)")
    if w is not None:
        _check("w", w, (num_kv_heads, num_features, head_dim), (torch.float32,), dev)
    else:
        _check("q_logits", q_logits, (batch, num_kv_heads, group, num_features), (torch.float32,), dev)
    _check_power_of_two("head_dim", head_dim)
    _check_power_of_two("block_size", block_size)
    for name, value in (("m_block", m_block), ("d_block", d_block), ("c_block", c_block)):
        _check_power_of_two(name, value)
    d_block = min(d_block, head_dim)
    m_block = min(m_block, triton.next_power_of_2(num_features))

    out = torch.empty(batch, num_kv_heads, group, head_dim, dtype=torch.float32, device=dev)
    lse = torch.empty(batch, num_kv_heads, group, dtype=torch.float32, device=dev)
    if batch == 0 or num_kv_heads == 0 or group == 0:
        return out, lse
    chunks = triton.cdiv(num_features, m_block)
    num_part = torch.empty(batch, num_kv_heads, chunks, group, head_dim, dtype=torch.float32, device=dev)
    mass_part = torch.empty(batch, num_kv_heads, chunks, group, dtype=torch.float32, device=dev)
    total_part = torch.empty_like(mass_part)
    top = torch.empty(batch, num_kv_heads, group, dtype=torch.float32, device=dev)
    logits_given = q_logits is not None
    qlog = q_logits if logits_given else top  # (unused by the kernel without LOGITS_GIVEN)
    w_arg = w if w is not None else top
    w_strides = w.stride() if w is not None else (0, 0, 0)
    qlog_strides = q_logits.stride() if logits_given else (0, 0, 0, 0)
    group_pad = triton.next_power_of_2(group)
    pdl = launch_kwargs(dev)
    _less_partial_kernel[(chunks, head_dim // d_block, batch * num_kv_heads)](
        q, qlog, w_arg, indices, counts, big, small, offset, big_tot, small_tot, offset_tot,
        num_part, mass_part, total_part, top,
        num_kv_heads, num_features, indices.shape[2], math.sqrt(scale), 0.5 * math.log(num_features),
        *q.stride(), *qlog_strides, *w_strides, *indices.stride(), *counts.stride(),
        *big.stride(), *small.stride(), *offset.stride(), *big_tot.stride(), *small_tot.stride(),
        *offset_tot.stride(), *num_part.stride(), *mass_part.stride(), *top.stride(),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, M_BLOCK=m_block, D_BLOCK=d_block, C_BLOCK=c_block,
        LOGITS_GIVEN=logits_given, num_warps=num_warps, **pdl,
    )
    _less_finish_kernel[(num_kv_heads, batch)](
        q, center, counts, lengths, num_part, mass_part, total_part, top, out, lse,
        chunks, block_size, scale, min_relative_mass,
        *q.stride(), *center.stride(), *counts.stride(), *num_part.stride(), *mass_part.stride(), *top.stride(),
        *out.stride(), *lse.stride(),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, num_warps=4, **pdl,
    )
    return out, lse


def less_append(
    keys: Tensor,
    values: Tensor,
    positions: Tensor,
    block_size: int,
    w: Tensor,
    center: Tensor,
    big: Tensor,
    small: Tensor,
    offset: Tensor,
    big_tot: Tensor,
    small_tot: Tensor,
    offset_tot: Tensor,
    scale: float,
    *,
    m_block: int = 16,
    num_warps: int = 4,
) -> None:
    """LESS's metadata after one decode token per row, in place (`LessSelector.append_metadata`'s
    feature part, random features): keys, values [B, Hkv, T_max, D] hold the token at positions [B]
    (int32/int64); the totals (S_tot, s_tot at offsets c_tot) take it, and its block's S_b, s_b, c_b
    are recomputed from the block's tokens up to it. w [Hkv, m, D], center [B, Hkv, D] fp32; the
    summaries as in less_compensation. Positions outside the cache write nothing (not checked on the
    host: no sync). One launch."""
    if keys.dim() != 4 or values.shape != keys.shape or keys.dtype not in FLOAT_DTYPES or values.dtype != keys.dtype:
        raise ValueError(f"keys and values must be one float dtype and shape [B, Hkv, T_max, D]; got "
                         f"{keys.dtype} {list(keys.shape)}, {values.dtype} {list(values.shape)}")
    batch, num_kv_heads, max_tokens, head_dim = keys.shape
    if big.dim() != 5:
        raise ValueError(f"big (S_b) must be [B, Hkv, NB_max, m, D]; got {list(big.shape)}")
    max_blocks, num_features = big.shape[2], big.shape[3]
    dev = keys.device
    _check("big (S_b)", big, (batch, num_kv_heads, max_blocks, num_features, head_dim), SUMMARY_DTYPES, dev)
    _check("small (s_b)", small, (batch, num_kv_heads, max_blocks, num_features), SUMMARY_DTYPES, dev)
    _check("offset (c_b)", offset, (batch, num_kv_heads, max_blocks, num_features), (torch.float32,), dev)
    _check("big_tot (S_tot)", big_tot, (batch, num_kv_heads, num_features, head_dim), (torch.float32,), dev)
    _check("small_tot (s_tot)", small_tot, (batch, num_kv_heads, num_features), (torch.float32,), dev)
    _check("offset_tot (c_tot)", offset_tot, (batch, num_kv_heads, num_features), (torch.float32,), dev)
    _check("center", center, (batch, num_kv_heads, head_dim), (torch.float32,), dev)
    _check("w", w, (num_kv_heads, num_features, head_dim), (torch.float32,), dev)
    _check("positions", positions, (batch,), (torch.int32, torch.int64), dev)
    _check_power_of_two("head_dim", head_dim)
    _check_power_of_two("block_size", block_size)
    _check_power_of_two("m_block", m_block)
    if max_tokens != max_blocks * block_size:
        raise ValueError(f"keys hold {max_tokens} tokens, the summaries {max_blocks} blocks of {block_size}")
    if block_size < 16 or m_block < 16:
        raise ValueError(f"block_size={block_size} and m_block={m_block} must be >= 16 (tl.dot shapes)")
    if batch == 0 or num_kv_heads == 0 or num_features == 0:
        return
    _less_append_kernel[(triton.cdiv(num_features, m_block), num_kv_heads, batch)](
        keys, values, positions, w, center, big, small, offset, big_tot, small_tot, offset_tot,
        num_features, max_blocks, math.sqrt(scale), 0.5 * math.log(num_features),
        *keys.stride(), *values.stride(), *w.stride(), *center.stride(), *big.stride(), *small.stride(),
        *offset.stride(), *big_tot.stride(), *small_tot.stride(), *offset_tot.stride(),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, M_BLOCK=m_block, num_warps=num_warps, **launch_kwargs(dev),
    )
