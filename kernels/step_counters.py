"""The engine's per-step selection counters in one launch per layer: for each (row, KV head),
|A|, |P|, |P ∩ A| and |A_t ∩ A_{t-1}| added to device counters, and A_t kept as the next
step's A_{t-1}. (As torch ops this was ~12 launches per layer: ≈ 0.5 ms per token on the
H200 at 30 layers, ~10% of a decode step.) `step_counters_layers`: the same over a range of
layers in one launch (the graph engine counts every sparse layer at the step's end, on the side
stream: StaticPlan.count_at_step_end).

Torch reference: kernels/reference_step_counters.py, from membership masks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

COUNTERS = ("selected", "predicted", "hits", "overlap")


@triton.jit
def _step_counters_kernel(
    sel_ptr, sel_cnt_ptr, pred_ptr, pred_cnt_ptr, prev_ptr, prev_cnt_ptr, seen_ptr, out_ptr,
    num_kv_heads, num_rows, sel_cap, pred_cap, max_blocks,
    HAS_PRED: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_P: tl.constexpr,
):
    # grid (Hkv, B, L): each layer's tensors are the next [rows, ...] slab of its [L, ...] tensor
    layer = tl.program_id(2).to(tl.int64)
    row = tl.program_id(1) * num_kv_heads + tl.program_id(0)
    sel_ptr += layer * num_rows * sel_cap
    prev_ptr += layer * num_rows * sel_cap
    sel_cnt_ptr += layer * num_rows
    prev_cnt_ptr += layer * num_rows
    seen_ptr += layer * 2 * num_rows * max_blocks  # each layer its own scratch: layers run concurrently
    out_ptr += layer * 4 * num_rows
    a_offs = tl.arange(0, BLOCK_A)
    a_cnt = tl.load(sel_cnt_ptr + row).to(tl.int32)
    a_valid = (a_offs < sel_cap) & (a_offs < a_cnt)
    a = tl.load(sel_ptr + row * sel_cap + a_offs, mask=a_valid, other=0)
    prev_cnt = tl.load(prev_cnt_ptr + row)
    prev_valid = (a_offs < sel_cap) & (a_offs < prev_cnt)
    prev = tl.load(prev_ptr + row * sel_cap + a_offs, mask=prev_valid, other=0)
    seen_prev = seen_ptr + row * max_blocks  # int8 [2, rows, NB] scratch, zero between launches
    seen_pred = seen_ptr + (num_rows + row) * max_blocks
    tl.store(seen_prev + prev, tl.full([BLOCK_A], 1, tl.int8), mask=prev_valid)
    p_cnt = 0
    if HAS_PRED:
        pred_ptr += layer * num_rows * pred_cap
        pred_cnt_ptr += layer * num_rows
        p_offs = tl.arange(0, BLOCK_P)
        p_cnt = tl.load(pred_cnt_ptr + row).to(tl.int32)
        p_valid = (p_offs < pred_cap) & (p_offs < p_cnt)
        p = tl.load(pred_ptr + row * pred_cap + p_offs, mask=p_valid, other=0)
        tl.store(seen_pred + p, tl.full([BLOCK_P], 1, tl.int8), mask=p_valid)
    tl.debug_barrier()  # the marks are visible to every thread of the program
    overlap = tl.sum(tl.load(seen_prev + a, mask=a_valid, other=0).to(tl.int64))
    hits = tl.sum(tl.load(seen_pred + a, mask=a_valid, other=0).to(tl.int64))
    tl.debug_barrier()
    tl.store(seen_prev + prev, tl.zeros([BLOCK_A], tl.int8), mask=prev_valid)  # scratch back to zero
    if HAS_PRED:
        tl.store(seen_pred + p, tl.zeros([BLOCK_P], tl.int8), mask=p_valid)
    tl.store(prev_ptr + row * sel_cap + a_offs, a, mask=a_offs < sel_cap)  # A_t becomes A_{t-1}
    tl.store(prev_cnt_ptr + row, a_cnt)
    # out: [4, rows] int64 per layer, each program owns its column: no atomics
    tl.store(out_ptr + row, tl.load(out_ptr + row) + a_cnt)
    tl.store(out_ptr + num_rows + row, tl.load(out_ptr + num_rows + row) + p_cnt)
    tl.store(out_ptr + 2 * num_rows + row, tl.load(out_ptr + 2 * num_rows + row) + hits)
    tl.store(out_ptr + 3 * num_rows + row, tl.load(out_ptr + 3 * num_rows + row) + overlap)


def counter_scratch(batch: int, num_kv_heads: int, max_blocks: int, device: torch.device | str) -> Tensor:
    """The zeroed int8 [2, B * Hkv, NB] membership scratch `step_counters` leaves zeroed."""
    return torch.zeros(2, batch * num_kv_heads, max_blocks, dtype=torch.int8, device=device)


def layer_counter_scratch(layers: int, batch: int, num_kv_heads: int, max_blocks: int,
                          device: torch.device | str) -> Tensor:
    """The zeroed int8 [L, 2, B * Hkv, NB] scratch of `step_counters_layers` (one
    `counter_scratch` per layer; its [0] serves `step_counters`), left zeroed."""
    return torch.zeros(layers, 2, batch * num_kv_heads, max_blocks, dtype=torch.int8, device=device)


def step_counters(sel_idx: Tensor, sel_cnt: Tensor, pred_idx: Tensor | None, pred_cnt: Tensor | None,
                  prev_idx: Tensor, prev_cnt: Tensor, scratch: Tensor, out: Tensor) -> None:
    """sel_idx [B, Hkv, K] int32 (A, distinct ids), sel_cnt [B, Hkv]; pred_idx [B, Hkv, C] int32 (P,
    distinct) and pred_cnt, or None (no P); prev_idx [B, Hkv, K] int32 / prev_cnt [B, Hkv] int32:
    A_{t-1}, overwritten with A_t; scratch: `counter_scratch(...)`; out [4, B * Hkv] int64:
    += (|A|, |P|, |P ∩ A|, |A ∩ A_{t-1}|) per (row, KV head), in place. Block ids must be
    < NB (scratch's last dim); not checked on the host (no sync)."""
    _check(sel_idx, sel_cnt, pred_idx, pred_cnt, prev_idx, prev_cnt, scratch, out, layers=None)
    _launch(*(None if t is None else t.unsqueeze(0)
              for t in (sel_idx, sel_cnt, pred_idx, pred_cnt, prev_idx, prev_cnt, scratch, out)))


def step_counters_layers(sel_idx: Tensor, sel_cnt: Tensor, pred_idx: Tensor | None, pred_cnt: Tensor | None,
                         prev_idx: Tensor, prev_cnt: Tensor, scratch: Tensor, out: Tensor) -> None:
    """`step_counters` of L layers in one launch (grid KV head × row × layer): every argument
    with a leading layer dim, each layer's slab as `step_counters` takes it — sel_idx
    [L, B, Hkv, K] int32, sel_cnt [L, B, Hkv]; pred_idx [L, B, Hkv, C] / pred_cnt [L, B, Hkv] or
    None; prev_idx [L, B, Hkv, K] / prev_cnt [L, B, Hkv] int32 (A_{t-1}, overwritten with A_t);
    scratch `layer_counter_scratch(L, ...)`; out [L, 4, B * Hkv] int64 (+=), all contiguous.
    Equal, layer by layer, to L `step_counters` launches."""
    _check(sel_idx, sel_cnt, pred_idx, pred_cnt, prev_idx, prev_cnt, scratch, out, layers=sel_idx.shape[0])
    _launch(sel_idx, sel_cnt, pred_idx, pred_cnt, prev_idx, prev_cnt, scratch, out)


def _check(sel_idx: Tensor, sel_cnt: Tensor, pred_idx: Tensor | None, pred_cnt: Tensor | None, prev_idx: Tensor,
           prev_cnt: Tensor, scratch: Tensor, out: Tensor, layers: int | None) -> None:
    """Raise ValueError on what the kernel cannot take; layers None: one layer's shapes (no layer dim)."""
    lead = () if layers is None else (layers,)
    dims = len(lead) + 3
    problems = []
    if sel_idx.dim() != dims:
        raise ValueError(f"sel_idx must be [{'L, ' * len(lead)}B, Hkv, K]; got {tuple(sel_idx.shape)}")
    batch, num_kv_heads, _ = sel_idx.shape[len(lead):]
    rows = batch * num_kv_heads
    rows_shape = (*lead, batch, num_kv_heads)
    for name, t in (("sel_idx", sel_idx), ("prev_idx", prev_idx), ("pred_idx", pred_idx)):
        if t is not None and (t.dtype != torch.int32 or not t.is_contiguous()):
            problems.append(f"{name} must be a contiguous int32 tensor; got {t.dtype}")
    for name, t in (("sel_cnt", sel_cnt), ("pred_cnt", pred_cnt)):
        if t is not None and (t.shape != rows_shape or not t.is_contiguous()):
            problems.append(f"{name} must be a contiguous {list(rows_shape)} tensor; got {tuple(t.shape)}")
    if pred_idx is not None and (pred_idx.shape[:-1] != rows_shape or pred_cnt is None):
        problems.append(f"pred_idx {tuple(pred_idx.shape)} must be {list(rows_shape)} + [C], with pred_cnt")
    if prev_idx.shape != sel_idx.shape or prev_cnt.shape != rows_shape or prev_cnt.dtype != torch.int32 \
            or not prev_cnt.is_contiguous():
        problems.append(f"prev_idx {tuple(prev_idx.shape)} / prev_cnt {tuple(prev_cnt.shape)} {prev_cnt.dtype} must be "
                        f"{tuple(sel_idx.shape)} int32 / {list(rows_shape)} int32, contiguous")
    want_out = (*lead, len(COUNTERS), rows)
    if out.shape != want_out or out.dtype != torch.int64 or not out.is_contiguous():
        problems.append(f"out must be a contiguous int64 [{'L, ' * len(lead)}4, B * Hkv] = {list(want_out)} tensor; "
                        f"got {out.dtype} {tuple(out.shape)}")
    if scratch.dtype != torch.int8 or scratch.shape[:-1] != (*lead, 2, rows) or not scratch.is_contiguous():
        problems.append(f"scratch must be a contiguous int8 [{'L, ' * len(lead)}2, B * Hkv, NB] tensor "
                        f"({'layer_' if lead else ''}counter_scratch); got {scratch.dtype} {tuple(scratch.shape)}")
    if problems:
        raise ValueError("; ".join(problems))


def _launch(sel_idx: Tensor, sel_cnt: Tensor, pred_idx: Tensor | None, pred_cnt: Tensor | None, prev_idx: Tensor,
            prev_cnt: Tensor, scratch: Tensor, out: Tensor) -> None:
    """The checked [L, ...] tensors -> one launch over (Hkv, B, L)."""
    layers, batch, num_kv_heads, sel_cap = sel_idx.shape
    has_pred = pred_idx is not None
    pred_cap = pred_idx.shape[-1] if has_pred else 0
    if layers * batch * num_kv_heads == 0:
        return
    _step_counters_kernel[(num_kv_heads, batch, layers)](
        sel_idx, sel_cnt, pred_idx if has_pred else sel_idx, pred_cnt if has_pred else sel_cnt, prev_idx, prev_cnt,
        scratch, out, num_kv_heads, batch * num_kv_heads, sel_cap, pred_cap, scratch.shape[-1],
        HAS_PRED=has_pred, BLOCK_A=triton.next_power_of_2(max(sel_cap, 2)),
        BLOCK_P=triton.next_power_of_2(max(pred_cap, 2)), num_warps=4,
    )  # fmt: skip
