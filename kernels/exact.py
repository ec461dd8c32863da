"""Launchers for the `exact` selection kernels (checks, allocation, grid); the kernels are in
`prr.kernels.exact_jit`, the torch reference in `prr.kernels.reference_exact`.

`exact_scores` is the score half of prr's `ExactSelector` (the true attention mass of every
block, GQA-reduced); `prr.kernels.topk.topk_select` takes the top-K of it. Two launches: the
q·K pass (every key read once per KV head for its whole group) and a small pass that normalises
each block's lse by the row's and reduces the group.
"""

from __future__ import annotations

import os

import torch
import triton
from torch import Tensor

from .exact_jit import _exact_block_lse_kernel, _exact_block_mass_kernel, _exact_lse_speculate_kernel
from .pdl import launch_kwargs
from .sparse_decode import PerBlockLaunch

GQA_REDUCTIONS = ("max", "sum")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOG2E = 1.4426950408889634


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_power_of_two(name: str, value: int, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or value & (value - 1):
        raise ValueError(f"{name}={value!r} must be a power of two >= {low}")


def _check_per_row(name: str, t: Tensor, batch: int, device: torch.device) -> None:
    if t.shape != (batch,) or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32/int64 tensor of shape [B]=[{batch}]; got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the keys on {device}; put them on one device")


def default_tiling(block_size: int) -> tuple[int, int]:
    """-> (tile_blocks, tiles) of the q·K pass: tiles of 128 keys (at least one block), runs of 512
    keys per program (at least one tile), so a 32K context is 512 programs over 8 KV heads."""
    tile_blocks = max(1, 128 // block_size)
    return tile_blocks, max(1, 512 // (tile_blocks * block_size))


def exact_block_lse(
    q: Tensor,
    keys: Tensor,
    lengths: Tensor,
    num_blocks: Tensor,
    block_size: int,
    scale: float,
    *,
    tile_blocks: int | None = None,
    tiles: int | None = None,
    num_warps: int | None = None,
    native_dot: bool | None = None,
    speculation: PerBlockLaunch | None = None,
) -> tuple[Tensor, Tensor]:
    """The q·K pass of exact selection.

    q: [B, Hq, D] fp16/bf16/fp32 (post-RoPE query; head h reads KV head h // (Hq / Hkv));
    keys: [B, Hkv, T_max, D] the layer's key cache (T_max a multiple of block_size);
    lengths: [B] int32/int64 tokens of each row's context; num_blocks: [B] their blocks
    (cdiv(length, block_size), clamped to NB_max); scale: of q·k (1/sqrt(D) in prr).
    -> (block_lse [B, Hkv, G, NB_max] fp32: log Σ exp(scale q·k) over each block's live tokens,
        written for blocks < num_blocks only;
        part_lse [B, Hkv, G, P] fp32: the same over each program's run of tiles * tile_blocks
        blocks, written for runs that start below num_blocks).
    Tuning: tile_blocks (blocks per tl.dot, a power of two), tiles (tiles per program),
    num_warps, native_dot (16-bit tensor-core operands; default where q and keys share an fp16 /
    bf16 dtype, except bf16 under the interpreter).
    speculation: sparse_decode(q, keys, values, P, ..., per_block=True, plan_only=True) over the
    same q and keys: PRR's per-block states over P are computed in this launch (its first
    programs) and written into speculation.out / speculation.lse, bit for bit what
    sparse_decode(per_block=True) writes; its native_dot must be this pass's.
    """
    if q.dim() != 3 or keys.dim() != 4:
        raise ValueError(f"q must be [B, Hq, D] and keys [B, Hkv, T_max, D]; got {tuple(q.shape)}, {tuple(keys.shape)}")
    if q.dtype not in FLOAT_DTYPES or keys.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q and keys must be fp16, bf16 or fp32; got {q.dtype}, {keys.dtype}")
    batch, num_kv_heads, max_tokens, head_dim = keys.shape
    if q.shape[0] != batch or q.shape[2] != head_dim or q.shape[1] % max(num_kv_heads, 1):
        raise ValueError(f"q {tuple(q.shape)} does not fit keys {tuple(keys.shape)}: B and D must match and "
                         f"Hq must be a multiple of Hkv={num_kv_heads}")
    _check_power_of_two("block_size", block_size)
    _check_power_of_two("head_dim", head_dim, 16)
    if max_tokens % block_size:
        raise ValueError(f"keys hold T_max={max_tokens} tokens, not a multiple of block_size={block_size}")
    if q.device != keys.device:
        raise ValueError(f"q ({q.device}) and keys ({keys.device}) must share a device")
    _check_per_row("lengths", lengths, batch, keys.device)
    _check_per_row("num_blocks", num_blocks, batch, keys.device)
    max_blocks = max_tokens // block_size
    group = q.shape[1] // num_kv_heads if num_kv_heads else 1
    default_tile, default_tiles = default_tiling(block_size)
    tile_blocks = default_tile if tile_blocks is None else tile_blocks
    tiles = default_tiles if tiles is None else tiles
    _check_power_of_two("tile_blocks", tile_blocks)
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"tiles={tiles!r} must be an int >= 1 (tiles per program)")
    if tile_blocks * block_size < 16:
        raise ValueError(f"tile_blocks * block_size = {tile_blocks * block_size} keys per tile; tl.dot needs >= 16")
    sixteen_bit = q.dtype == keys.dtype and q.dtype in (torch.float16, torch.bfloat16)
    if native_dot is None:
        native_dot = sixteen_bit and not (_interpreting() and q.dtype == torch.bfloat16)
    elif native_dot and not sixteen_bit:
        raise ValueError(f"native_dot=True needs q and keys in one 16-bit dtype; got {q.dtype}, {keys.dtype}")
    fp32_data = q.dtype == torch.float32 or keys.dtype == torch.float32

    parts = triton.cdiv(max_blocks, tile_blocks * tiles)
    block_lse = torch.empty(batch, num_kv_heads, group, max_blocks, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_kv_heads, group, parts, dtype=torch.float32, device=q.device)
    if speculation is not None and num_warps not in (None, 4):
        raise ValueError(f"num_warps={num_warps}: with a speculation the launch runs sparse_decode's per-block "
                         "programs, whose states are sparse_decode's at its 4 warps; leave num_warps unset")
    if batch == 0 or num_kv_heads == 0 or max_blocks == 0:
        if speculation is not None:  # no keys: every state empty, as sparse_decode writes them
            speculation.out.zero_()
            speculation.lse.fill_(float("-inf"))
        return block_lse, part_lse
    args = (q, keys, lengths, num_blocks, block_lse, part_lse, scale * LOG2E, max_blocks,
            *q.stride(), *keys.stride(), *block_lse.stride(), *part_lse.stride())
    constexprs = {"GROUP": group, "GROUP_PAD": max(16, triton.next_power_of_2(group)), "HEAD_DIM": head_dim,
                  "BLOCK_SIZE": block_size, "NATIVE_DOT": native_dot, "INPUT_PRECISION": "ieee" if fp32_data else "tf32"}
    launch = {"num_warps": num_warps or 4, **launch_kwargs(q.device)}
    if speculation is None or speculation.chunks == 0:
        _exact_block_lse_kernel[(parts, num_kv_heads, batch)](*args, **constexprs, TILE_BLOCKS=tile_blocks,
                                                               TILES=tiles, **launch)
        return block_lse, part_lse
    spec = _speculation_arguments(speculation, q, keys, lengths, scale, constexprs)
    _exact_lse_speculate_kernel[(speculation.chunks + parts, num_kv_heads, batch)](
        *args, speculation.chunks, *spec, **constexprs, TILE_BLOCKS=tile_blocks, TILES=tiles,
        SUB_TILE=speculation.constexprs["SUB_TILE"], PRECISE_PV=speculation.constexprs["PRECISE_PV"], **launch)
    return block_lse, part_lse


def _speculation_arguments(plan: PerBlockLaunch, q: Tensor, keys: Tensor, lengths: Tensor, scale: float,
                           constexprs: dict) -> tuple:
    """The per-block launch's arguments that the q·K pass does not already pass (values, P's ids
    and counts, the outputs, their strides), after checking that it runs over the same q, keys,
    lengths, scale and dot settings (one set of those serves both parts of the launch)."""
    (pq, pk, values, ids, counts, plengths, out, lse, qk_scale, _hkv, capacity, entries, *strides) = plan.args
    def same(a: Tensor, b: Tensor) -> bool:  # the same memory seen the same way (views may be new objects)
        return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype

    if not (same(pq, q) and same(pk, keys) and same(plengths, lengths)):
        raise ValueError("speculation must be planned over the same q, keys and lengths as the q·K pass")
    if abs(qk_scale - scale * LOG2E) > 1e-12 * abs(qk_scale):
        raise ValueError(f"speculation's scale ({qk_scale / LOG2E}) differs from the q·K pass's ({scale})")
    differ = {k: (plan.constexprs[k], v) for k, v in constexprs.items() if plan.constexprs[k] != v}
    if differ:
        raise ValueError(f"speculation's launch settings differ from the q·K pass's (theirs, ours): {differ}")
    q_and_k = 3 + 4  # q's and keys' strides, passed once by the q·K pass
    return (values, ids, counts, out, lse, capacity, entries, *strides[q_and_k:])


def exact_block_mass(
    block_lse: Tensor,
    part_lse: Tensor,
    num_blocks: Tensor,
    blocks_per_part: int,
    gqa_reduce: str = "max",
    *,
    block_n: int = 128,
    out: Tensor | None = None,
) -> Tensor:
    """block_lse [B, Hkv, G, NB_max], part_lse [B, Hkv, G, P] (from exact_block_lse, runs of
    blocks_per_part blocks), num_blocks [B] -> scores [B, Hkv, NB_max] fp32: each block's share
    of its query head's attention mass exp(lse_{g,b} − lse_g), reduced over the group by
    gqa_reduce ("max" or "sum"); -inf from num_blocks on."""
    if gqa_reduce not in GQA_REDUCTIONS:
        raise ValueError(f"gqa_reduce={gqa_reduce!r} is not one of {list(GQA_REDUCTIONS)} (the kernel reduces inside)")
    batch, num_kv_heads, group, max_blocks = block_lse.shape
    if part_lse.shape[:3] != (batch, num_kv_heads, group) or part_lse.shape[3] != triton.cdiv(max_blocks, blocks_per_part):
        raise ValueError(f"part_lse {tuple(part_lse.shape)} does not match block_lse {tuple(block_lse.shape)} "
                         f"with runs of {blocks_per_part} blocks")
    _check_per_row("num_blocks", num_blocks, batch, block_lse.device)
    _check_power_of_two("block_n", block_n)
    if out is None:
        out = torch.empty(batch, num_kv_heads, max_blocks, dtype=torch.float32, device=block_lse.device)
    elif out.shape != (batch, num_kv_heads, max_blocks) or out.dtype != torch.float32:
        raise ValueError(f"out must be fp32 [{batch}, {num_kv_heads}, {max_blocks}]")
    if batch == 0 or num_kv_heads == 0 or max_blocks == 0:
        return out
    block_n = min(block_n, triton.next_power_of_2(max_blocks))
    group_pad = triton.next_power_of_2(group)
    _exact_block_mass_kernel[(triton.cdiv(max_blocks, block_n), num_kv_heads, batch)](
        block_lse, part_lse, num_blocks, out, max_blocks,
        *block_lse.stride(), *part_lse.stride(), *out.stride(),
        GROUP=group, GROUP_PAD=group_pad, BLOCKS_PER_PART=blocks_per_part,
        PART_CHUNK=max(1, min(256, 2048 // group_pad, triton.next_power_of_2(part_lse.shape[3]))),
        BLOCK_N=block_n, SUM_GROUP=gqa_reduce == "sum",
        num_warps=4, **launch_kwargs(block_lse.device),
    )
    return out


def exact_scores(
    q: Tensor,
    keys: Tensor,
    lengths: Tensor,
    num_blocks: Tensor,
    block_size: int,
    scale: float,
    gqa_reduce: str = "max",
    *,
    tile_blocks: int | None = None,
    tiles: int | None = None,
    num_warps: int | None = None,
    block_n: int = 128,
    speculation: PerBlockLaunch | None = None,
) -> Tensor:
    """exact_block_lse then exact_block_mass: q [B, Hq, D], keys [B, Hkv, T_max, D], lengths and
    num_blocks [B] -> scores [B, Hkv, NB_max] fp32, what prr's `ExactSelector` ranks (the
    softmax over each row's whole context summed per block, reduced over the group), -inf past
    each row's context. Tuning arguments and speculation (P's per-block states in the q·K
    pass's launch) as in the two launchers."""
    if gqa_reduce not in GQA_REDUCTIONS:
        raise ValueError(f"gqa_reduce={gqa_reduce!r} is not one of {list(GQA_REDUCTIONS)} (the kernel reduces inside)")
    _check_power_of_two("block_size", block_size)
    default_tile, default_tiles = default_tiling(block_size)
    tile_blocks = default_tile if tile_blocks is None else tile_blocks
    tiles = default_tiles if tiles is None else tiles
    block_lse, part_lse = exact_block_lse(q, keys, lengths, num_blocks, block_size, scale, tile_blocks=tile_blocks,
                                          tiles=tiles, num_warps=num_warps, speculation=speculation)
    return exact_block_mass(block_lse, part_lse, num_blocks, tile_blocks * tiles, gqa_reduce, block_n=block_n)
