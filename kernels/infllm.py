"""Launchers for InfLLM's selection kernels (checks, allocation, grid); the kernels are in
`prr.kernels.infllm_jit`, the torch definition is `prr.selectors.infllm.InfLLMSelector`'s own
ops (its torch backend), which tests/test_kernels_infllm.py compares them with.

Per sparse layer and decode step, the selector's Triton path is four launches:
1. `infllm_live_update` (in `append_metadata`): the decode token's block gets the mean of its
   live keys (pre-RoPE with position_agnostic scoring): S·D key reads per KV head;
2. `infllm_step`: the window work (window_attention: a softmax over the forced blocks' tokens
   per query head, added into the window tokens' summed probabilities) and the finalising of at
   most one block (its representatives), then the row's counters: (Ks + W)·S·D + S·D key reads
   and W·G·S window floats per KV head (one_query with per_head=false: the finalised block's keys
   of every KV head);
3. `infllm_scores`: every block scored against its representatives (final blocks) or its live
   mean (the window's), the query turned to InfLLM's fixed angle, reduced over the group or Σ
   over the layer: NB·G·D fp32 per KV head (one_query: NB·D, its representatives are the same
   for a group's heads), the dominant bytes;
4. `prr.kernels.topk.topk_select`.
Slots (fp32 as the torch path keeps them): repr [B, Hkv, NB_max, G, D], live [B, Hkv, NB_max, D],
window [B, Hkv, NB_max, G, S]; finalised and scored [B] int64.
"""

from __future__ import annotations

import math
import os

import torch
import triton
from torch import Tensor

from .infllm_jit import _infllm_live_kernel, _infllm_score_kernel, _infllm_step_kernel
from .pdl import launch_kwargs

