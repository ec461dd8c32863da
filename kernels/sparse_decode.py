"""Sparse decode attention over listed KV blocks, and the log-sum-exp merge of partial states.

Launchers (input checks, allocation, grid) for the Triton code in sparse_decode_jit.py.

- `sparse_decode`: attention of each decode query over the blocks listed per
  (batch, KV head), flash-decoding style (the block list is split over programs; a second
  launch merges the splits), or one partial state per listed block (`per_block=True`,
  for exact-mode PRR, where predicted-but-unselected blocks are dropped at merge).
- `merge_partials`: ⊕ over stacked partial states, with an optional keep-mask.

State convention (prr.attention_state): out is the normalised fp32 attention output, lse
the fp32 natural log of Σ exp(scale · q·k) over the state's keys; an empty key set has
lse = -inf and out = 0. No launcher reads a device value on the host (no sync): grids
depend only on static shapes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from .pdl import launch_kwargs
from .sparse_decode_jit import (
    LOG2E,
    merge_partials_kernel,
    sparse_decode_per_block_kernel,
    sparse_decode_split_kernel,
)

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_GROUP = 64  # query heads per KV head (GQA); rows are padded to max(16, next power of two)
MIN_BLOCK_SIZE = 16
PROGRAMS_PER_SM = 4  # per-block target: about this many programs per SM
# Split target. H200, bf16, 128K (bench_kernels --only decode_tuning): 8 per SM took batch 8 with an
# 8K budget from 112 to 86 µs (16 splits of 496 tokens, not 9 of 912); batch 1 is bound by
# MIN_TOKENS_PER_SPLIT and unchanged.
SPLIT_PROGRAMS_PER_SM = 8
MIN_TOKENS_PER_SPLIT = 128  # a split reads at least this many tokens (amortises its partial write)
# per_block mode: list entries a program walks, at least. H200, bf16, batch 1, 128K, 8K budget, block
# 64 (experiments/bench_decode.py --parts spec_programs): 4 entries (256 tokens) took speculation 16.9 -> 14.6 µs and
# PRR's stage 40.0 -> 37.2 µs against 1 entry (the old 64-token minimum; at block 16 that minimum
# was 4 entries already).
MIN_ENTRIES_PER_BLOCK_PROGRAM = 4
MAX_FUSED_MERGE_SPLITS = 256  # fuse_merge: splits its unrolled merge tail takes (code size, registers)
MERGE_TILE_ELEMENTS = 8192  # fuse_merge: fp32 elements of split outputs loaded at once (64 registers per thread at 4 warps)
MERGE_MIN_BLOCK_D = 32  # merge: D slice per program, at least (128-byte rows)
DEFAULT_NUM_SMS = 132  # H200; used when not on CUDA (the interpreter) so splits look like the GPU's


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


def _check_device(*tensors: Tensor) -> None:
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"all inputs must be on one device; got {device} and {t.device}")
    if device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"inputs are on {device}: the Triton kernels need CUDA tensors, "
            "or TRITON_INTERPRET=1 set before triton is imported (CPU interpreter)"
        )


def _check_int_tensor(name: str, t: Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if not _is_power_of_two(block_size) or block_size < MIN_BLOCK_SIZE:
        raise ValueError(f"block_size={block_size} must be a power of two >= {MIN_BLOCK_SIZE} (e.g. 16, 32, 64)")


def check_decode_operands(q: Tensor, k_cache: Tensor, v_cache: Tensor, kernel: str) -> tuple[int, int, int, int, int]:
    """q [B, Hq, D] and k_cache, v_cache [B, Hkv, T_max, D] as the decode kernels take them (dtypes,
    shapes, head_dim, GQA group) -> (B, Hq, Hkv, D, G = Hq / Hkv); `kernel` names the caller in errors."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} is not supported; use one of fp16, bf16, fp32")
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {list(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [B, Hkv, T_max, D]; got {list(k_cache.shape)} and {list(v_cache.shape)}"
        )
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share a dtype; got {k_cache.dtype} and {v_cache.dtype}")
    batch, num_q_heads, head_dim = q.shape
    cache_batch, num_kv_heads, _max_tokens, cache_head_dim = k_cache.shape
    if cache_batch != batch or cache_head_dim != head_dim:
        raise ValueError(
            f"q [B={batch}, Hq={num_q_heads}, D={head_dim}] does not match the cache "
            f"[B={cache_batch}, Hkv={num_kv_heads}, T_max={_max_tokens}, D={cache_head_dim}]"
        )
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim D={head_dim} is not supported by {kernel}; supported: {SUPPORTED_HEAD_DIMS}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"Hq={num_q_heads} must be a positive multiple of Hkv={num_kv_heads} (GQA)")
    group = num_q_heads // num_kv_heads
    if group > MAX_GROUP:
        raise ValueError(f"GQA group Hq/Hkv={group} is not supported; at most {MAX_GROUP} query heads per KV head")
    return batch, num_q_heads, num_kv_heads, head_dim, group


