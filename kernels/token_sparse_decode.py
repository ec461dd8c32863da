"""Decode attention over listed TOKENS (token-level selection: a lightning indexer's top-2,048),
where kernels/sparse_decode.py attends over listed blocks.

Launcher (input checks, allocation, grid) for the Triton code in token_sparse_decode_jit.py.
Flash-decoding as the block kernel: each (batch row, KV head)'s list is split over programs, each
gathers TILE_TOKENS K/V rows per step (one row per listed token: D contiguous elements of the
[B, Hkv, T_max, D] cache), runs the GQA group's queries against them with tensor-core dots and an
online softmax, and writes a partial state; the splits are merged by the block kernel's
`merge_partials` (a second launch) or, with fuse_merge=True, by the row's last split (its merge
tail). The split plan is the block kernel's at block size 1 (`sparse_decode._split_plan`), so
both launch alike for the same number of tokens.

State convention (prr.attention_state): out is the normalised attention output, lse the fp32
natural log of Σ exp(scale · q·k) over the state's keys; an empty key set has lse = -inf and
out = 0, so prr's merges (kernels/prr_merge.py, kernels/reference_merge.py) combine these states
with any other. No launcher reads a device value on the host (no sync): grids depend only on
static shapes, so calls can be captured in CUDA graphs.

One list for all KV heads (DeepSeek's indexer picks one token set per batch row, shared by every
head): pass token_ids [B, 1, C] and token_counts [B, 1]. The kernel then reads that list with a
head stride of 0; an expanded view (`ids.expand(B, Hkv, C)`, stride 0) is the same launch. No
flag: the list's head axis says which it is.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .sparse_decode import (
    SUPPORTED_DTYPES,
    _check_device,
    _check_int_tensor,
    _is_power_of_two,
    _launch_options,
    _next_power_of_two,
    _split_outputs,
    _split_plan,
    check_decode_operands,
    dot_mode,
)
from .sparse_decode_jit import LOG2E
from .token_sparse_decode_jit import token_scores_kernel, token_sparse_decode_split_kernel

ID_DTYPES = (torch.int32, torch.int64)
COUNT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.uint8)


def token_sparse_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    token_ids: Tensor,
    token_counts: Tensor,
    lengths: Tensor,
    scale: float,
    *,
    merge_splits: bool = True,
    out_dtype: torch.dtype = torch.float32,
    fuse_merge: bool = False,
    arrivals: Tensor | None = None,
    tokens_per_split: int | None = None,
    tile_tokens: int | None = None,
    native_dot: bool | None = None,
    precise_pv: bool = True,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Decode attention over the tokens listed per (batch row, KV head), or per batch row.

    q:            [B, Hq, D] fp16 / bf16 / fp32 (any strides); query head h uses KV head
                  h // G, G = Hq / Hkv (GQA; G <= 64).
    k_cache,
    v_cache:      [B, Hkv, T_max, D], same dtype (fp16 / bf16 / fp32); token t of a row at
                  [b, h, t, :] (prr.cache.PagedKVCache.keys[layer]). D in (64, 128, 256).
    token_ids:    [B, Hkv, C] or [B, 1, C] (one list shared by every KV head) int32 / int64;
                  entries [0, token_counts[b, h]) are the tokens to attend (distinct; a token
                  listed twice is attended twice), any order; the rest is padding, never read
                  as a token. Ids < 0 or >= lengths[b] are skipped.
    token_counts: [B, Hkv] or [B, 1] (matching token_ids' head axis) integer; clamped to [0, C]
                  on the device.
    lengths:      [B] int32 / int64 tokens per batch row; lengths[b] <= T_max is the caller's
                  contract (never checked: that would sync).
    scale:        softmax scale (a Python number), e.g. D ** -0.5.
    -> (out [B, Hq, D] out_dtype, lse [B, Hq] fp32); an empty list gives lse = -inf, out = 0.

    merge_splits=False: the splits' partial states unmerged, (out [B, Hq, S, D] fp32,
    lse [B, Hq, S] fp32), for a caller that merges them with other partials in its own launch
    (prr_merge.merge_speculation); S = token_sparse_decode_plan(...).num_splits.
    out_dtype (merged output only): the model's 16-bit dtype saves the caller a cast launch.
    fuse_merge=True: the last split of each (row, KV head) to finish merges the row (an arrival
    counter, no merge launch). arrivals: an int32 workspace of B * Hkv zeros that every launch
    leaves zeroed (default: allocated); one per stream, never shared by launches that can run at
    once. Off by default, as in sparse_decode (measured there: faster only when the splits fit
    the SMs once, `sparse_decode.sparse_decode_one_wave`).
    Tuning (defaults from static shapes and the SM count: `token_sparse_decode_plan`):
    tokens_per_split (list entries per program, rounded up to whole tiles), tile_tokens (K/V rows
    gathered per step, a power of two >= 16), native_dot (16-bit tl.dot with fp32 accumulate;
    default on for fp16/bf16 when q and the cache share a dtype, off in the interpreter for bf16),
    precise_pv (native_dot only: P·V as hi·V + lo·V), num_warps, num_stages.
    """
    _check_device(q, k_cache, v_cache, token_ids, token_counts, lengths)
    batch, num_q_heads, num_kv_heads, head_dim, group = check_decode_operands(q, k_cache, v_cache,
                                                                              "token_sparse_decode")
    list_heads, capacity = check_token_lists(token_ids, token_counts, lengths, scale, batch, num_kv_heads)
    native_dot, input_precision = dot_mode(q, k_cache, native_dot)
    if out_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} is not supported; use one of fp16, bf16, fp32")
    if out_dtype != torch.float32 and not merge_splits:
        raise ValueError(f"out_dtype={out_dtype} applies to the merged output only: partial states "
                         f"(merge_splits=False) stay fp32 for merging")
    if fuse_merge and not merge_splits:
        raise ValueError("fuse_merge=True merges the splits into one state: it takes merge_splits=True")
    if tile_tokens is not None and (not _is_power_of_two(tile_tokens) or tile_tokens < 16):
        raise ValueError(f"tile_tokens={tile_tokens} must be a power of two >= 16 (a tl.dot dimension)")
    if tokens_per_split is not None and tokens_per_split < 1:
        raise ValueError(f"tokens_per_split={tokens_per_split} must be >= 1")

    device = q.device
    if batch == 0:
        return (torch.zeros(0, num_q_heads, head_dim, dtype=out_dtype, device=device),
                torch.zeros(0, num_q_heads, device=device))
    rows = batch * num_kv_heads
    tile, entries, num_splits = token_sparse_decode_plan(capacity, batch, num_kv_heads, device, tile_tokens,
                                                         tokens_per_split, head_dim=head_dim, cache_dtype=k_cache.dtype)
    states = _split_outputs(batch, num_q_heads, head_dim, group, num_splits, merge_splits, fuse_merge, out_dtype,
                            arrivals, lengths, tokens_per_split)
    shared = list_heads == 1  # one list per batch row: every KV head reads it (head stride 0)
    ids = token_ids if capacity > 0 else token_counts  # never dereferenced when C = 0
    id_strides = (token_ids.stride(0), 0 if shared else token_ids.stride(1), token_ids.stride(2)) if capacity else (0,) * 3
    token_sparse_decode_split_kernel[(num_splits, rows)](
        q, k_cache, v_cache, ids, token_counts, lengths, states.out, states.lse,
        float(scale) * LOG2E, num_kv_heads, capacity, entries,
        q.stride(0), q.stride(1), q.stride(2),
        *k_cache.stride(), *v_cache.stride(),
        *id_strides,
        token_counts.stride(0), 0 if shared else token_counts.stride(1),
        lengths.stride(0),
        *states.state_strides,
        *states.merge_args,
        GROUP=group, GROUP_PAD=max(16, _next_power_of_two(group)), HEAD_DIM=head_dim, TILE_TOKENS=tile,
        NATIVE_DOT=native_dot, INPUT_PRECISION=input_precision, PRECISE_PV=bool(precise_pv),
        **states.merge_constexprs,
        **_launch_options(num_warps, num_stages, device),
    )  # fmt: skip
    return states.result(merge_splits, out_dtype)