GQA_REDUCTIONS = ("max", "sum")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _power_of_two(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1 and not value & (value - 1)


def shape_problems(head_dim: int | None = None, block_size: int | None = None) -> list[str]:
    """Why the InfLLM kernels cannot run a cache of this head_dim / block_size ([] if they can)."""
    problems = []
    if head_dim is not None and not (_power_of_two(head_dim) and 16 <= head_dim <= MAX_HEAD_DIM):
        problems.append(f"head_dim={head_dim}: the InfLLM kernels take a power of two in [16, {MAX_HEAD_DIM}]")
    if block_size is not None and not _power_of_two(block_size):
        problems.append(f"block_size={block_size}: the InfLLM kernels take a power of two")
    return problems


def _check(problems: list[str]) -> None:
    if problems:
        raise ValueError("; ".join(problems))


def _check_keys(keys: Tensor, block_size: int) -> None:
    if keys.dim() != 4 or keys.dtype not in FLOAT_DTYPES:
        raise ValueError(f"keys must be the layer's key cache [B, Hkv, T_max, D] in fp16/bf16/fp32; got "
                         f"{keys.dtype} {tuple(keys.shape)}")
    _check(shape_problems(keys.shape[3], block_size))
    if keys.shape[2] % block_size:
        raise ValueError(f"keys hold T_max={keys.shape[2]} tokens, not a multiple of block_size={block_size}")


def _check_per_row(name: str, t: Tensor, batch: int, device: torch.device, dtypes=(torch.int32, torch.int64)) -> None:
    if t.shape != (batch,) or t.dtype not in dtypes:
        raise ValueError(f"{name} must be a {'/'.join(str(d).replace('torch.', '') for d in dtypes)} tensor of "
                         f"shape [B]=[{batch}]; got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the keys on {device}; put them on one device")


def _check_slot(name: str, t: Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if tuple(t.shape) != shape or t.dtype != torch.float32 or t.device != device:
        raise ValueError(f"{name} must be fp32 {list(shape)} on {device}; got {t.dtype} {tuple(t.shape)} on {t.device}")


def _check_inv_freq(inv_freq: Tensor | None, head_dim: int, device: torch.device) -> None:
    if inv_freq is None:
        raise ValueError("position_agnostic scoring needs the model's RoPE frequencies: pass inv_freq [D/2] fp32")
    if inv_freq.shape != (head_dim // 2,) or inv_freq.dtype != torch.float32 or inv_freq.device != device:
        raise ValueError(f"inv_freq must be fp32 [{head_dim // 2}] on {device}; got {inv_freq.dtype} "
                         f"{tuple(inv_freq.shape)} on {inv_freq.device}")


def infllm_live_update(live: Tensor, keys: Tensor, positions: Tensor, block_size: int,
                       inv_freq: Tensor | None = None) -> None:
    """The decode token's block gets the mean of its live keys, in place: `InfLLMSelector.
    append_metadata(cache, layer, positions)`.

    live: [B, Hkv, NB_max, D] fp32 `infllm_live`; keys: [B, Hkv, T_max, D] the layer's key cache
    (post-RoPE, the token at positions[b] written); positions: [B] int32/int64;
    inv_freq: [D/2] fp32 to undo the keys' RoPE (position_agnostic scoring), None to keep it
    (scoring=rope). Block positions[b] // block_size of row b becomes the mean of its tokens
    <= positions[b]. Positions outside the cache write nothing (not checked: no host sync).
    """
    _check_keys(keys, block_size)
    batch, num_kv_heads, max_tokens, head_dim = keys.shape
    max_blocks = max_tokens // block_size
    _check_slot("live", live, (batch, num_kv_heads, max_blocks, head_dim), keys.device)
    _check_per_row("positions", positions, batch, keys.device)
    if inv_freq is not None:
        _check_inv_freq(inv_freq, head_dim, keys.device)
    if batch == 0 or num_kv_heads == 0 or max_blocks == 0:
        return
    _infllm_live_kernel[(num_kv_heads, batch)](
        keys, positions, live if inv_freq is None else inv_freq, live, max_blocks,
        *keys.stride(), *live.stride(),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, UNROTATE=inv_freq is not None,
        num_warps=2 if head_dim * block_size <= 4096 else 4, **launch_kwargs(keys.device),
    )


def default_forced_chunk(forced_tokens: int) -> int:
    """Forced tokens per window dot: all of them up to 128 (the default window, 1 sink + 4 local +
    the newest block of 16, is 96), else chunks of 128 (any window size; two passes over them)."""
    return max(16, min(128, triton.next_power_of_2(max(forced_tokens, 1))))


def infllm_step(
    q: Tensor,
    keys: Tensor,
    lengths: Tensor,
    repr_keys: Tensor,
    finalised: Tensor,
    arrivals: Tensor,
    block_size: int,
    sink_blocks: int,
    window_blocks: int,
    representatives: int,
    *,
    window: Tensor | None = None,
    scored: Tensor | None = None,
    inv_freq: Tensor | None = None,
    layer_sum: bool = False,
    forced_chunk: int | None = None,
    num_warps: int | None = None,
) -> None:
    """InfLLM's per-step metadata work at one selection, in place: `InfLLMSelector.head_scores`'s
    `_add_window_attention` (window_attention) and `_finalise` of one block.

    q: [B, Hq, D] post-RoPE query at position lengths[b] − 1; keys: [B, Hkv, T_max, D] the layer's
    key cache; lengths: [B] int32/int64 tokens of each row; repr_keys: [B, Hkv, NB_max, G, D] fp32;
    finalised: [B] int64 (blocks [0, n) final; advanced by at most one); arrivals: [B] int32 zeros
    (left zeroed: keep one per stream); window_blocks: W = local_blocks + force_newest;
    representatives: r (tokens averaged per block, at most block_size used).
    window_attention: pass window [B, Hkv, NB_max, G, S] fp32 and scored [B] int64 (a query at a
    position below scored[b] adds nothing; then scored[b] = max(scored[b], lengths[b]));
    one_query: window=None, scored=None; layer_sum: its token scores are summed over every KV head
    (per_head=false). inv_freq: [D/2] fp32 for position_agnostic (representatives pre-RoPE), None
    for scoring=rope.
    """
    _check_keys(keys, block_size)
    batch, num_kv_heads, max_tokens, head_dim = keys.shape
    max_blocks = max_tokens // block_size
    if q.dim() != 3 or q.dtype not in FLOAT_DTYPES or q.shape[0] != batch or q.shape[2] != head_dim \
            or q.shape[1] % max(num_kv_heads, 1):
        raise ValueError(f"q must be [B, Hq, D] fp16/bf16/fp32 fitting keys {tuple(keys.shape)} (Hq a multiple of "
                         f"Hkv); got {q.dtype} {tuple(q.shape)}")
    if q.device != keys.device:
        raise ValueError(f"q ({q.device}) and keys ({keys.device}) must share a device")
    group = q.shape[1] // num_kv_heads if num_kv_heads else 1
    _check_slot("repr_keys", repr_keys, (batch, num_kv_heads, max_blocks, group, head_dim), keys.device)
    _check_per_row("lengths", lengths, batch, keys.device)
    _check_per_row("finalised", finalised, batch, keys.device, (torch.int64,))
    _check_per_row("arrivals", arrivals, batch, keys.device, (torch.int32,))
    for name, value in (("sink_blocks", sink_blocks), ("window_blocks", window_blocks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r} must be an int >= 0")
    if isinstance(representatives, bool) or not isinstance(representatives, int) or representatives < 1:
        raise ValueError(f"representatives={representatives!r} must be a positive int")
    window_attention = window is not None
    if window_attention != (scored is not None):
        raise ValueError("window_attention needs both window and scored; one_query neither")
    if window_attention:
        if window_blocks < 1:
            raise ValueError("window_attention needs a local window: window_blocks >= 1")
        _check_slot("window", window, (batch, num_kv_heads, max_blocks, group, block_size), keys.device)
        _check_per_row("scored", scored, batch, keys.device, (torch.int64,))
        if layer_sum:
            raise ValueError("layer_sum applies to one_query's token scores only (window=None)")
    if inv_freq is not None:
        _check_inv_freq(inv_freq, head_dim, keys.device)
    forced = (sink_blocks + window_blocks) * block_size
    forced_chunk = forced_chunk or default_forced_chunk(forced)
    if not _power_of_two(forced_chunk) or forced_chunk < 16:
        raise ValueError(f"forced_chunk={forced_chunk!r} must be a power of two >= 16")
    if batch == 0 or num_kv_heads == 0 or max_blocks == 0:
        return
    sixteen_bit = q.dtype == keys.dtype and q.dtype in (torch.float16, torch.bfloat16)
    native_dot = sixteen_bit and not (_interpreting() and q.dtype == torch.bfloat16)
    fp32_data = q.dtype == torch.float32 or keys.dtype == torch.float32
    window_arg = window if window_attention else repr_keys  # (never read without window_attention)
    window_strides = window.stride() if window_attention else (0,) * 5
    _infllm_step_kernel[(num_kv_heads, batch)](
        q, keys, lengths, inv_freq if inv_freq is not None else repr_keys, window_arg, repr_keys, finalised,
        scored if window_attention else finalised, arrivals,
        num_kv_heads, math.sqrt(head_dim),
        *q.stride(), *keys.stride(), *window_strides, *repr_keys.stride(),
        GROUP=group, DOT_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        SINK_BLOCKS=sink_blocks, WINDOW_BLOCKS=window_blocks, FORCED_CHUNK=forced_chunk,
        FORCED_CHUNKS=triton.cdiv(forced, forced_chunk), R=min(representatives, block_size),
        WINDOW_ATTENTION=window_attention, UNROTATE=inv_freq is not None, LAYER_SUM=layer_sum,
        NATIVE_DOT=native_dot, INPUT_PRECISION="ieee" if fp32_data else "tf32",
        num_warps=num_warps or 4, **launch_kwargs(keys.device),
    )


def default_tiling(group: int, head_dim: int, shared_repr: bool, layer_sum: bool) -> tuple[int, int]:
    """-> (blocks per score program, warps). Σ over the layer (per_head=false, each program loops
    over every KV head): 8 blocks, 8 warps, the best of 4/8/16/32 blocks x 4/8 warps on the H200 at
    32K / block 16 for both rules (experiments/results/h200/bench_infllm_select.json: 13.1 µs for
    infllm against 15.3 at 8 x 4; 8.2 for infllm_prr against 16.7 at 32 x 8). Per KV head (one head
    per program): about 4,096 representative floats per program, 4 warps (not measured)."""
    if layer_sum:
        return 8, 8
    per_block = (1 if shared_repr else triton.next_power_of_2(group)) * head_dim
    return max(1, min(128, triton.next_power_of_2(max(1, 4096 // per_block)))), 4


def infllm_scores(
    q: Tensor,
    lengths: Tensor,
    num_blocks: Tensor,
    finalised: Tensor,
    repr_keys: Tensor,
    live: Tensor,
    *,
    inv_freq: Tensor | None = None,
    fixed_position: int = 0,
    layer_sum: bool = True,
    gqa_reduce: str = "sum",
    shared_repr: bool = False,
    block_n: int | None = None,
    num_warps: int | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """InfLLM's block scores, GQA-reduced: `InfLLMSelector.head_scores` reduced over each group as
    `Selector.select` does.

    q: [B, Hq, D] post-RoPE query at position lengths[b] − 1; lengths, num_blocks: [B] int32/int64;
    finalised: [B] int64 (blocks below it score against repr_keys [B, Hkv, NB_max, G, D] fp32, the
    others against live [B, Hkv, NB_max, D] fp32); inv_freq: [D/2] fp32 for position_agnostic
    scoring (the query rotated back from its position and on to fixed_position), None for rope;
    layer_sum: per_head=false (every KV head gets the Σ over the layer's query heads, then the
    group's gqa_reduce of those equal scores); shared_repr: one_query (a group's representatives
    are equal: head 0's is read).
    -> scores [B, Hkv, NB_max] fp32, -inf from num_blocks[b] on. Tuning: block_n, num_warps.
    """
    if gqa_reduce not in GQA_REDUCTIONS:
        raise ValueError(f"gqa_reduce={gqa_reduce!r} is not one of {list(GQA_REDUCTIONS)} (the kernel reduces inside)")
    if live.dim() != 4:
        raise ValueError(f"live must be [B, Hkv, NB_max, D] fp32; got {tuple(live.shape)}")
    batch, num_kv_heads, max_blocks, head_dim = live.shape
    _check(shape_problems(head_dim))
    if q.dim() != 3 or q.dtype not in FLOAT_DTYPES or q.shape[0] != batch or q.shape[2] != head_dim \
            or q.shape[1] % max(num_kv_heads, 1) or q.device != live.device:
        raise ValueError(f"q must be [B, Hq, D] fp16/bf16/fp32 on {live.device} fitting live {tuple(live.shape)}; "
                         f"got {q.dtype} {tuple(q.shape)} on {q.device}")
    group = q.shape[1] // num_kv_heads if num_kv_heads else 1
    _check_slot("live", live, (batch, num_kv_heads, max_blocks, head_dim), live.device)
    _check_slot("repr_keys", repr_keys, (batch, num_kv_heads, max_blocks, group, head_dim), live.device)
    _check_per_row("lengths", lengths, batch, live.device)
    _check_per_row("num_blocks", num_blocks, batch, live.device)
    _check_per_row("finalised", finalised, batch, live.device, (torch.int64,))
    if inv_freq is not None:
        _check_inv_freq(inv_freq, head_dim, live.device)
    default_n, default_warps = default_tiling(group, head_dim, shared_repr, layer_sum)
    block_n, num_warps = block_n or default_n, num_warps or default_warps
    if not _power_of_two(block_n):
        raise ValueError(f"block_n={block_n!r} must be a power of two")
    if out is None:
        out = torch.empty(batch, num_kv_heads, max_blocks, dtype=torch.float32, device=live.device)
    elif out.shape != (batch, num_kv_heads, max_blocks) or out.dtype != torch.float32 or out.device != live.device:
        raise ValueError(f"out must be fp32 [{batch}, {num_kv_heads}, {max_blocks}] on {live.device}")
    if batch == 0 or num_kv_heads == 0 or max_blocks == 0:
        return out
    grid = (triton.cdiv(max_blocks, block_n), 1 if layer_sum else num_kv_heads, batch)
    _infllm_score_kernel[grid](
        q, lengths, num_blocks, finalised, inv_freq if inv_freq is not None else live, repr_keys, live, out,
        num_kv_heads, max_blocks, float(fixed_position),
        *q.stride(), *repr_keys.stride(), *live.stride(), *out.stride(),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim, BLOCK_N=block_n,
        ROTATE=inv_freq is not None, LAYER_SUM=layer_sum, SUM_GROUP=gqa_reduce == "sum", SHARED_REPR=shared_repr,
        num_warps=num_warps, **launch_kwargs(live.device),
    )
    return out
