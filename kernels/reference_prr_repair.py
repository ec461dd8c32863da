"""Torch reference for kernels/prr_repair.py's `repair_and_merge`: the three steps it fuses, one
after the other (repair plan, attention over A \\ P, merge). Static shapes, no host syncs: the
graph engine's torch backend runs it (prr.runtime.engine_ops.TorchOps). Imports nothing from
prr and nothing from triton.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .reference_prr_merge import merge_speculation_reference, repair_plan_reference
from .reference_sparse_decode import sparse_decode_reference
from .reference_token_sparse_decode import token_states_reference


def repair_and_merge_reference(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, sel_idx: Tensor, sel_cnt: Tensor, pred_idx: Tensor,
    pred_cnt: Tensor, lengths: Tensor, part_out: Tensor | None, part_lse: Tensor, block_size: int, scale: float,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[Tensor, Tensor, Tensor]:
    """Arguments as prr.kernels.prr_repair.repair_and_merge (q [B, Hq, D], caches [B, Hkv, T_max, D],
    A and P [B, Hkv, C_A / C_P] with counts [B, Hkv], lengths [B], P's per-block states
    part_out [B, Hq, C_P, D] / part_lse [B, Hq, C_P]; at block size 1 part_out=None: token states,
    each kept token's value row read from v_cache).
    -> (out [B, Hq, D], lse [B, Hq]) in compute_dtype, keep [B, Hkv, C_P] bool."""
    if part_out is None:
        if block_size != 1:
            raise ValueError(f"part_out=None (token states) needs block_size 1, got {block_size}")
        part_out = token_states_reference(v_cache, pred_idx, q.shape[1])
    max_blocks = -(-k_cache.shape[2] // block_size)  # a partial last block included
    miss_idx, miss_cnt, keep = repair_plan_reference(sel_idx, sel_cnt, pred_idx, pred_cnt, max_blocks)
    rep_out, rep_lse = sparse_decode_reference(q, k_cache, v_cache, miss_idx, miss_cnt, lengths, block_size, scale,
                                               compute_dtype=compute_dtype)
    out, lse = merge_speculation_reference(part_out, part_lse, keep, rep_out, rep_lse, compute_dtype)
    return out, lse, keep
