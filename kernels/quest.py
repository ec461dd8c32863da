"""Launchers for the Quest kernels (checks, allocation, grid); the kernels are in
`prr.kernels.quest_jit`, the torch references in `prr.kernels.reference_selection`.

Metadata layout is prr's: the cache slots "quest_key_max" / "quest_key_min", each
[B, Hkv, NB_max, D] fp32 (QuestSelector fills unwritten blocks with -inf / +inf; those lie
past the context and are never read here). Query head h belongs to KV head h // G, as in
`q.view(B, Hkv, G, D)`.
"""

from __future__ import annotations

import os

import torch
import triton
from torch import Tensor

from .pdl import launch_kwargs
from .quest_jit import _quest_score_kernel, _quest_select_kernel, _quest_update_kernel
from .topk import MAX_ROW_BLOCK, PAD_BLOCK, _check_topk_args

GQA_REDUCTIONS = ("max", "sum")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def _check_head_dim(head_dim: int) -> None:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim={head_dim} is not supported: the Quest kernels take 1 <= D <= {MAX_HEAD_DIM}")


def _check_metadata(key_max: Tensor, key_min: Tensor) -> None:
    if key_max.dim() != 4:
        raise ValueError(f"key_max must be [B, Hkv, NB_max, D]; got shape {tuple(key_max.shape)}")
    if key_min.shape != key_max.shape:
        raise ValueError(f"key_min {tuple(key_min.shape)} and key_max {tuple(key_max.shape)} must have one shape")
    if key_max.dtype not in FLOAT_DTYPES or key_min.dtype != key_max.dtype:
        raise ValueError(
            f"key_max/key_min must share a float dtype (fp32 as prr stores them); got {key_max.dtype}, {key_min.dtype}"
        )
    if key_min.stride() != key_max.stride():
        raise ValueError(f"key_min strides {key_min.stride()} differ from key_max strides {key_max.stride()}")


def _check_per_row(name: str, t: Tensor, batch: int, device: torch.device) -> None:
    if t.shape != (batch,) or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32 tensor of shape [B]=[{batch}]; got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the metadata on {device}; put them on one device")