def token_scores(
    q: Tensor,
    k_cache: Tensor,
    token_ids: Tensor,
    token_counts: Tensor,
    lengths: Tensor,
    scale: float,
    *,
    tokens_per_program: int | None = None,
    num_warps: int = 4,
) -> Tensor:
    """scale · q·k of every query head against every listed token: exact-mode PRR's speculative
    state of a token list (kernels/prr_repair.py). A token's attention state over itself alone is
    (v_t, scale · q·k_t); its value row stays in the cache, where the repair reads it, so the
    speculation writes [B, Hq, C] fp32 scores instead of [B, Hq, C, D] states (at C = 2,048 on the
    8B shape: 256 KiB a row and layer instead of 32 MiB) and reads K only.

    q, k_cache, token_ids, token_counts, lengths, scale: as token_sparse_decode (no v_cache).
    -> scores [B, Hq, C] fp32, natural-log units (the lse of a one-token state); -inf for
    entries >= the count and ids < 0 or >= lengths[b].
    tokens_per_program: list entries per program (default: token_sparse_decode's split plan for C).
    """
    _check_device(q, k_cache, token_ids, token_counts, lengths)
    batch, num_q_heads, num_kv_heads, head_dim, group = check_decode_operands(q, k_cache, k_cache, "token_scores")
    list_heads, capacity = check_token_lists(token_ids, token_counts, lengths, scale, batch, num_kv_heads)
    if tokens_per_program is not None and tokens_per_program < 1:
        raise ValueError(f"tokens_per_program={tokens_per_program} must be >= 1")
    native_dot, input_precision = dot_mode(q, k_cache, None)
    device = q.device
    scores = torch.empty(batch, num_q_heads, capacity, dtype=torch.float32, device=device)
    if batch == 0 or capacity == 0:
        return scores
    tile, entries, chunks = token_sparse_decode_plan(capacity, batch, num_kv_heads, device, None, tokens_per_program,
                                                     head_dim=head_dim, cache_dtype=k_cache.dtype)
    shared = list_heads == 1
    token_scores_kernel[(chunks, batch * num_kv_heads)](
        q, k_cache, token_ids, token_counts, lengths, scores,
        float(scale), num_kv_heads, capacity, entries,
        q.stride(0), q.stride(1), q.stride(2),
        *k_cache.stride(),
        token_ids.stride(0), 0 if shared else token_ids.stride(1), token_ids.stride(2),
        token_counts.stride(0), 0 if shared else token_counts.stride(1),
        lengths.stride(0),
        *scores.stride(),
        GROUP=group, GROUP_PAD=max(16, _next_power_of_two(group)), HEAD_DIM=head_dim, TILE_TOKENS=tile,
        NATIVE_DOT=native_dot, INPUT_PRECISION=input_precision,
        **_launch_options(num_warps, None, device),
    )  # fmt: skip
    return scores