def dot_mode(q: Tensor, k_cache: Tensor, native_dot: bool | None) -> tuple[bool, str]:
    """-> (native_dot, input_precision) of the decode kernels' dots: native 16-bit tl.dot by default
    when q and the cache share fp16 / bf16 (not for bf16 in the interpreter); "ieee" with fp32 data."""
    sixteen_bit = (torch.float16, torch.bfloat16)
    native_ok = q.dtype == k_cache.dtype and k_cache.dtype in sixteen_bit
    if native_dot is None:
        native_dot = native_ok and not (_interpreting() and k_cache.dtype == torch.bfloat16)
    elif native_dot and not native_ok:
        raise ValueError(
            f"native_dot=True needs q and the cache in one 16-bit dtype; got q {q.dtype}, cache {k_cache.dtype}"
        )
    return bool(native_dot), "ieee" if torch.float32 in (q.dtype, k_cache.dtype) else "tf32"


def sparse_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_ids: Tensor,
    block_counts: Tensor,
    lengths: Tensor,
    block_size: int,
    scale: float,
    per_block: bool = False,
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
    plan_only: bool = False,
) -> tuple[Tensor, Tensor] | PerBlockLaunch:
    """Decode attention over the KV blocks listed per (batch row, KV head).

    q:            [B, Hq, D] fp16 / bf16 / fp32 (any strides); query head h uses KV head
                  h // G, G = Hq / Hkv (GQA; G <= 64).
    k_cache,
    v_cache:      [B, Hkv, T_max, D], same dtype (fp16 / bf16 / fp32); block b of a row holds
                  tokens [b * block_size, (b + 1) * block_size) (prr.cache.PagedKVCache.keys[layer]).
    block_ids:    [B, Hkv, C] int32 / int64; entries [0, block_counts[b, h]) are the blocks
                  to attend (distinct; each listed block is attended once per listing); the rest
                  is padding, never read as a block.
    block_counts: [B, Hkv] integer; clamped to [0, C] on the device.
    lengths:      [B] int32 / int64 tokens per batch row; tokens >= lengths[b] are masked
                  (also inside the last, partial block). lengths[b] <= T_max is the caller's
                  contract (never checked: that would sync).
    block_size:   power of two >= 16. D must be in SUPPORTED_HEAD_DIMS.
    scale:        softmax scale (a Python number), e.g. D ** -0.5.
    per_block:    False -> (out [B, Hq, D] out_dtype, lse [B, Hq] fp32): attention over the union
                  of the listed blocks. True -> (out [B, Hq, C, D] fp32, lse [B, Hq, C] fp32):
                  one state per list entry; padding entries and blocks with no live token have
                  lse = -inf, out = 0.
    An empty list gives lse = -inf, out = 0.
    merge_splits=False (per_block=False only): return the splits' partial states unmerged,
    (out [B, Hq, S, D], lse [B, Hq, S]), for a caller that merges them with other partials
    in its own launch (prr_merge.merge_speculation); S = sparse_decode_num_splits(...).
    out_dtype (per_block=False, merge_splits=True): dtype of the merged out (lse stays fp32);
    the model's 16-bit dtype saves the caller a cast launch before the output projection.
    fuse_merge=True (per_block=False, merge_splits=True): the last split of each (row, KV
    head) to finish merges the row's splits (an arrival counter; no merge launch). arrivals:
    an int32 workspace of B * Hkv zeros that every launch leaves zeroed (default: allocated);
    one per stream, never shared by launches that can run at once (a counter that does not
    start at zero merges before every split is in).
    Off by default: on an H200 (bench_decode_stage.csv, serial_fused_merge, at 15d9e22) it
    took 0.95-0.99x the serial stage time at batch 1 with 2K budgets, 1.01-1.06x at 8K and at
    batch 8, and a decode token 34 µs longer at 128K (profile_decode_*_fusemerge.csv).

    plan_only=True (per_block=True only): nothing runs; returns the launch (PerBlockLaunch: the
    outputs it would fill, its programs per row and its arguments) for a caller that runs
    `per_block_program` inside its own launch (prr.kernels.exact: P's speculation in exact
    selection's q·K pass).
    Tuning (keyword-only; defaults are chosen from static shapes and the SM count):
    tokens_per_split (per_block=False: tokens of block list per program; per_block=True:
    tokens per program), tile_tokens (tokens per K/V tile, a power of two >= 16),
    native_dot (16-bit tl.dot with fp32 accumulate; default on for fp16/bf16 when q and the
    cache share a dtype, off in the interpreter for bf16), precise_pv (native_dot only:
    P·V as hi·V + lo·V so probabilities are not rounded to 16 bits), num_warps, num_stages.
    """
    _check_device(q, k_cache, v_cache, block_ids, block_counts, lengths)
    batch, num_q_heads, num_kv_heads, head_dim, group = check_decode_operands(q, k_cache, v_cache, "sparse_decode")
    _check_block_size(block_size)
    if block_ids.dim() != 3:
        raise ValueError(f"block_ids must be [B, Hkv, C], got shape {list(block_ids.shape)}")
    capacity = block_ids.shape[-1]
    _check_int_tensor("block_ids", block_ids, (batch, num_kv_heads, capacity), (torch.int32, torch.int64))
    _check_int_tensor(
        "block_counts", block_counts, (batch, num_kv_heads), (torch.int32, torch.int64, torch.int16, torch.uint8)
    )
    _check_int_tensor("lengths", lengths, (batch,), (torch.int32, torch.int64))
    if isinstance(scale, Tensor) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python number (a tensor would sync), got {type(scale).__name__}")

    native_dot, input_precision = dot_mode(q, k_cache, native_dot)
    if out_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} is not supported; use one of fp16, bf16, fp32")
    if out_dtype != torch.float32 and (per_block or not merge_splits):
        raise ValueError(f"out_dtype={out_dtype} applies to the merged output only: partial states "
                         f"(per_block=True or merge_splits=False) stay fp32 for merging")
    if plan_only and not per_block:
        raise ValueError("plan_only=True describes the per-block launch: it takes per_block=True")
    if plan_only and (num_warps != 4 or num_stages is not None):
        raise ValueError(f"plan_only=True: the caller's launch sets the warps and stages (got num_warps={num_warps}, "
                         f"num_stages={num_stages}); leave them at their defaults")
    if fuse_merge and (per_block or not merge_splits):
        raise ValueError(f"fuse_merge=True merges the splits into one state: it takes per_block=False and "
                         f"merge_splits=True (got per_block={per_block}, merge_splits={merge_splits})")

    if tile_tokens is None and per_block:  # H200, bf16: per-block tile 64
        tile_tokens = 64 if head_dim <= 128 else 32
    if tile_tokens is not None and (not _is_power_of_two(tile_tokens) or tile_tokens < 16):
        raise ValueError(f"tile_tokens={tile_tokens} must be a power of two >= 16")
    if tokens_per_split is not None and tokens_per_split < 1:
        raise ValueError(f"tokens_per_split={tokens_per_split} must be >= 1")

    device = q.device
    group_pad = max(16, _next_power_of_two(group))
    rows = batch * num_kv_heads
    if batch == 0:
        shape = (0, num_q_heads, capacity) if per_block else (0, num_q_heads)
        if plan_only:  # nothing to run: empty states
            return PerBlockLaunch(torch.zeros(*shape, head_dim, device=device), torch.zeros(shape, device=device), 0,
                                  (), {})
        return (torch.zeros(*shape, head_dim, dtype=out_dtype, device=device), torch.zeros(shape, device=device))
    ids = block_ids if capacity > 0 else block_counts  # never dereferenced when C = 0
    launch = _launch_options(num_warps, num_stages, device)
    common = (
        q.stride(0), q.stride(1), q.stride(2),
        *k_cache.stride(), *v_cache.stride(),
        *(block_ids.stride() if capacity > 0 else (0, 0, 0)),
        block_counts.stride(0), block_counts.stride(1),
        lengths.stride(0),
    )  # fmt: skip
    qk_scale = float(scale) * LOG2E

    if per_block:
        out = torch.empty(batch, num_q_heads, capacity, head_dim, dtype=torch.float32, device=device)
        lse = torch.empty(batch, num_q_heads, capacity, dtype=torch.float32, device=device)
        entries = per_block_entries(capacity, rows, block_size, device, tokens_per_split) if capacity else 1
        plan = PerBlockLaunch(
            out, lse, -(-capacity // entries),
            (q, k_cache, v_cache, ids, block_counts, lengths, out, lse, qk_scale, num_kv_heads, capacity, entries,
             *common, *out.stride(), *lse.stride()),
            {"GROUP": group, "GROUP_PAD": group_pad, "HEAD_DIM": head_dim, "BLOCK_SIZE": block_size,
             "SUB_TILE": min(block_size, tile_tokens), "NATIVE_DOT": bool(native_dot),
             "INPUT_PRECISION": input_precision, "PRECISE_PV": bool(precise_pv)})
        if plan_only or capacity == 0:
            return plan if plan_only else (out, lse)
        sparse_decode_per_block_kernel[(plan.chunks, rows)](*plan.args, **plan.constexprs, **launch)
        return out, lse

    tile_tokens, entries, num_splits = _split_plan(capacity, rows, block_size, head_dim, k_cache.element_size(),
                                                   tile_tokens, tokens_per_split, device)
    states = _split_outputs(batch, num_q_heads, head_dim, group, num_splits, merge_splits, fuse_merge, out_dtype,
                            arrivals, lengths, tokens_per_split)
    sparse_decode_split_kernel[(num_splits, rows)](
        q, k_cache, v_cache, ids, block_counts, lengths, states.out, states.lse,
        qk_scale, num_kv_heads, capacity, entries,
        *common,
        *states.state_strides,
        *states.merge_args,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE_TOKENS=tile_tokens,
        NATIVE_DOT=bool(native_dot), INPUT_PRECISION=input_precision, PRECISE_PV=bool(precise_pv),
        **states.merge_constexprs,
        **launch,
    )  # fmt: skip
    return states.result(merge_splits, out_dtype)


def _launch_options(num_warps: int, num_stages: int | None, device: torch.device) -> dict:
    """The decode kernels' launch keywords: num_warps, PDL where the device takes it (pdl.launch_kwargs),
    and num_stages where the caller chose it (else Triton's default)."""
    launch = {"num_warps": num_warps, **launch_kwargs(device)}
    if num_stages is not None:
        launch["num_stages"] = num_stages
    return launch


@dataclass(frozen=True)
class SplitOutputs:
    """What a split launch (sparse_decode with per_block=False, token_sparse_decode: grid
    (num_splits, B * Hkv)) writes, and the kernel arguments that describe it (`_split_outputs`)."""

    out: Tensor  # [B, Hq, D] out_dtype where the one split is the result, else [B, Hq, S, D] fp32 partials
    lse: Tensor  # [B, Hq] or [B, Hq, S] fp32
    state_strides: tuple[int, ...]  # out's (b, h, s, d) then lse's (b, h, s) strides; s stride 0 for [B, Hq, D]
    merge_args: tuple  # arrivals, merged_out, merged_lse and their 5 strides (placeholders, never read, unless fused)
    merge_constexprs: dict  # FUSED_MERGE, SPLITS_PAD, MERGE_GROUP, SPLIT_CHUNK of the kernel's merge tail
    num_splits: int
    merged: tuple[Tensor, Tensor] | None  # fused: (out [B, Hq, D] out_dtype, lse [B, Hq] fp32) the last split fills

    def result(self, merge_splits: bool, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The launcher's return once the split kernel ran: the fused merge's state; the splits'
        states (one split, or merge_splits=False); else their merge (merge_partials, a second launch)."""
        if self.merged is not None:
            return self.merged
        if self.num_splits == 1 or not merge_splits:
            return self.out, self.lse
        return merge_partials(self.out, self.lse, out_dtype=out_dtype)


def _split_outputs(
    batch: int, num_q_heads: int, head_dim: int, group: int, num_splits: int, merge_splits: bool, fuse_merge: bool,
    out_dtype: torch.dtype, arrivals: Tensor | None, lengths: Tensor, tokens_per_split: int | None,
) -> SplitOutputs:
    """Allocates a split launch's outputs on lengths' device: the result itself where one split
    gives it (out_dtype), else fp32 partial states; with fuse_merge and several splits, the merged
    state the row's last split writes and its arrival counters (`arrivals` checked, or new zeros).
    lengths [B] stands in for the unused merge pointers (never dereferenced). More splits than
    MAX_FUSED_MERGE_SPLITS with fuse_merge raise, naming tokens_per_split (the caller's value)."""
    device = lengths.device
    if num_splits == 1 and merge_splits:
        out = torch.empty(batch, num_q_heads, head_dim, dtype=out_dtype, device=device)
        lse = torch.empty(batch, num_q_heads, dtype=torch.float32, device=device)
        out_strides = (out.stride(0), out.stride(1), 0, out.stride(2))
        lse_strides = (lse.stride(0), lse.stride(1), 0)
    else:
        out = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=device)
        lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=device)
        out_strides, lse_strides = out.stride(), lse.stride()
    fused = fuse_merge and num_splits > 1
    if fused and num_splits > MAX_FUSED_MERGE_SPLITS:
        raise ValueError(f"fuse_merge=True merges {num_splits} splits in an unrolled tail of at most "
                         f"{MAX_FUSED_MERGE_SPLITS}: raise tokens_per_split (now {tokens_per_split}) or use fuse_merge=False")
    merged = None
    if fused:  # the row's last split merges: (out, lse) of the row, no second launch
        merged_out = torch.empty(batch, num_q_heads, head_dim, dtype=out_dtype, device=device)
        merged_lse = torch.empty(batch, num_q_heads, dtype=torch.float32, device=device)
        arrivals = arrival_counters(arrivals, batch * (num_q_heads // group), device)  # [B * Hkv]
        merge_args = (arrivals, merged_out, merged_lse, *merged_out.stride(), *merged_lse.stride())
        merged = (merged_out, merged_lse)
    else:
        merge_args = (lengths, out, lse, 0, 0, 0, 0, 0)  # never dereferenced
    merge_group = _next_power_of_two(group)
    constexprs = {"FUSED_MERGE": fused, "SPLITS_PAD": _next_power_of_two(num_splits), "MERGE_GROUP": merge_group,
                  "SPLIT_CHUNK": min(_next_power_of_two(num_splits),
                                     max(1, MERGE_TILE_ELEMENTS // (merge_group * head_dim)))}
    return SplitOutputs(out, lse, (*out_strides, *lse_strides), merge_args, constexprs, num_splits, merged)


@dataclass(frozen=True)
class PerBlockLaunch:
    """sparse_decode(per_block=True)'s launch, not run: out [B, Hq, C, D] and lse [B, Hq, C] (fp32,
    unfilled), chunks (programs per (row, KV head) row: grid (chunks, B * Hkv)), and the
    arguments of `per_block_program` after (chunk, row): positional args, then constexprs."""

    out: Tensor
    lse: Tensor
    chunks: int
    args: tuple
    constexprs: dict


def arrival_counters(arrivals: Tensor | None, rows: int, device: torch.device) -> Tensor:
    """The [rows] int32 zeros a launch whose programs count their arrivals per row uses (fused
    merges: the last to arrive merges and re-arms it): `arrivals` checked, or new zeros."""
    if arrivals is None:
        return torch.zeros(rows, dtype=torch.int32, device=device)
    if arrivals.shape != (rows,) or arrivals.dtype != torch.int32 or arrivals.device != device:
        raise ValueError(f"arrivals must be an int32 tensor of B * Hkv = {rows} zeros on {device}; got "
                         f"{arrivals.dtype} {tuple(arrivals.shape)} on {arrivals.device}")
    return arrivals


def per_block_entries(capacity: int, rows: int, block_size: int, device: torch.device | str,
                      tokens_per_program: int | None = None) -> int:
    """List entries each program of sparse_decode(per_block=True) walks, for C = capacity entries
    per row and rows = B * Hkv: grid = (ceil(C / entries), rows). tokens_per_program: the caller's
    choice (whole blocks, at least one); None: about PROGRAMS_PER_SM programs per SM, never more
    (rounding the chunks per row up had batch 8 with an 8K budget launch 576 programs on 132 SMs, a
    partial second wave: 85 µs against 77 µs with 512; bench_decode.py --parts spec_programs), and at least
    MIN_ENTRIES_PER_BLOCK_PROGRAM entries."""
    if tokens_per_program is not None:
        return max(1, -(-tokens_per_program // block_size))
    chunks_wanted = max(1, PROGRAMS_PER_SM * _num_sms(torch.device(device)) // rows)
    return max(-(-capacity // chunks_wanted), MIN_ENTRIES_PER_BLOCK_PROGRAM)


def _split_plan(
    capacity: int, rows: int, block_size: int, head_dim: int, elem_size: int, tile_tokens: int | None,
    tokens_per_split: int | None, device: torch.device,
) -> tuple[int, int, int]:
    """-> (tile tokens, list entries per split, number of splits) for per_block=False; static
    shapes only (elem_size: bytes per cache element). Default tile: 32 tokens; 128 for a 16-bit
    cache with D <= 128 when the default plan gives every split an SM of its own (H200, bf16,
    batch 1, 2K budget: 9.2-9.7 vs 11.1 µs; with 4+ programs per SM (8K budget) tile 128 lost,
    26.8 vs 18.3 µs: fewer programs in flight per SM). fp32 tiles of 128 would need ~270 KB of
    shared memory at D = 128, more than any GPU has."""
    tile = 32 if tile_tokens is None else tile_tokens
    per_split = tokens_per_split
    if per_split is None:
        splits_wanted = max(1, -(-SPLIT_PROGRAMS_PER_SM * _num_sms(device) // rows))
        per_split = max(-(-capacity // splits_wanted) * block_size, MIN_TOKENS_PER_SPLIT)
    entries = max(1, -(-per_split // block_size))

    def whole_tiles(entries: int, tile: int) -> int:
        per_tile = max(1, tile // block_size)
        return -(-entries // per_tile) * per_tile

    entries_at = whole_tiles(entries, tile)
    wide_ok = tile_tokens is None and tokens_per_split is None and elem_size == 2 and head_dim <= 128
    if wide_ok and rows * -(-capacity // entries_at) <= _num_sms(device):
        wide = whole_tiles(entries, 128)
        if rows * -(-capacity // wide) <= _num_sms(device):
            tile, entries_at = 128, wide
    return tile, entries_at, max(1, -(-capacity // entries_at))


def sparse_decode_num_splits(
    capacity: int, batch: int, num_kv_heads: int, block_size: int, device: torch.device | str = "cuda",
    tile_tokens: int | None = None, tokens_per_split: int | None = None, *, head_dim: int,
    cache_dtype: torch.dtype,
) -> int:
    """How many splits (programs per (batch, KV head)) sparse_decode(per_block=False) launches
    for a [B, Hkv, T, head_dim] cache of cache_dtype (the default tile depends on both)."""
    elem_size = torch.empty((), dtype=cache_dtype).element_size()
    return _split_plan(capacity, batch * num_kv_heads, block_size, head_dim, elem_size, tile_tokens,
                       tokens_per_split, torch.device(device))[2]


def sparse_decode_one_wave(
    capacity: int, batch: int, num_kv_heads: int, block_size: int, device: torch.device | str = "cuda", *,
    head_dim: int, cache_dtype: torch.dtype,
) -> bool:
    """Whether sparse_decode(per_block=False) with default tiles launches several splits and at
    most one program per SM: where fuse_merge=True measured faster than the merge launch on an
    H200 (batch 1, 2K budgets: 0.96-0.99x the serial stage time; slower with more programs
    than SMs, bench_decode_stage.csv, serial_fused_merge)."""
    splits = sparse_decode_num_splits(capacity, batch, num_kv_heads, block_size, device, head_dim=head_dim,
                                      cache_dtype=cache_dtype)
    return 1 < splits and batch * num_kv_heads * splits <= _num_sms(torch.device(device))


def merge_partials(
    out: Tensor, lse: Tensor, keep: Tensor | None = None, out_dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """⊕ over the second-to-last axis of stacked partial states, in one launch.

    out:  [..., N, D] float (fp32 expected), the partials' normalised outputs.
    lse:  [..., N] float, their natural-log sums of exp(scaled scores) (-inf: empty).
    keep: [..., N] bool or None; False entries are dropped exactly (weight 0, never
          subtracted, their out never read).
    -> (out [..., D] out_dtype, lse [...] fp32); nothing kept -> lse = -inf, out = 0.
    """
    if not isinstance(out, Tensor) or not isinstance(lse, Tensor):
        raise TypeError("out and lse must be torch.Tensors")
    if out.dim() < 2 or tuple(lse.shape) != tuple(out.shape[:-1]):
        raise ValueError(f"out must be [..., N, D] and lse [..., N]; got {list(out.shape)} and {list(lse.shape)}")
    if not out.is_floating_point() or not lse.is_floating_point():
        raise ValueError(f"out and lse must be floating point; got {out.dtype} and {lse.dtype}")
    tensors = [out, lse]
    if keep is not None:
        if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
            raise ValueError("keep must be a bool tensor shaped like lse, or None")
        if tuple(keep.shape) != tuple(lse.shape):
            raise ValueError(f"keep must have lse's shape {list(lse.shape)}, got {list(keep.shape)}")
        tensors.append(keep)
    if out_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} is not supported; use one of fp16, bf16, fp32")
    _check_device(*tensors)
    *lead, num_partials, head_dim = out.shape
    rows = math.prod(lead)
    if rows == 0 or head_dim == 0 or num_partials == 0:
        merged_out = torch.zeros(*lead, head_dim, dtype=out_dtype, device=out.device)
        return merged_out, torch.full(lead, float("-inf"), dtype=torch.float32, device=out.device)
    merged_out = torch.empty(*lead, head_dim, dtype=out_dtype, device=out.device)
    merged_lse = torch.empty(lead, dtype=torch.float32, device=out.device)
    out3 = out.reshape(rows, num_partials, head_dim)
    lse2 = lse.reshape(rows, num_partials)
    keep2 = keep.reshape(rows, num_partials).view(torch.uint8) if keep is not None else lse2
    flat_out = merged_out.view(rows, head_dim)
    flat_lse = merged_lse.view(rows)
    # Split D over programs until there are about two per SM (rows alone can be as few as B * Hq).
    block_d = _next_power_of_two(head_dim)
    while block_d > MERGE_MIN_BLOCK_D and rows * (-(-head_dim // block_d)) < 2 * _num_sms(out.device):
        block_d //= 2
    block_n = max(2, min(_next_power_of_two(num_partials), max(2, 8192 // block_d)))
    merge_partials_kernel[(rows, -(-head_dim // block_d))](
        out3, lse2, keep2, flat_out, flat_lse,
        num_partials, head_dim,
        out3.stride(0), out3.stride(1), out3.stride(2),
        lse2.stride(0), lse2.stride(1),
        keep2.stride(0), keep2.stride(1),
        flat_out.stride(0), flat_out.stride(1),
        flat_lse.stride(0),
        HAS_KEEP=keep is not None, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=4, **launch_kwargs(out.device),
    )  # fmt: skip
    return merged_out, merged_lse
