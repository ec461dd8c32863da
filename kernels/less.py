"""Launchers for LESS's kernels (checks, allocation, grid): the compensation (`less_compensation`,
one launch), the compensation merged with the attention over A into the layer's output
(`less_compensate_merge`, one launch) and the decode token's metadata update with Quest's
(`less_append`, one launch); the kernels are
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

from .less_jit import _less_append_incremental_kernel, _less_append_kernel, _less_compensate_kernel
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


def _check_compensation_inputs(q, w, indices, counts, lengths, block_size, big, small, offset, big_tot, small_tot,
                               offset_tot, center, q_logits) -> None:
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
    if head_dim < 16:
        raise ValueError(f"head_dim={head_dim} must be >= 16 (tl.dot's K)")
    _check_power_of_two("block_size", block_size)


def _launch_compensation(q, w, indices, counts, lengths, block_size, big, small, offset, big_tot, small_tot,
                         offset_tot, center, scale, q_logits, min_relative_mass, m_block, d_block, c_block, num_warps,
                         out, lse, parts) -> None:
    """One launch of _less_compensate_kernel: out [B, Hkv, G, D] / lse [B, Hkv, G] views to write;
    parts None (the state) or (part_out [B, Hkv, G, S, D], part_lse [B, Hkv, G, S]) to merge with."""
    batch, num_kv_heads, group, head_dim = q.shape
    num_features = big.shape[3]
    for name, value in (("m_block", m_block), ("d_block", d_block), ("c_block", c_block)):
        _check_power_of_two(name, value)
    if m_block < 16:
        raise ValueError(f"m_block={m_block} must be >= 16 (tl.dot's N)")
    d_block = min(d_block, head_dim)
    m_block = min(m_block, max(16, triton.next_power_of_2(num_features)))
    c_block = min(c_block, triton.next_power_of_2(max(indices.shape[2], 1)))
    if batch == 0 or num_kv_heads == 0 or group == 0:
        return
    logits_given = q_logits is not None
    qlog = q_logits if logits_given else lse  # (unused by the kernel without LOGITS_GIVEN)
    w_arg = w if w is not None else lse
    w_strides = w.stride() if w is not None else (0, 0, 0)
    qlog_strides = q_logits.stride() if logits_given else (0, 0, 0, 0)
    if parts is None:
        part_out, part_lse, num_splits = out, lse, 1  # (unused without MERGE)
        part_strides = (0,) * 9
    else:
        part_out, part_lse = parts
        num_splits = part_out.shape[3]
        part_strides = (*part_out.stride(), *part_lse.stride())
    _less_compensate_kernel[(head_dim // d_block, num_kv_heads, batch)](
        q, qlog, w_arg, indices, counts, lengths, big, small, offset, big_tot, small_tot, offset_tot, center,
        part_out, part_lse, out, lse,
        indices.shape[2], num_splits, block_size, scale, math.sqrt(scale), 0.5 * math.log(num_features),
        min_relative_mass,
        *q.stride(), *qlog_strides, *w_strides, *indices.stride(), *counts.stride(),
        *big.stride(), *small.stride(), *offset.stride(), *big_tot.stride(), *small_tot.stride(),
        *offset_tot.stride(), *center.stride(), *part_strides, *out.stride(), *lse.stride(),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, NUM_FEATURES=num_features,
        M_BLOCK=m_block, D_BLOCK=d_block, C_BLOCK=c_block, LOGITS_GIVEN=logits_given, MERGE=parts is not None,
        SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=num_warps, **launch_kwargs(q.device),
    )


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
    m_block: int = 32,
    d_block: int = 8,
    c_block: int = 32,
    num_warps: int = 4,
) -> tuple[Tensor, Tensor]:
    """LESS's estimate of the attention over the blocks outside A. One launch.

    q: [B, Hkv, G, D] fp16/bf16/fp32 (post-RoPE); w: [Hkv, m, D] fp32 random-feature directions,
    or None with q_logits [B, Hkv, G, m] fp32 given (a trained map's log-features of q);
    indices [B, Hkv, C] int32 and counts [B, Hkv] int32: A (distinct block ids inside each row's
    context, padding past counts); lengths [B] int32/int64 tokens of each row's context;
    big, small, offset, big_tot, small_tot, offset_tot, center: the summaries (module docstring);
    scale: of q·k (1/sqrt(D) in prr).
    -> (out [B, Hkv, G, D] fp32, lse [B, Hkv, G] fp32, natural log of the estimated Σ exp(scale q·k)
       over the unselected tokens; out = 0, lse = -inf where every block is selected or the
       estimate is below min_relative_mass of the estimated total): `LessSelector.compensation`.
    Tuning: m_block features per chunk (>= 16), d_block columns of S per program, c_block
    selected blocks per gather.
    """
    _check_compensation_inputs(q, w, indices, counts, lengths, block_size, big, small, offset, big_tot, small_tot,
                               offset_tot, center, q_logits)
    b, h, g, d = q.shape
    out = torch.empty(b, h, g, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, g, dtype=torch.float32, device=q.device)
    _launch_compensation(q, w, indices, counts, lengths, block_size, big, small, offset, big_tot, small_tot,
                         offset_tot, center, scale, q_logits, min_relative_mass, m_block, d_block, c_block, num_warps,
                         out, lse, None)
    return out, lse


def less_compensate_merge(
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
    part_out: Tensor,
    part_lse: Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    q_logits: Tensor | None = None,
    min_relative_mass: float = MIN_RELATIVE_MASS,
    m_block: int = 32,
    d_block: int = 8,
    c_block: int = 32,
    num_warps: int = 4,
) -> tuple[Tensor, Tensor]:
    """The attention over A ⊕ LESS's estimate of the rest, in one launch: the layer's output.

    Arguments as less_compensation, plus the attention over A as the sparse kernel leaves it:
    part_out [B, Hq, S, D] fp32 and part_lse [B, Hq, S] fp32, S split partials (merge_splits=False;
    padding splits lse = -inf), or merged ([B, Hq, D], [B, Hq]); Hq = Hkv·G, query head
    h·G + g of KV head h.
    -> (out [B, Hq, D] out_dtype, lse [B, Hq] fp32): prr.attention_state.merge of merge_many(the
       partials) and less_compensation's state, written once in the model dtype.
    """
    _check_compensation_inputs(q, w, indices, counts, lengths, block_size, big, small, offset, big_tot, small_tot,
                               offset_tot, center, q_logits)
    b, h, g, d = q.shape
    if part_out.dim() == 3:
        part_out, part_lse = part_out.unsqueeze(2), part_lse.unsqueeze(2)
    if part_out.dim() != 4 or tuple(part_out.shape[:2]) != (b, h * g) or part_out.shape[3] != d:
        raise ValueError(f"part_out must be fp32 [B, Hq, S, D] or [B, Hq, D] with B={b}, Hq={h * g}, D={d}; got "
                         f"{list(part_out.shape)}")
    _check("part_out", part_out, tuple(part_out.shape), (torch.float32,), q.device)
    _check("part_lse", part_lse, tuple(part_out.shape[:3]), (torch.float32,), q.device)
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype} is not one of fp16, bf16, fp32")
    s = part_out.shape[2]
    out = torch.empty(b, h * g, d, dtype=out_dtype, device=q.device)
    lse = torch.empty(b, h * g, dtype=torch.float32, device=q.device)
    if s == 0:
        raise ValueError("part_out has no split (S = 0): pass the attention over A, -inf lse if it is empty")
    _launch_compensation(q, w, indices, counts, lengths, block_size, big, small, offset, big_tot, small_tot,
                         offset_tot, center, scale, q_logits, min_relative_mass, m_block, d_block, c_block, num_warps,
                         out.view(b, h, g, d), lse.view(b, h, g),
                         (part_out.view(b, h, g, s, d), part_lse.view(b, h, g, s)))
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
    key_max: Tensor | None = None,
    key_min: Tensor | None = None,
    *,
    big_open: Tensor | None = None,
    small_open: Tensor | None = None,
    m_block: int = 16,
    d_block: int = 32,
    num_warps: int = 4,
) -> None:
    """LESS's metadata after one decode token per row, in place (`LessSelector.append_metadata`,
    random features): keys, values [B, Hkv, T_max, D] hold the token at positions [B]
    (int32/int64); the totals (S_tot, s_tot at offsets c_tot) take it, and its block's S_b, s_b, c_b
    are recomputed from the block's tokens up to it. w [Hkv, m, D], center [B, Hkv, D] fp32; the
    summaries as in less_compensation. key_max, key_min [B, Hkv, NB_max, D] (optional, together):
    Quest's metadata, its block's running max / min taking the token as prr.kernels.quest.quest_update
    does. Positions outside the cache write nothing (not checked on the host: no sync). One launch.
    big_open [B, Hkv, m, D], small_open [B, Hkv, m] fp32 (optional, together): incremental, O(m·D)
    per token whatever the block size: the block's summaries take the token as the totals do (from
    these open-block sums of its earlier tokens, fp32, updated in place; S_b, s_b their rounding to the
    summary dtype, once), equal to the re-read within fp32 rounding; without them the block is re-read.
    Tuning: m_block features per program, d_block columns of K / V per step (both >= 16)."""
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
    _check_power_of_two("d_block", d_block)
    if max_tokens != max_blocks * block_size:
        raise ValueError(f"keys hold {max_tokens} tokens, the summaries {max_blocks} blocks of {block_size}")
    d_block = min(d_block, head_dim)
    if block_size < 16 or m_block < 16 or d_block < 16:
        raise ValueError(f"block_size={block_size}, m_block={m_block} and d_block={d_block} (at most head_dim) "
                         "must be >= 16 (tl.dot shapes)")
    quest = key_max is not None
    if quest != (key_min is not None):
        raise ValueError("give key_max and key_min together (Quest's metadata) or neither")
    if quest:
        for name, t in (("key_max", key_max), ("key_min", key_min)):
            _check(name, t, (batch, num_kv_heads, max_blocks, head_dim), FLOAT_DTYPES, dev)
        if key_min.stride() != key_max.stride():
            raise ValueError(f"key_max and key_min must share strides; got {key_max.stride()} and {key_min.stride()}")
    if batch == 0 or num_kv_heads == 0 or num_features == 0:
        return
    meta = key_max if quest else big_tot  # (unused without QUEST)
    if (big_open is None) != (small_open is None):
        raise ValueError("give big_open and small_open together (the open block's fp32 sums) or neither")
    if big_open is not None:
        _check("big_open", big_open, (batch, num_kv_heads, num_features, head_dim), (torch.float32,), dev)
        _check("small_open", small_open, (batch, num_kv_heads, num_features), (torch.float32,), dev)
        _less_append_incremental_kernel[(triton.cdiv(num_features, m_block), num_kv_heads, batch)](
            keys, values, positions, w, center, big, small, offset, big_open, small_open, big_tot, small_tot,
            offset_tot, meta, key_min if quest else big_tot,
            num_features, max_blocks, math.sqrt(scale), 0.5 * math.log(num_features),
            *keys.stride(), *values.stride(), *w.stride(), *center.stride(), *big.stride(), *small.stride(),
            *offset.stride(), *big_open.stride(), *small_open.stride(), *big_tot.stride(), *small_tot.stride(),
            *offset_tot.stride(), *(key_max.stride() if quest else (0, 0, 0, 0)),
            HEAD_DIM=head_dim, BLOCK_SIZE=block_size, M_BLOCK=m_block, D_BLOCK=d_block, QUEST=quest,
            num_warps=num_warps, **launch_kwargs(dev),
        )
        return
    _less_append_kernel[(triton.cdiv(num_features, m_block), num_kv_heads, batch)](
        keys, values, positions, w, center, big, small, offset, big_tot, small_tot, offset_tot,
        meta, key_min if quest else big_tot,
        num_features, max_blocks, math.sqrt(scale), 0.5 * math.log(num_features),
        *keys.stride(), *values.stride(), *w.stride(), *center.stride(), *big.stride(), *small.stride(),
        *offset.stride(), *big_tot.stride(), *small_tot.stride(), *offset_tot.stride(),
        *(key_max.stride() if quest else (0, 0, 0, 0)),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, M_BLOCK=m_block, D_BLOCK=d_block, QUEST=quest,
        num_warps=num_warps, **launch_kwargs(dev),
    )