def _score_launch(q, key_max, key_min, num_blocks, gqa_reduce, out, block_n, num_warps, d_chunk, default_warps):
    """Checks, output allocation and the launch parameters shared by quest_score and quest_select.
    -> (out, grid, positional kernel args, constexpr kwargs) or (out, None, None, None) if empty."""
    if gqa_reduce not in GQA_REDUCTIONS:
        raise ValueError(f"gqa_reduce={gqa_reduce!r} is not one of {list(GQA_REDUCTIONS)} (the kernel reduces inside)")
    _check_metadata(key_max, key_min)
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D]; got shape {tuple(q.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be fp16, bf16 or fp32; got {q.dtype}")
    batch, num_kv_heads, max_blocks, head_dim = key_max.shape
    if q.shape[0] != batch or q.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not match the metadata {tuple(key_max.shape)} in B or D")
    num_q_heads = q.shape[1]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"Hq={num_q_heads} query heads is not a multiple of Hkv={num_kv_heads} KV heads")
    _check_head_dim(head_dim)
    if q.device != key_max.device or key_min.device != key_max.device:
        raise ValueError(f"q ({q.device}) and the metadata ({key_max.device}, {key_min.device}) must share a device")
    _check_per_row("num_blocks", num_blocks, batch, key_max.device)

    if out is None:
        out = torch.empty(batch, num_kv_heads, max_blocks, dtype=torch.float32, device=q.device)
    elif out.shape != (batch, num_kv_heads, max_blocks) or out.dtype != torch.float32 or out.device != q.device:
        raise ValueError(f"out must be fp32 [{batch}, {num_kv_heads}, {max_blocks}] on {q.device}")
    if max_blocks == 0 or batch == 0 or num_kv_heads == 0:
        return out, None, None, None

    block_d = triton.next_power_of_2(head_dim)
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    dot_ok = q.dtype == key_max.dtype and q.dtype in (torch.float16, torch.bfloat16) and head_dim >= 16
    if d_chunk is None:  # tensor cores where the dtypes allow (the interpreter has no bf16 dot)
        interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        d_chunk = -1 if dot_ok and not (interpreting and q.dtype == torch.bfloat16) else min(32, block_d)
    if d_chunk == -1:
        if not dot_ok:
            raise ValueError(f"d_chunk=-1 (tensor cores) needs q and the metadata in one 16-bit dtype and D >= 16; "
                             f"got q {q.dtype}, metadata {key_max.dtype}, D={head_dim}")
        group_pad = max(16, group_pad)  # the GEMM's M
    elif d_chunk and (d_chunk < 0 or d_chunk & (d_chunk - 1) or d_chunk > block_d):
        raise ValueError(f"d_chunk={d_chunk} must be 0, -1 (tensor cores) or a power of two <= {block_d}")
    num_warps = num_warps or default_warps
    if block_n is None and d_chunk == -1:
        block_n = 64  # [64, D] tiles of max and min per program (H200, D = 128)
    elif block_n is None:
        # Per thread ~32 fp32 of a metadata tile (per D chunk: of partial sums), 16..128 blocks.
        per_block = group_pad * d_chunk if d_chunk else block_d
        block_n = max(16, min(128, triton.next_power_of_2(32 * 32 * num_warps // per_block)))
    if block_n <= 0 or block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n} must be a power of two")
    if d_chunk == -1 and block_n < 16:
        raise ValueError(f"block_n={block_n}: the tensor-core path (d_chunk=-1) needs block_n >= 16 (a GEMM's N)")
    grid = (triton.cdiv(max_blocks, block_n), num_kv_heads, batch)
    args = (max_blocks, head_dim, *q.stride(), *key_max.stride(), *out.stride())
    constexprs = dict(
        GROUP=group, GROUP_PAD=group_pad, SUM_GROUP=gqa_reduce == "sum",
        BLOCK_N=block_n, BLOCK_D=block_d, D_CHUNK=d_chunk, num_warps=num_warps,
    )
    return out, grid, args, constexprs


def quest_score(
    q: Tensor,
    key_max: Tensor,
    key_min: Tensor,
    num_blocks: Tensor,
    gqa_reduce: str = "max",
    *,
    block_n: int | None = None,
    num_warps: int | None = None,
    d_chunk: int | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Quest block scores, GQA-reduced inside the kernel.

    q: [B, Hq, D] fp16/bf16/fp32 (post-RoPE query of the current token);
    key_max, key_min: [B, Hkv, NB_max, D] fp32 per-block key max / min (M ≥ m elementwise);
    num_blocks: [B] int32, blocks in each row's context (clamped to NB_max);
    gqa_reduce: "max" or "sum" over the G = Hq / Hkv query heads of a KV head.
    -> scores [B, Hkv, NB_max] fp32: U_b = reduce_g Σ_i max(q_{g,i} M_{b,i}, q_{g,i} m_{b,i})
    (unscaled q·k units) for blocks b < num_blocks[b_row], -inf beyond: prr's
    `QuestSelector.head_scores` reduced over the group, as `Selector.select` does.
    Tuning: block_n (blocks per program, a power of two), num_warps, d_chunk (0: one
    reduction over D per query head; a power of two: all heads at once, D in chunks of that
    size; -1: tensor cores, q and metadata both fp16 or both bf16, the default there).
    `out` may be a preallocated [B, Hkv, NB_max] fp32 tensor.
    """
    out, grid, args, constexprs = _score_launch(
        q, key_max, key_min, num_blocks, gqa_reduce, out, block_n, num_warps, d_chunk, default_warps=4
    )
    if grid is not None:
        _quest_score_kernel[grid](q, key_max, key_min, num_blocks, out, *args, **constexprs, **launch_kwargs(q.device))
    return out


def quest_select(
    q: Tensor,
    key_max: Tensor,
    key_min: Tensor,
    num_blocks: Tensor,
    k: int,
    sink_blocks: int = 0,
    recent_blocks: int = 1,
    gqa_reduce: str = "max",
    *,
    arrivals: Tensor | None = None,
    radix_bits: int = 2,
    block_n: int | None = None,
    num_warps: int | None = None,
    d_chunk: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """quest_score and topk_select fused into one launch (the last program to finish a
    (row, KV head) selects over its scores). Inputs as in quest_score and topk_select.
    -> (scores [B, Hkv, NB_max] fp32, indices [B, Hkv, min(k, NB_max)] int32, counts [B, Hkv] int32),
    each equal to what quest_score followed by topk_select returns.
    arrivals: an int32 workspace of B * Hkv zeros, left zeroed by every launch: keep one per
    stream and pass it to avoid a memset per call (default: allocated here, zeroed).
    Rows up to MAX_ROW_BLOCK blocks (the select holds the row in registers).
    """
    batch, num_kv_heads, max_blocks = key_max.shape[:3] if key_max.dim() == 4 else (0, 0, 0)
    row_block = triton.next_power_of_2(max(max_blocks, 1))
    if row_block > MAX_ROW_BLOCK:
        raise ValueError(
            f"quest_select holds a row of NB_max={max_blocks} blocks in registers (at most {MAX_ROW_BLOCK});"
            " use quest_score then topk_select"
        )
    out, grid, args, constexprs = _score_launch(
        q, key_max, key_min, num_blocks, gqa_reduce, None, block_n, num_warps, d_chunk,
        default_warps=max(4, min(16, row_block // 512)),
    )
    _check_topk_args(out, k, num_blocks, sink_blocks, recent_blocks, radix_bits)
    k_out = min(k, max_blocks)
    indices = torch.empty(batch, num_kv_heads, k_out, dtype=torch.int32, device=q.device)
    counts = torch.zeros(batch, num_kv_heads, dtype=torch.int32, device=q.device)
    if grid is None or k_out == 0:
        if grid is not None:
            quest_score(q, key_max, key_min, num_blocks, gqa_reduce, out=out)
        return out, indices, counts
    if arrivals is None:
        arrivals = torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=q.device)
    elif arrivals.shape != (batch * num_kv_heads,) or arrivals.dtype != torch.int32 or arrivals.device != q.device:
        raise ValueError(f"arrivals must be an int32 tensor of B * Hkv = {batch * num_kv_heads} zeros on {q.device}")
    _quest_select_kernel[grid](
        q, key_max, key_min, num_blocks, out, indices, counts, arrivals, *args,
        num_kv_heads, min(k, max_blocks), k_out, min(sink_blocks, max_blocks), min(recent_blocks, max_blocks),
        ROW_BLOCK=row_block, RADIX_BITS=radix_bits, PAD_BLOCK=PAD_BLOCK, **constexprs,
    )
    return out, indices, counts


def quest_update(key_max: Tensor, key_min: Tensor, k_new: Tensor, positions: Tensor, block_size: int) -> None:
    """One-token Quest metadata update, in place.

    key_max, key_min: [B, Hkv, NB_max, D] fp32 (updated in place);
    k_new: [B, Hkv, D] the key appended at token position positions[b] (pass the key as the
    cache stores it, so the metadata matches a rebuild from the cache);
    positions: [B] int32; block_size: tokens per cache block (a power of two).
    Block positions[b] // block_size of row b becomes the running max / min with k_new, or
    k_new itself when the token is the first of its block. Equals prr's
    `QuestSelector.update_metadata(cache, layer, p, p + 1)`. Positions outside
    [0, NB_max * block_size) write nothing (not checked on the host: no sync).
    """
    _check_metadata(key_max, key_min)
    batch, num_kv_heads, max_blocks, head_dim = key_max.shape
    if k_new.shape != (batch, num_kv_heads, head_dim):
        raise ValueError(f"k_new must be [B, Hkv, D]=[{batch}, {num_kv_heads}, {head_dim}]; got {tuple(k_new.shape)}")
    if k_new.dtype not in FLOAT_DTYPES:
        raise ValueError(f"k_new must be fp16, bf16 or fp32; got {k_new.dtype}")
    if k_new.device != key_max.device:
        raise ValueError(f"k_new is on {k_new.device}, the metadata on {key_max.device}; put them on one device")
    _check_head_dim(head_dim)
    _check_per_row("positions", positions, batch, key_max.device)
    if not isinstance(block_size, int) or block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size} must be a power of two (e.g. 16, 32, 64)")
    if batch == 0 or num_kv_heads == 0 or max_blocks == 0:
        return
    _quest_update_kernel[(num_kv_heads, batch)](
        key_max, key_min, k_new, positions,
        max_blocks, head_dim,
        *key_max.stride(), *k_new.stride(),
        BLOCK_SIZE=block_size,
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1 if head_dim <= 128 else 2,
    )
