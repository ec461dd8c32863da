"""Torch references for kernels/prr_merge.py: the repair plan (A \\ P and keep = P ∩ A) and the
exact-mode merge of the kept speculative states with the repair state.

Static shapes and no host syncs, so the graph engine's torch backend runs them as its ops
(prr.runtime.engine_ops.TorchOps) and the kernel tests compare against the same functions.
Imports nothing from prr and nothing from triton.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .reference_merge import lse_merge, lse_merge_many


def membership(indices: Tensor, count: Tensor, max_blocks: int) -> Tensor:
    """indices [..., C] (entries >= count are padding, any value), count [...] -> [..., max_blocks] bool."""
    valid = torch.arange(indices.shape[-1], device=indices.device) < count.unsqueeze(-1)
    out = torch.zeros(*indices.shape[:-1], max_blocks + 1, dtype=torch.bool, device=indices.device)
    return out.scatter_(-1, torch.where(valid, indices.long(), max_blocks), True)[..., :max_blocks]


def repair_plan_reference(sel_idx: Tensor, sel_cnt: Tensor, pred_idx: Tensor, pred_cnt: Tensor,
                          max_blocks: int) -> tuple[Tensor, Tensor, Tensor]:
    """A: sel_idx [B, Hkv, K] (distinct ids < max_blocks, first sel_cnt valid), sel_cnt [B, Hkv];
    P: pred_idx [B, Hkv, C], pred_cnt [B, Hkv].
    -> (miss_idx [B, Hkv, K] int32: A \\ P in A's order, then 0; miss_cnt [B, Hkv] int32;
        keep [B, Hkv, C] bool: P entry valid and in A)."""
    sel_valid = torch.arange(sel_idx.shape[-1], device=sel_idx.device) < sel_cnt.unsqueeze(-1)
    pred_valid = torch.arange(pred_idx.shape[-1], device=pred_idx.device) < pred_cnt.unsqueeze(-1)
    selected = membership(sel_idx, sel_cnt, max_blocks)
    predicted = membership(pred_idx, pred_cnt, max_blocks)
    # padding entries may hold any id: never index with them
    missed = sel_valid & ~torch.gather(predicted, -1, torch.where(sel_valid, sel_idx.long(), 0))  # [B, Hkv, K]
    keep = pred_valid & torch.gather(selected, -1, torch.where(pred_valid, pred_idx.long(), 0))  # [B, Hkv, C]
    # Compact the missed entries to the front, in A's order: a stable sort of "not missed".
    order = torch.sort((~missed).to(torch.int8), dim=-1, stable=True).indices
    miss_cnt = missed.sum(-1)
    front = torch.arange(sel_idx.shape[-1], device=sel_idx.device) < miss_cnt.unsqueeze(-1)
    miss_idx = torch.where(front, torch.gather(sel_idx, -1, order), 0)
    return miss_idx.to(torch.int32), miss_cnt.to(torch.int32), keep


def merge_speculation_reference(part_out: Tensor, part_lse: Tensor, keep: Tensor, rep_out: Tensor, rep_lse: Tensor,
                                compute_dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """part_out [B, Hq, C, D], part_lse [B, Hq, C]: P's per-block states; keep [B, Hkv, C] bool;
    the repair rep_out [B, Hq, D], rep_lse [B, Hq], or its unmerged splits [B, Hq, S, (D)].
    -> (out [B, Hq, D], lse [B, Hq]) in compute_dtype: the kept speculative states merged
    (lse_merge_many), the repair's splits merged, then the two merged (lse_merge)."""
    group = part_out.shape[1] // keep.shape[1]
    keep_q = keep.repeat_interleave(group, dim=1)  # [B, Hq, C]
    spec = lse_merge_many(part_out.to(compute_dtype), part_lse.to(compute_dtype), keep_q)
    rep_out, rep_lse = rep_out.to(compute_dtype), rep_lse.to(compute_dtype)
    repair = lse_merge_many(rep_out, rep_lse) if rep_out.dim() == 4 else (rep_out, rep_lse)
    return lse_merge(*spec, *repair)
