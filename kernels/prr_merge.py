"""The two small launches between a PRR step's attention kernels, fused so the repair path
costs two launches instead of a dozen tiny torch ops (each ≈1.5 µs even in a CUDA graph):

- `repair_plan`: from A (the selection) and P (the prediction), the repair list A \\ P,
  compacted, and keep = P ∩ A (which speculative partials survive), in one launch.
- `merge_speculation`: ⊕ of the kept per-block speculative partials and the repair's
  (unmerged) split partials, in one launch (the exact-mode merge of DESIGN.md §2).

Torch references: kernels/reference_prr_merge.py (`repair_plan_reference`,
`merge_speculation_reference`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .pdl import launch_kwargs, pdl_prologue
from .sparse_decode import _check_device, _next_power_of_two

# --- repair plan ---------------------------------------------------------------------------


@triton.jit
def _repair_plan_kernel(
    sel_ptr, sel_cnt_ptr, pred_ptr, pred_cnt_ptr, scratch_ptr,
    miss_ptr, miss_cnt_ptr, keep_ptr,
    num_kv_heads, sel_cap, pred_cap,
    stride_scratch_row,
    BLOCK_A: tl.constexpr, BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    """One (KV head, batch row). Lists are [rows, cap] contiguous, rows = B * Hkv.

    scratch: a zeroed int8 bitmap row per (b, h) over the block ids; set, read, and cleared
    again here, so it stays zero between launches (no memset per call)."""
    pdl_prologue(PDL)
    row = (tl.program_id(1) * num_kv_heads + tl.program_id(0)).to(tl.int64)
    offs_a = tl.arange(0, BLOCK_A)
    offs_p = tl.arange(0, BLOCK_P)
    n_sel = tl.load(sel_cnt_ptr + row)
    n_pred = tl.load(pred_cnt_ptr + row)
    a_ok = offs_a < tl.minimum(n_sel, sel_cap)
    p_ok = offs_p < tl.minimum(n_pred, pred_cap)
    a = tl.load(sel_ptr + row * sel_cap + offs_a, mask=a_ok, other=0)
    p = tl.load(pred_ptr + row * pred_cap + offs_p, mask=p_ok, other=0)
    bitmap = scratch_ptr + row * stride_scratch_row

    # A \ P: mark P, look A up, compact the misses in A's (ascending) order.
    tl.store(bitmap + p, tl.full([BLOCK_P], 1, tl.int8), mask=p_ok)
    tl.debug_barrier()
    in_p = tl.load(bitmap + a, mask=a_ok, other=0)
    missed = a_ok & (in_p == 0)
    slot = tl.cumsum(missed.to(tl.int32), axis=0) - 1
    tl.store(miss_ptr + row * sel_cap + slot, a, mask=missed)
    tl.store(miss_cnt_ptr + row, tl.sum(missed.to(tl.int32), axis=0))
    tl.debug_barrier()
    tl.store(bitmap + p, tl.zeros([BLOCK_P], tl.int8), mask=p_ok)
    tl.debug_barrier()
    # keep = P ∩ A: mark A, look P up.
    tl.store(bitmap + a, tl.full([BLOCK_A], 1, tl.int8), mask=a_ok)
    tl.debug_barrier()
    in_a = tl.load(bitmap + p, mask=p_ok, other=0)
    tl.store(keep_ptr + row * pred_cap + offs_p, (in_a != 0) & p_ok, mask=offs_p < pred_cap)
    tl.debug_barrier()
    tl.store(bitmap + a, tl.zeros([BLOCK_A], tl.int8), mask=a_ok)


def repair_scratch(batch: int, num_kv_heads: int, max_blocks: int, device: torch.device) -> Tensor:
    """The zeroed bitmap `repair_plan` needs: [B, Hkv, NB_max] int8 (keep one per stream)."""
    return torch.zeros(batch, num_kv_heads, max_blocks, dtype=torch.int8, device=device)


def repair_plan(
    sel_idx: Tensor, sel_cnt: Tensor, pred_idx: Tensor, pred_cnt: Tensor, scratch: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """sel_idx [B, Hkv, K] int32 (A, distinct block ids, first sel_cnt valid), sel_cnt [B, Hkv];
    pred_idx [B, Hkv, C] int32 (P), pred_cnt [B, Hkv]; scratch: `repair_scratch(...)` (left zeroed).
    -> (miss_idx [B, Hkv, K] int32: A \\ P in A's order, then garbage; miss_cnt [B, Hkv] int32;
        keep [B, Hkv, C] bool: P entry is valid and in A).
    Block ids must be < NB_max (scratch's last dim); never checked on the host (no sync)."""
    _check_device(sel_idx, sel_cnt, pred_idx, pred_cnt, scratch)
    batch, num_kv_heads, sel_cap = sel_idx.shape
    pred_cap = pred_idx.shape[-1]
    if pred_idx.shape[:2] != (batch, num_kv_heads) or sel_cnt.shape != (batch, num_kv_heads) \
            or pred_cnt.shape != (batch, num_kv_heads):
        raise ValueError(f"A {tuple(sel_idx.shape)}/{tuple(sel_cnt.shape)} and P {tuple(pred_idx.shape)}/"
                         f"{tuple(pred_cnt.shape)} must share [B, Hkv]")
    if scratch.dtype != torch.int8 or scratch.shape[:2] != (batch, num_kv_heads) or not scratch.is_contiguous():
        raise ValueError(f"scratch must be a contiguous int8 [B, Hkv, NB_max] tensor (repair_scratch); got "
                         f"{scratch.dtype} {tuple(scratch.shape)}")
    for name, t in (("sel_idx", sel_idx), ("pred_idx", pred_idx), ("sel_cnt", sel_cnt), ("pred_cnt", pred_cnt)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 tensor; got {t.dtype}")
    miss_idx = torch.zeros_like(sel_idx)
    miss_cnt = torch.empty_like(sel_cnt)
    keep = torch.empty(batch, num_kv_heads, pred_cap, dtype=torch.bool, device=sel_idx.device)
    if batch * num_kv_heads == 0:
        return miss_idx, miss_cnt, keep
    _repair_plan_kernel[(num_kv_heads, batch)](
        sel_idx, sel_cnt, pred_idx, pred_cnt, scratch,
        miss_idx, miss_cnt, keep.view(torch.int8),
        num_kv_heads, sel_cap, pred_cap,
        scratch.stride(1),
        BLOCK_A=_next_power_of_two(max(sel_cap, 2)), BLOCK_P=_next_power_of_two(max(pred_cap, 2)),
        num_warps=4, **launch_kwargs(sel_idx.device),
    )  # fmt: skip
    return miss_idx, miss_cnt, keep


# --- merge of the speculative partials with the repair state --------------------------------


@triton.jit
def _merge_speculation_kernel(
    part_out_ptr, part_lse_ptr, keep_ptr, rep_out_ptr, rep_lse_ptr, out_ptr, lse_ptr,
    num_partials, num_repair, head_dim, group,
    stride_po_r, stride_po_n, stride_pl_r, stride_k_r, stride_ro_r, stride_ro_n, stride_rl_r, stride_o_r,
    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    """One query-head row (b * Hq + h), one BLOCK_D slice: ⊕ of the kept speculative partials
    and every repair partial (the repair's splits, merged here instead of in a launch of
    their own). keep is per KV head (row // group). Two passes over lse (max, weights);
    dropped or empty terms get weight exactly 0 and their out is never read."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    keep_row = keep_ptr + (row // group) * stride_k_r

    m_vec = tl.full([BLOCK_N], float("-inf"), tl.float32)
    for n_start in range(0, num_partials, BLOCK_N):
        n = n_start + offs_n
        ok = (n < num_partials) & (tl.load(keep_row + n, mask=n < num_partials, other=0) != 0)
        m_vec = tl.maximum(m_vec, tl.load(part_lse_ptr + row * stride_pl_r + n, mask=ok, other=float("-inf")))
    m_rep = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s_start in range(0, num_repair, BLOCK_S):
        s = s_start + offs_s
        m_rep = tl.maximum(m_rep, tl.load(rep_lse_ptr + row * stride_rl_r + s, mask=s < num_repair,
                                          other=float("-inf")))
    m = tl.maximum(tl.max(m_vec, axis=0), tl.max(m_rep, axis=0))
    m_safe = tl.where(m == float("-inf"), 0.0, m)

    acc = tl.zeros([BLOCK_D], tl.float32)
    w_vec = tl.zeros([BLOCK_N], tl.float32)
    for n_start in range(0, num_partials, BLOCK_N):
        n = n_start + offs_n
        ok = (n < num_partials) & (tl.load(keep_row + n, mask=n < num_partials, other=0) != 0)
        w = tl.exp(tl.load(part_lse_ptr + row * stride_pl_r + n, mask=ok, other=float("-inf")) - m_safe)
        used = w > 0.0
        o = tl.load(part_out_ptr + row * stride_po_r + n[:, None] * stride_po_n + offs_d[None, :],
                    mask=used[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
        w_vec += w
    w_rep = tl.zeros([BLOCK_S], tl.float32)
    for s_start in range(0, num_repair, BLOCK_S):
        s = s_start + offs_s
        w = tl.exp(tl.load(rep_lse_ptr + row * stride_rl_r + s, mask=s < num_repair, other=float("-inf")) - m_safe)
        used = w > 0.0
        o = tl.load(rep_out_ptr + row * stride_ro_r + s[:, None] * stride_ro_n + offs_d[None, :],
                    mask=used[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
        w_rep += w
    total = tl.sum(w_vec, axis=0) + tl.sum(w_rep, axis=0)
    has_mass = total > 0.0
    total_safe = tl.where(has_mass, total, 1.0)
    tl.store(out_ptr + row * stride_o_r + offs_d, acc / total_safe, mask=d_ok)
    tl.store(lse_ptr + row, tl.where(has_mass, m_safe + tl.log(total_safe), float("-inf")))


def merge_speculation(
    part_out: Tensor, part_lse: Tensor, keep: Tensor, rep_out: Tensor, rep_lse: Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """part_out [B, Hq, C, D] fp32, part_lse [B, Hq, C] (sparse_decode per_block=True over P);
    keep [B, Hkv, C] bool (repair_plan); the repair state rep_out [B, Hq, D], rep_lse [B, Hq],
    or its unmerged splits rep_out [B, Hq, S, D], rep_lse [B, Hq, S] (sparse_decode
    merge_splits=False: one launch fewer).
    -> (out [B, Hq, D] out_dtype, lse [B, Hq] fp32) = ⊕_{kept n} partial_n ⊕ repair
    (a 16-bit out_dtype saves the caller a cast launch)."""
    _check_device(part_out, part_lse, keep, rep_out, rep_lse)
    if rep_out.dim() == 3:
        rep_out, rep_lse = rep_out.unsqueeze(2), rep_lse.unsqueeze(2)
    batch, num_heads, num_partials, head_dim = part_out.shape
    num_kv_heads = keep.shape[1]
    num_repair = rep_out.shape[2] if rep_out.dim() == 4 else -1
    if part_lse.shape != (batch, num_heads, num_partials) or keep.shape != (batch, num_kv_heads, num_partials) \
            or rep_out.shape != (batch, num_heads, num_repair, head_dim) \
            or rep_lse.shape != (batch, num_heads, num_repair) or num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"shapes do not fit: part_out {tuple(part_out.shape)}, part_lse {tuple(part_lse.shape)}, "
                         f"keep {tuple(keep.shape)}, rep_out {tuple(rep_out.shape)}, rep_lse {tuple(rep_lse.shape)}")
    for name, t in (("part_out", part_out), ("part_lse", part_lse), ("rep_out", rep_out), ("rep_lse", rep_lse)):
        if t.dtype != torch.float32 or t.stride(-1) != 1:
            raise ValueError(f"{name} must be fp32 with a unit last stride; got {t.dtype}, strides {t.stride()}")
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype {out_dtype} is not supported; use one of fp32, bf16, fp16")
    keep, part_lse, rep_lse = keep.contiguous(), part_lse.contiguous(), rep_lse.contiguous()
    rows = batch * num_heads
    out = torch.empty(batch, num_heads, head_dim, dtype=out_dtype, device=part_out.device)
    lse = torch.empty(batch, num_heads, dtype=torch.float32, device=part_out.device)
    if rows == 0 or head_dim == 0:
        return out, lse
    po = part_out.reshape(rows, num_partials, head_dim)
    ro = rep_out.reshape(rows, num_repair, head_dim)
    block_d = min(_next_power_of_two(head_dim), 64)
    _merge_speculation_kernel[(rows, triton.cdiv(head_dim, block_d))](
        po, part_lse.reshape(rows, num_partials), keep.view(torch.int8).reshape(-1, num_partials),
        ro, rep_lse.reshape(rows, num_repair), out.view(rows, head_dim), lse.view(rows),
        num_partials, num_repair, head_dim, num_heads // num_kv_heads,
        po.stride(0), po.stride(1), num_partials, num_partials, ro.stride(0), ro.stride(1), num_repair, head_dim,
        BLOCK_N=max(2, min(_next_power_of_two(max(num_partials, 1)), 128)),
        BLOCK_S=max(2, min(_next_power_of_two(max(num_repair, 1)), 64)), BLOCK_D=block_d,
        num_warps=4, **launch_kwargs(part_out.device),
    )  # fmt: skip
    return out, lse
