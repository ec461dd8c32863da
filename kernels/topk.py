"""Launcher for block top-K selection (checks, allocation, grid); the kernels are in
`prr.kernels.topk_jit` (one program per row), `prr.kernels.topk_radix_jit` (many programs per
row: long rows) and `prr.kernels.topk_split_jit` (split rows), the torch reference in
`prr.kernels.reference_selection`.

Which path a row length takes (multi_program=None), the rule and why: rows of up to
MULTI_PROGRAM_MIN_BLOCKS - 1 = MAX_ROW_BLOCK blocks, one program per row with the row in
registers; longer rows, the multi-program radix select. On an H100
(experiments/results/h100/hinted_topk_20261207) the register row takes 10-22 µs at 8,192 blocks
(torch.topk 46-61 µs), while past MAX_ROW_BLOCK the row leaves registers and the one program
re-reads it on every counting pass (`_topk_tiled_kernel`): 205 µs at 32K, 1.05 ms at 128K, 3-14x
torch.topk. The multi-program path costs 6 launches (a memset, 4 level passes of which the usual
row needs 2-3, the emit; 7 with hinted top-k's round) and 3-4 reads of the row spread over the
whole GPU; below 16K a launch-bound path of that many launches is not expected to beat the single
register-row program, so the cut stays at the register limit until experiments/bench_topk_long.py
measures the two side by side at 8K/16K (not yet run).
multi_program_finish=True cuts the multi-program path to 2 launches (a memset and level 1, whose
last program of a row finishes the row alone, re-reading it tile by tile): for a decode step's
single row (H200, 32K candidates, k = 2048: 28.6 µs a layer, experiments/results/h200/session6_20261207;
of it 22.7 in 4 level launches that mostly find nothing to do, 4.9 in the emit) the launches, not the
bytes, are the cost. But the finishing program walks the row alone, serially, once per level left (at
most 3) and once to emit: at 32K that is 16 tiles a walk, latency-bound. Off by default until
experiments/bench_topk_long.py --finish times it beside the 6 launches on a GPU (not yet run).
The split path (split=CHUNK) is not chosen automatically: its merge is again one program over up
to MAX_ROW_BLOCK candidates (a register row of up to 16K), it was timed only up to 8,192 blocks
(results/h200/bench_flashinfer_topk_chunks.md: 0.82-1.59x the row kernel), and it cannot hold
k = 2048 of a 256K row (chunks x min(k, CHUNK) > MAX_ROW_BLOCK).
"""

from __future__ import annotations

import math

import torch
import triton
from torch import Tensor

from .pdl import launch_kwargs
from .topk_jit import _topk_row_kernel, _topk_tiled_kernel
from .topk_radix_jit import (
    ARRIVALS,
    BINS,
    HINT_COUNTS,
    LEVELS,
    STATE,
    _radix_emit_kernel,
    _radix_hint_kernel,
    _radix_level_kernel,
)
from .topk_split_jit import _topk_chunk_kernel, _topk_merge_kernel

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_ROW_BLOCK = 16384  # rows up to this many blocks live in registers; longer rows are tiled
TILE = 4096  # tile of the tiled kernel (re-read from L2 on every counting pass)
MAX_BLOCKS_PER_ROW = (1 << 21) - 1  # the 2-bit passes pack three counts into 21-bit fields
PAD_BLOCK = 256
MIN_SPLIT = 16  # smallest chunk of the split-row kernels (smaller ones only add programs)
MULTI_PROGRAM_MIN_BLOCKS = MAX_ROW_BLOCK + 1  # rows this long and longer: the multi-program path (module doc)
MULTI_PROGRAM_CHUNK = 4096  # blocks per program of the multi-program path, at least (16 KB of fp32 scores)
MULTI_PROGRAM_PROGRAMS = 4096  # programs per launch the chunk grows to stay under (multi_program_chunk_for)
MULTI_PROGRAM_TILE = 2048  # blocks a program holds in registers at a time (its chunk, tile by tile)
MULTI_PROGRAM_WARPS = 8  # at TILE 2048 (triton 3.6, sm_90): 106-112 registers a thread, 2 programs an SM;
# whole 4096-block chunks took 118 (level passes) and 198 (emit: 1 program an SM), 16K chunks spilled
MULTI_PROGRAM_CAP = 4096  # candidates the multi-program path selects among in one program's registers