def check_token_lists(token_ids: Tensor, token_counts: Tensor, lengths: Tensor, scale: float, batch: int,
                      num_kv_heads: int) -> tuple[int, int]:
    """The token-list launchers' list arguments (token_sparse_decode, token_scores): token_ids
    [B, Hkv, C] or [B, 1, C], token_counts [B, Hkv] or [B, 1], lengths [B], scale a Python
    number -> (lists per batch row: Hkv or 1, C)."""
    if not isinstance(token_ids, Tensor) or token_ids.dim() != 3:
        raise ValueError(f"token_ids must be [B, Hkv, C] or [B, 1, C], got "
                         f"{list(token_ids.shape) if isinstance(token_ids, Tensor) else type(token_ids).__name__}")
    list_heads, capacity = token_ids.shape[1], token_ids.shape[2]
    if list_heads not in (1, num_kv_heads):
        raise ValueError(f"token_ids has {list_heads} lists per batch row: give one per KV head (Hkv={num_kv_heads}) "
                         f"or one shared by all ([B, 1, C])")
    _check_int_tensor("token_ids", token_ids, (batch, list_heads, capacity), ID_DTYPES)
    _check_int_tensor("token_counts", token_counts, (batch, list_heads), COUNT_DTYPES)
    _check_int_tensor("lengths", lengths, (batch,), ID_DTYPES)
    if isinstance(scale, Tensor) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python number (a tensor would sync), got {type(scale).__name__}")
    return list_heads, capacity


class TokenSplitPlan(NamedTuple):
    """How token_sparse_decode splits each (batch row, KV head)'s list: grid (num_splits, B * Hkv)."""

    tile_tokens: int  # K/V rows a program gathers per step
    tokens_per_split: int  # list entries per program (whole tiles)
    num_splits: int


def token_sparse_decode_plan(
    capacity: int, batch: int, num_kv_heads: int, device: torch.device | str = "cuda",
    tile_tokens: int | None = None, tokens_per_split: int | None = None, *, head_dim: int, cache_dtype: torch.dtype,
) -> TokenSplitPlan:
    """The launch token_sparse_decode makes for lists of C = capacity entries over a
    [B, Hkv, T, head_dim] cache of cache_dtype (static shapes only): the block kernel's plan at block
    size 1 (sparse_decode._split_plan): about SPLIT_PROGRAMS_PER_SM programs per SM, at least
    MIN_TOKENS_PER_SPLIT tokens a split, tile 32, or 128 for a 16-bit cache with D <= 128 when every
    split gets an SM of its own."""
    elem_size = torch.empty((), dtype=cache_dtype).element_size()
    return TokenSplitPlan(*_split_plan(capacity, batch * num_kv_heads, 1, head_dim, elem_size, tile_tokens,
                                       tokens_per_split, torch.device(device)))
