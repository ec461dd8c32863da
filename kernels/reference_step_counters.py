"""Torch reference for kernels/step_counters.py: a step's selection counters from membership
masks. Static shapes, no host syncs: the graph engine's torch backend runs it
(prr.runtime.engine_ops.TorchOps). Imports nothing from prr and nothing from triton.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .reference_prr_merge import membership


def step_counters_reference(sel_idx: Tensor, sel_cnt: Tensor, pred_idx: Tensor | None, pred_cnt: Tensor | None,
                            prev_idx: Tensor, prev_cnt: Tensor, max_blocks: int) -> Tensor:
    """A: sel_idx [B, Hkv, K] / sel_cnt [B, Hkv]; P: pred_idx [B, Hkv, C] / pred_cnt, or None;
    A_{t-1}: prev_idx [B, Hkv, K] / prev_cnt [B, Hkv]; ids < max_blocks.
    -> [4, B * Hkv] int64: (|A|, |P|, |P ∩ A|, |A ∩ A_{t-1}|) per (row, KV head)."""
    a = membership(sel_idx, sel_cnt, max_blocks)  # [B, Hkv, NB]
    p = membership(pred_idx, pred_cnt, max_blocks) if pred_idx is not None else torch.zeros_like(a)
    prev = membership(prev_idx, prev_cnt, max_blocks)
    counts = torch.stack([a.sum(-1), p.sum(-1), (a & p).sum(-1), (a & prev).sum(-1)])  # [4, B, Hkv]
    return counts.flatten(1).long()