def filter_groups(block: int, k: int) -> int:
    """Groups of the row kernel's candidate filter for rows of `block` (a power of two) and top-k
    k: the next power of two >= k (the bound, the smallest group max, then has at least k keys at
    or above it), each group of at least 16 blocks, rows of at least 1024; 0 where it cannot apply."""
    groups = triton.next_power_of_2(max(k, 1))
    return 0 if block < 1024 or groups * 16 > block else groups


def candidate_filter_shape(block: int, k: int, rows: int = 1) -> tuple[int, int, int]:
    """-> (groups, cap, candidate radix bits) of the row kernel's candidate filter, (0, 1, 4) where
    it does not pay. Keys at or above the smallest of G group maxima number about
    G (ln G + 0.58) for iid scores (G times the mean largest of G Exp(1)); the scratch holds 1.5x
    that (2x above 16 rows: a launch waits for its slowest row to fall back to the full row), a
    power of two, and the filter runs where that is at most a quarter of the row. Over the
    candidates 4-bit passes up to 512 of them, 2-bit above. Chosen on the H200
    (results/h200/bench_flashinfer_topk_filter.md): at 8192 blocks k = 128 it takes 17.3-17.5 µs
    (cap 2048, 2-bit) where an eighth-of-the-row cap took 17.6-24.3 and the full row 22.3-22.6; where
    the cap would exceed a quarter of the row the full row was as fast or faster, except at 8 rows
    x 8192 blocks with k = 512 (cap 4096, 2-bit: 20.4 against 22.9 µs; below 1.5x the mean, so
    left to the full row here)."""
    groups = filter_groups(block, k)
    if not groups:
        return 0, 1, 4
    margin = 1.5 if rows <= 16 else 2.0
    cap = max(16, triton.next_power_of_2(math.ceil(margin * groups * (math.log(groups) + 0.58))))
    if cap * 4 > block:
        return 0, 1, 4
    return groups, cap, 4 if cap <= 512 else 2


