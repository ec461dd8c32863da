"""Launcher for hinted exact block top-K (checks, allocation, grid); the kernels are in
`prr.kernels.hinted_topk_jit`, the torch reference in `prr.kernels.reference_hinted_topk`.

Same contract as `prr.kernels.topk.topk_select` (same set, same layout, bit for bit) plus a
per-row threshold guess `hint`, read and then overwritten with this selection's k-th score (or
that written to `next_hint`): a decode step passes the buffer the previous step left, so the
hint costs no launch of its own (`Selector.topk_hint` keeps it per layer for selector.hinted_topk).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from .hinted_topk_jit import _hinted_topk_row_kernel, _hinted_topk_tiled_kernel
from .pdl import launch_kwargs
from .topk import (
    MAX_ROW_BLOCK,
    MULTI_PROGRAM_CAP,
    MULTI_PROGRAM_MIN_BLOCKS,
    PAD_BLOCK,
    TILE,
    _check_pow2_in,
    _check_topk_args,
    _default_num_warps,
    multi_program_chunk_for,
    topk_select_multi_program,
)

DEFAULT_ROUNDS = 3  # bracket rounds of the register-row kernel before its full-row fallback
MAX_ROUNDS = 8


def hint_candidate_cap(k: int, n: int) -> int:
    """The candidate buffer for top-k over rows of n blocks: 2k rounded up to a power of two, at
    least 64 (a hint k-th score typically leaves k plus a few percent of k at or above the round's
    best threshold; twice k leaves room for a drift of k between steps), at most the register row
    (next power of two >= n) or MAX_ROW_BLOCK for tiled rows."""
    block = triton.next_power_of_2(max(n, 1))
    return min(max(64, triton.next_power_of_2(max(2 * k, 1))), block, MAX_ROW_BLOCK)


def _check_hint(hint: Tensor, scores: Tensor, name: str, dtype: torch.dtype) -> None:
    batch, num_kv_heads = scores.shape[:2]
    if not isinstance(hint, Tensor) or hint.shape != (batch, num_kv_heads) or hint.dtype != dtype:
        got = f"{hint.dtype} {tuple(hint.shape)}" if isinstance(hint, Tensor) else type(hint).__name__
        raise ValueError(f"{name} must be a {dtype} tensor of shape [B, Hkv]=[{batch}, {num_kv_heads}]; got {got}")
    if hint.device != scores.device:
        raise ValueError(f"{name} is on {hint.device}, scores on {scores.device}; put them on one device")
    if not hint.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the kernel writes it in place); pass {name}.contiguous() "
                         "and keep that tensor")


def hinted_topk_select(
    scores: Tensor,
    k: int,
    num_blocks: Tensor,
    hint: Tensor,
    sink_blocks: int = 0,
    recent_blocks: int = 1,
    *,
    rounds: int = DEFAULT_ROUNDS,
    candidate_cap: int | None = None,
    radix_bits: int = 2,
    num_warps: int | None = None,
    path: Tensor | None = None,
    next_hint: Tensor | None = None,
    multi_program: bool | None = None,
    multi_program_chunk: int | None = None,
    multi_program_finish: bool = False,
) -> tuple[Tensor, Tensor]:
    """The top-k blocks of every (row, KV head), exactly `topk_select`'s, from a threshold guess.

    scores: [B, Hkv, N] fp32 (fp16/bf16 accepted; NaN-free); k, num_blocks [B], sink_blocks,
    recent_blocks: as `topk_select` (forced blocks +inf, blocks >= nb and -inf scores never taken).
    hint: [B, Hkv] fp32 contiguous, in place: in, a guess of each row's k-th largest score (any
    value: ±inf, far off, NaN are all exact, only slower); out, this selection's k-th largest
    score (forced blocks count as +inf; -inf where nothing is selectable): the next step's hint.
    -> indices [B, Hkv, min(k, N)] int32 ascending then padding 0, counts [B, Hkv] int32: equal
    to `topk_select(scores, k, num_blocks, sink_blocks, recent_blocks)`.
    rounds (0 .. MAX_ROUNDS): counting rounds that narrow the guess before rows of up to
    MAX_ROW_BLOCK blocks fall back to the full-row radix select (longer rows narrow to the exact
    k-th key instead). candidate_cap: the candidate buffer, a power of two >= 16 (None:
    `hint_candidate_cap`); radix_bits: the full-row fallback's bits per pass (1 or 2).
    path: None, or a [B, Hkv] int32 contiguous tensor receiving the rounds each row ran before its
    candidates fit the buffer (-1: the full row), for tests and benchmarks.
    next_hint: None (the k-th scores overwrite `hint`), or a [B, Hkv] fp32 contiguous tensor that
    receives them, `hint` left as it was (benchmarks replaying one step with one guess).
    multi_program: None (default): rows of topk.MULTI_PROGRAM_MIN_BLOCKS blocks or more (past the
    register row) take the multi-program path (kernels/topk_radix_jit.py: a round around the hint
    counted by many programs per row; when the keys at or above its best threshold fit the buffer,
    they are compacted and selected, else the radix levels run as in topk_select), shorter ones the
    one-program kernel; True / False: that path (tests, benchmarks). There the buffer is
    candidate_cap, or the larger of `hint_candidate_cap` and topk.MULTI_PROGRAM_CAP; the chunk
    multi_program_chunk (None: topk.multi_program_chunk_for); rounds and radix_bits do not apply, and
    path is 1 where the hint round's candidates fit, -1 where the radix levels ran, 0 where nothing
    is selectable. (The tiled one-program kernel stays reachable with multi_program=False.)
    multi_program_finish: topk_select's (False, the default: the hint round, LEVELS level passes and
    the emit; True: the hint round and level 1, whose last program of a row finishes it alone; same
    result, not yet timed on a GPU); it does nothing where the multi-program path does not run.
    """
    _check_topk_args(scores, k, num_blocks, sink_blocks, recent_blocks, radix_bits)
    _check_hint(hint, scores, "hint", torch.float32)
    if path is not None:
        _check_hint(path, scores, "path", torch.int32)
    if next_hint is not None:
        _check_hint(next_hint, scores, "next_hint", torch.float32)
    next_hint = hint if next_hint is None else next_hint
    if isinstance(rounds, bool) or not isinstance(rounds, int) or not 0 <= rounds <= MAX_ROUNDS:
        raise ValueError(f"rounds={rounds!r} must be an int in [0, {MAX_ROUNDS}]")
    if candidate_cap is not None and (isinstance(candidate_cap, bool) or not isinstance(candidate_cap, int)
                                      or candidate_cap < 16 or candidate_cap & (candidate_cap - 1)
                                      or candidate_cap > MAX_ROW_BLOCK):
        raise ValueError(f"candidate_cap={candidate_cap!r} must be None or a power of two in [16, {MAX_ROW_BLOCK}]")
    if multi_program not in (None, True, False):
        raise ValueError(f"multi_program={multi_program!r} must be None, True or False")
    if not isinstance(multi_program_finish, bool):
        raise ValueError(f"multi_program_finish={multi_program_finish!r} must be True or False")
    batch, num_kv_heads, n = scores.shape
    chunk = _check_pow2_in(multi_program_chunk, multi_program_chunk_for(batch * num_kv_heads, n),
                           "multi_program_chunk")
    k_out = min(k, n)
    indices = torch.empty(batch, num_kv_heads, k_out, dtype=torch.int32, device=scores.device)
    counts = torch.empty(batch, num_kv_heads, dtype=torch.int32, device=scores.device)
    if batch == 0 or num_kv_heads == 0:
        return indices, counts
    if k_out == 0:  # nothing selectable: the next hint says so (as the kernels write it)
        counts.zero_()
        next_hint.fill_(float("-inf"))
        if path is not None:
            path.zero_()
        return indices, counts
    k = k_out  # scalars passed to the kernels must fit int32
    sink_blocks = min(sink_blocks, n)
    recent_blocks = min(recent_blocks, n)
    if multi_program or (multi_program is None and n >= MULTI_PROGRAM_MIN_BLOCKS):
        cap = candidate_cap or max(hint_candidate_cap(k, n), MULTI_PROGRAM_CAP)
        topk_select_multi_program(scores, k, num_blocks, sink_blocks, recent_blocks, indices, counts, chunk, cap,
                                  num_warps, hint=hint, hint_out=next_hint, path=path,
                                  finish=multi_program_finish)
        if path is not None:  # the multi-program path's codes -> this function's: 1 round, or -1
            path.copy_(torch.where((path >= 2) | (path == -1), -1, path))
        return indices, counts
    block = triton.next_power_of_2(n)
    cap = min(candidate_cap or hint_candidate_cap(k, n), block)
    scratch = torch.empty(2, batch * num_kv_heads, cap, dtype=torch.int32, device=scores.device)
    common = (
        scores, num_blocks, hint, next_hint, indices, counts, counts if path is None else path,
        n, num_kv_heads, k, k_out, sink_blocks, recent_blocks,
        *scores.stride(),
        scratch[0], scratch[1],
    )
    grid = (num_kv_heads, batch)
    cand_radix = 4 if cap <= 512 else 2  # topk.candidate_filter_shape's rule for its candidate rows
    if block <= MAX_ROW_BLOCK:
        _hinted_topk_row_kernel[grid](
            *common,
            BLOCK=block, CAP=cap, ROUNDS=rounds, RADIX_BITS=radix_bits, CAND_RADIX=cand_radix,
            PAD_BLOCK=PAD_BLOCK, WRITE_PATH=path is not None,
            num_warps=num_warps or _default_num_warps(block),
            **launch_kwargs(scores.device),
        )
    else:
        _hinted_topk_tiled_kernel[grid](
            *common,
            TILE=TILE, CAP=cap, CAND_RADIX=cand_radix, PAD_BLOCK=PAD_BLOCK, WRITE_PATH=path is not None,
            num_warps=num_warps or _default_num_warps(TILE),
            **launch_kwargs(scores.device),
        )
    return indices, counts