def _default_num_warps(block: int) -> int:
    """8 warps from rows of 2048 blocks up: at 128K on the H200 (results/h200/try_select_latency.json)
    8 beat 4 at 2048 blocks (7.05 vs 7.61 µs, batch 1) and 16 at 8192 (16.9 vs 19.1); 1 or 2 warps
    were slower everywhere (their reductions are cheaper, each thread has more keys)."""
    return max(4, min(8, block // 256))


def _check_topk_args(
    scores: Tensor, k: int, num_blocks: Tensor, sink_blocks: int, recent_blocks: int, radix_bits: int
) -> None:
    if scores.dim() != 3:
        raise ValueError(f"scores must be [B, Hkv, N]; got shape {tuple(scores.shape)}")
    if scores.dtype not in FLOAT_DTYPES:
        raise ValueError(f"scores must be fp32 (or fp16/bf16); got {scores.dtype}")
    batch, num_kv_heads, n = scores.shape
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k={k!r} must be an int >= 0 (blocks to select)")
    for name, value in (("sink_blocks", sink_blocks), ("recent_blocks", recent_blocks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r} must be an int >= 0")
    if num_blocks.shape != (batch,) or num_blocks.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"num_blocks must be an int32 tensor of shape [B]=[{batch}]; got {num_blocks.dtype} {tuple(num_blocks.shape)}")
    if num_blocks.device != scores.device:
        raise ValueError(f"num_blocks is on {num_blocks.device}, scores on {scores.device}; put them on one device")
    if radix_bits not in (1, 2):
        raise ValueError(f"radix_bits={radix_bits} must be 1 or 2")
    if n > MAX_BLOCKS_PER_ROW:
        raise ValueError(f"rows of N={n} blocks exceed the kernel's limit of {MAX_BLOCKS_PER_ROW} blocks")


def topk_select(
    scores: Tensor,
    k: int,
    num_blocks: Tensor,
    sink_blocks: int = 0,
    recent_blocks: int = 1,
    *,
    radix_bits: int = 2,
    num_warps: int | None = None,
    candidate_filter: bool = True,
    candidate_cap: int | None = None,
    candidate_radix_bits: int | None = None,
    split: int | None = None,
    multi_program: bool | None = None,
    multi_program_chunk: int | None = None,
    multi_program_cap: int | None = None,
    multi_program_path: Tensor | None = None,
    multi_program_finish: bool = False,
) -> tuple[Tensor, Tensor]:
    """The top-k blocks of every (row, KV head), with forced blocks, by threshold select.

    scores: [B, Hkv, N] fp32 block scores (fp16/bf16 accepted; NaN-free);
    k: blocks to keep (>= 0); num_blocks: [B] int32, blocks in each row's context (clamped
    to [0, N]); forced blocks: the first min(sink_blocks, nb) blocks and the last
    recent_blocks blocks below nb (the newest included).
    -> indices [B, Hkv, min(k, N)] int32: the selected block ids in ascending block order,
       then padding 0; counts [B, Hkv] int32: valid entries, min(k, #selectable blocks)
       (= min(k, nb) unless some blocks below nb score -inf: those are never taken).
    The selected set equals `prr.blocks.top_blocks(s, k)` with s = scores where forced
    blocks are +inf and blocks >= nb are -inf: higher scores first, ties broken towards the
    lower block index, so a selection is a deterministic function of its scores.
    radix_bits (1 or 2): threshold bits fixed per counting pass over the row (32 or 16 passes).
    candidate_filter: for long rows and small k, run the passes over the blocks at or above a
    lower bound of the k-th score (the smallest of k group maxima) only; same result.
    candidate_cap: None (default): `candidate_filter_shape`'s policy; or a power of two >= 16:
    the filter runs wherever it can (`filter_groups`), keeping at most this many candidates (more:
    the full row). candidate_radix_bits (None: the policy's for this row and k; 2 or 4):
    threshold bits per pass over the candidates. Both tuning knobs, for benchmarks and tests;
    they do nothing with candidate_filter=False or split.
    split: None (default): one program per (row, KV head). An int CHUNK (a power of two,
    16 .. MAX_ROW_BLOCK): split rows, many programs per row (kernels/topk_split_jit.py): each
    chunk of CHUNK blocks keeps its top min(k, CHUNK), then one program per row selects the
    top k of those candidates (cdiv(N, CHUNK) * min(k, CHUNK) <= MAX_ROW_BLOCK); same result.
    num_warps, when given, applies to both of its kernels; candidate_filter does not apply.
    multi_program: None (default): the module doc's rule (rows of MULTI_PROGRAM_MIN_BLOCKS blocks
    or more); True / False: that path whatever the length (benchmarks and tests). The multi-program
    radix select (kernels/topk_radix_jit.py) runs cdiv(N, multi_program_chunk) programs per row
    (None: `multi_program_chunk_for`; a power of two, 16 .. MAX_ROW_BLOCK) and selects among at most
    multi_program_cap candidates in one program (None: MULTI_PROGRAM_CAP; a power of two,
    16 .. MAX_ROW_BLOCK); same result. num_warps, when given, applies to its kernels.
    multi_program_path: None, or a [B, Hkv] int32 contiguous tensor receiving how the multi-program
    path found each row's threshold (tests and benchmarks): 2..4, among the candidates compacted
    at that level; -1, by all four histograms (more than the cap share its top 24 bits: one
    program emits the row); 0, nothing selectable. Requires that path to run.
    multi_program_finish: False (default): the multi-program path's 6 launches (a memset, LEVELS
    level passes, the emit). True: 2 (a memset and level 1, whose last program of a row finishes the
    row alone: `_finish_row` in kernels/topk_radix_jit.py); the same result bit for bit. Off by
    default until timed on a GPU against the 6 launches (experiments/bench_topk_long.py --finish):
    it replaces launches that do nearly nothing with one program's serial walk over the row.
    Like multi_program_chunk, it does nothing where the multi-program path does not run.
    """
    _check_topk_args(scores, k, num_blocks, sink_blocks, recent_blocks, radix_bits)
    if candidate_cap is not None and (isinstance(candidate_cap, bool) or not isinstance(candidate_cap, int)
                                      or candidate_cap < 16 or candidate_cap & (candidate_cap - 1)):
        raise ValueError(f"candidate_cap={candidate_cap!r} must be None or a power of two >= 16")
    if candidate_radix_bits not in (None, 2, 4):
        raise ValueError(f"candidate_radix_bits={candidate_radix_bits!r} must be 2 or 4")
    if split is not None:
        _check_split(split, k, scores.shape[-1])
    if multi_program not in (None, True, False):
        raise ValueError(f"multi_program={multi_program!r} must be None, True or False")
    if not isinstance(multi_program_finish, bool):
        raise ValueError(f"multi_program_finish={multi_program_finish!r} must be True or False")
    if split is not None and multi_program:
        raise ValueError("split and multi_program=True are two different paths; pass one of them")
    if multi_program_path is not None:
        b, h = scores.shape[:2]
        if not isinstance(multi_program_path, Tensor) or multi_program_path.shape != (b, h) \
                or multi_program_path.dtype != torch.int32 or not multi_program_path.is_contiguous() \
                or multi_program_path.device != scores.device:
            raise ValueError(f"multi_program_path must be a contiguous int32 tensor [B, Hkv]=[{b}, {h}] on "
                             f"{scores.device}; got {multi_program_path!r:.80}")
    batch, num_kv_heads, n = scores.shape
    chunk = _check_pow2_in(multi_program_chunk, multi_program_chunk_for(batch * num_kv_heads, n),
                           "multi_program_chunk")
    cap = _check_pow2_in(multi_program_cap, MULTI_PROGRAM_CAP, "multi_program_cap")
    k_out = min(k, n)
    indices = torch.empty(batch, num_kv_heads, k_out, dtype=torch.int32, device=scores.device)
    counts = torch.empty(batch, num_kv_heads, dtype=torch.int32, device=scores.device)
    if batch == 0 or num_kv_heads == 0:
        return indices, counts
    if k_out == 0:
        counts.zero_()
        return indices, counts
    # Scalars passed to the kernels must fit int32.
    k = min(k, n)
    sink_blocks = min(sink_blocks, n)
    recent_blocks = min(recent_blocks, n)

    if split is not None:
        _topk_select_split(scores, k, num_blocks, sink_blocks, recent_blocks, indices, counts,
                           split, radix_bits, num_warps)
        return indices, counts
    if multi_program or (multi_program is None and n >= MULTI_PROGRAM_MIN_BLOCKS):
        topk_select_multi_program(scores, k, num_blocks, sink_blocks, recent_blocks, indices, counts,
                                  chunk, cap, num_warps, path=multi_program_path, finish=multi_program_finish)
        return indices, counts
    if multi_program_path is not None:
        raise ValueError(f"multi_program_path is written by the multi-program path only, which rows of N={n} "
                         f"do not take here; pass multi_program=True")

    grid = (num_kv_heads, batch)
    common = (
        scores, num_blocks, indices, counts,
        n, num_kv_heads, k, k_out, sink_blocks, recent_blocks,
        *scores.stride(),
    )
    block = triton.next_power_of_2(n)
    if block <= MAX_ROW_BLOCK:
        groups, cap, cand_radix = candidate_filter_shape(block, k, batch * num_kv_heads)
        if candidate_cap is not None:
            groups, cap = filter_groups(block, k), min(candidate_cap, block)
        if not candidate_filter or not groups:
            groups, cap = 0, 1
        cand_radix = candidate_radix_bits or cand_radix
        scratch = torch.empty(2, batch * num_kv_heads, cap, dtype=torch.int32, device=scores.device)
        _topk_row_kernel[grid](
            *common,
            scratch[0], scratch[1],
            GROUPS=groups, CAP=cap, CAND_RADIX=cand_radix,
            BLOCK=block,
            RADIX_BITS=radix_bits,
            PAD_BLOCK=PAD_BLOCK,
            num_warps=num_warps or _default_num_warps(block),
            **launch_kwargs(scores.device),
        )
    else:
        _topk_tiled_kernel[grid](
            *common,
            TILE=TILE,
            RADIX_BITS=radix_bits,
            PAD_BLOCK=PAD_BLOCK,
            num_warps=num_warps or _default_num_warps(TILE),
        )
    return indices, counts


def _split_shape(split: int, k: int, n: int) -> tuple[int, int]:
    """-> (chunks C, candidates kept per chunk KC) of the split-row kernels."""
    return triton.cdiv(n, split), min(k, split)


def _check_split(split: int, k: int, n: int) -> None:
    if isinstance(split, bool) or not isinstance(split, int) or split < MIN_SPLIT or split > MAX_ROW_BLOCK \
            or split & (split - 1):
        raise ValueError(f"split={split!r} must be None or a power-of-two chunk of {MIN_SPLIT} .. {MAX_ROW_BLOCK} blocks")
    chunks, kc = _split_shape(split, min(k, n), n)
    if chunks * kc > MAX_ROW_BLOCK:
        raise ValueError(
            f"split={split} leaves {chunks} chunks x {kc} candidates = {chunks * kc} > {MAX_ROW_BLOCK} for the merge"
            f" (N={n}, k={k}); use a larger chunk, or split=None"
        )


def _topk_select_split(
    scores: Tensor, k: int, num_blocks: Tensor, sink_blocks: int, recent_blocks: int,
    indices: Tensor, counts: Tensor, split: int, radix_bits: int, num_warps: int | None,
) -> None:
    """topk_select's split-row path (arguments checked and clamped there): fills indices
    [B, Hkv, K_out] and counts [B, Hkv] in place."""
    batch, num_kv_heads, n = scores.shape
    k_out = indices.shape[-1]
    chunks, kc = _split_shape(split, k, n)
    # Phase 1 -> per-chunk candidates: ids [B * Hkv, C, KC] (ascending, then padding), counts [B * Hkv, C]
    cand_ids = torch.empty(batch * num_kv_heads, chunks, kc, dtype=torch.int32, device=scores.device)
    cand_counts = torch.empty(batch * num_kv_heads, chunks, dtype=torch.int32, device=scores.device)
    pdl = launch_kwargs(scores.device)
    _topk_chunk_kernel[(chunks, num_kv_heads, batch)](
        scores, num_blocks, cand_ids, cand_counts,
        n, num_kv_heads, chunks, kc, sink_blocks, recent_blocks,
        *scores.stride(),
        CHUNK=split,
        RADIX_BITS=radix_bits,
        PAD_BLOCK=PAD_BLOCK,
        num_warps=num_warps or _default_num_warps(split),
        **pdl,
    )
    # Phase 2: candidates -> indices [B, Hkv, K_out], counts [B, Hkv] (topk_select's contract)
    block = triton.next_power_of_2(chunks * kc)
    _topk_merge_kernel[(num_kv_heads, batch)](
        scores, num_blocks, cand_ids, cand_counts, indices, counts,
        n, num_kv_heads, chunks, kc, k, k_out, sink_blocks, recent_blocks,
        *scores.stride(),
        BLOCK=block,
        RADIX_BITS=radix_bits,
        PAD_BLOCK=PAD_BLOCK,
        num_warps=num_warps or _default_num_warps(block),
        **pdl,
    )


def _check_pow2_in(value: int | None, default: int, name: str) -> int:
    """-> value (default when None) after checking it is a power of two in [MIN_SPLIT, MAX_ROW_BLOCK]."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_SPLIT <= value <= MAX_ROW_BLOCK \
            or value & (value - 1):
        raise ValueError(f"{name}={value!r} must be None or a power of two in [{MIN_SPLIT}, {MAX_ROW_BLOCK}]")
    return value


def multi_program_chunk_for(rows: int, n: int) -> int:
    """The multi-program path's default chunk for `rows` (B * Hkv) rows of n blocks: MULTI_PROGRAM_CHUNK,
    doubled (up to MAX_ROW_BLOCK) while a launch would run more than MULTI_PROGRAM_PROGRAMS programs.
    Every launch runs all of them, also the level passes that only read a row's state and return
    (the usual row finds its threshold at level 2 or 3 of 4): at 64 rows of 1M blocks, chunks of
    4096 would be 16,384 programs a launch, chunks of 16,384 are 4,096 (about 4 waves of 8 programs
    on each of 132 SMs), each reading 64 KB. Unmeasured (experiments/bench_topk_long.py --chunk)."""
    wanted = triton.next_power_of_2(max(1, triton.cdiv(rows * n, MULTI_PROGRAM_PROGRAMS)))
    return min(MAX_ROW_BLOCK, max(MULTI_PROGRAM_CHUNK, wanted))


def multi_program_workspace_ints(rows: int, n: int, chunk: int) -> int:
    """int32 entries of the multi-program path's zeroed workspace for `rows` (B * Hkv) rows of n
    blocks: per row its state, LEVELS histograms of BINS bins, ARRIVALS arrival counters, a
    candidate count and two per-chunk counts (the candidate buffers, 2 x cap a row, are not zeroed;
    a hint round adds HINT_COUNTS int64 a row)."""
    return rows * (STATE.value + LEVELS.value * BINS.value + ARRIVALS.value + 1 + 2 * triton.cdiv(n, chunk))


def topk_select_multi_program(
    scores: Tensor, k: int, num_blocks: Tensor, sink_blocks: int, recent_blocks: int,
    indices: Tensor, counts: Tensor, chunk: int, cap: int, num_warps: int | None,
    hint: Tensor | None = None, hint_out: Tensor | None = None, path: Tensor | None = None,
    finish: bool = False,
) -> None:
    """topk_select's multi-program path (arguments checked and clamped by the caller, k >= 1,
    B, Hkv >= 1): fills indices [B, Hkv, K_out] and counts [B, Hkv] in place.
    hint: None, or a [B, Hkv] fp32 contiguous guess of each row's k-th score (kernels/hinted_topk.py):
    a round around it first, whose candidates, when they fit the buffer, replace the histogram levels.
    hint_out: None or a [B, Hkv] fp32 contiguous tensor receiving each row's k-th largest score (-inf
    when none; may be `hint`: read before written); path: None or topk_select's multi_program_path
    (1: the hint round's candidates held T). Launches: a memset, the hint round (with a hint),
    LEVELS level passes, the emit; finish=True (topk_select's multi_program_finish, not yet the
    default: to be timed on a GPU first): a memset, the hint round (with a hint) and level 1 only,
    whose last program of each row finishes the row. The workspace is sized from host ints only
    (no synchronisation: capturable in CUDA graphs)."""
    batch, num_kv_heads, n = scores.shape
    rows = batch * num_kv_heads
    k_out = indices.shape[-1]
    chunks = triton.cdiv(n, chunk)
    ints = multi_program_workspace_ints(rows, n, chunk)
    hint_int64 = rows * HINT_COUNTS.value if hint is not None else 0
    workspace = torch.zeros(hint_int64 + triton.cdiv(ints, 2), dtype=torch.int64, device=scores.device)  # one memset
    hint_counts = workspace[:hint_int64]
    state, hist, arrivals, cand_count, gt, eq = torch.split(
        workspace[hint_int64:].view(torch.int32)[:ints],
        [rows * STATE.value, rows * LEVELS.value * BINS.value, rows * ARRIVALS.value, rows, rows * chunks, rows * chunks])
    candidates = torch.empty(2, rows, cap, dtype=torch.int32, device=scores.device)
    grid = (chunks, num_kv_heads, batch)
    pdl = launch_kwargs(scores.device)
    tile = min(chunk, MULTI_PROGRAM_TILE)
    warps = num_warps or MULTI_PROGRAM_WARPS
    if hint is not None:
        _radix_hint_kernel[grid](
            scores, num_blocks, hint, n, num_kv_heads, chunks, k, sink_blocks, recent_blocks,
            *scores.stride(),
            state, hint_counts, arrivals,
            CHUNK=chunk, TILE=tile, CAP=cap,
            num_warps=warps,
            **pdl,
        )
    write_hint, write_path = hint_out is not None, path is not None
    hint_out = counts if hint_out is None else hint_out  # (a placeholder where not written)
    path_out = counts if path is None else path
    for level in range(1, 2 if finish else LEVELS.value + 1):
        _radix_level_kernel[grid](
            scores, num_blocks, n, num_kv_heads, chunks, k, k_out, sink_blocks, recent_blocks,
            *scores.stride(),
            state, hist, arrivals, gt, eq, cand_count, candidates[0], candidates[1],
            indices, counts, hint_out, path_out,
            LEVEL=level, CHUNK=chunk, TILE=tile, CAP=cap, CAND_RADIX=4 if cap <= 512 else 2,
            FINISH=finish, PAD_BLOCK=PAD_BLOCK, WRITE_HINT=finish and write_hint, WRITE_PATH=finish and write_path,
            num_warps=warps,
            **pdl,
        )
    if finish:
        return
    _radix_emit_kernel[grid](
        scores, num_blocks, indices, counts, n, num_kv_heads, chunks, k_out, sink_blocks, recent_blocks,
        *scores.stride(),
        state, gt, eq, hint_out, path_out,
        CHUNK=chunk, TILE=tile, CHUNKS_BLOCK=triton.next_power_of_2(chunks), PAD_BLOCK=PAD_BLOCK,
        WRITE_HINT=write_hint, WRITE_PATH=write_path,
        num_warps=warps,
        **pdl,
    )
