"""The log-sum-exp merge of partial attention states (online softmax), on plain tensors: the
definition prr.attention_state's AttentionState merge wraps and the merge kernels' references
use (kernels/ import nothing from prr).

Convention: lse is fp32 (or the inputs' dtype), natural log, of scaled scores; an empty key
set has lse = -inf and out = 0. The merge is commutative and associative.
"""

from __future__ import annotations

import torch
from torch import Tensor


def lse_merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """(out_a [..., D], lse_a [...]) ⊕ (out_b, lse_b): attention over the union of two disjoint key sets."""
    m = torch.maximum(lse_a, lse_b)
    # When both are empty, m = -inf; use 0 so the weights are exp(-inf) = 0, not NaN.
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa = torch.exp(lse_a - m_safe)
    wb = torch.exp(lse_b - m_safe)
    total = wa + wb
    denom = torch.where(total > 0, total, torch.ones_like(total))
    out = (wa.unsqueeze(-1) * out_a + wb.unsqueeze(-1) * out_b) / denom.unsqueeze(-1)
    return out, m_safe + torch.log(total)


def lse_merge_many(out: Tensor, lse: Tensor, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """⊕ over the second-to-last axis: out [..., N, D], lse [..., N], keep [..., N] bool
    (partials to include; others are dropped exactly, never subtracted) -> ([..., D], [...])."""
    if keep is not None:
        lse = torch.where(keep, lse, torch.full_like(lse, float("-inf")))
    total_lse = torch.logsumexp(lse, dim=-1)  # [...]; -inf when nothing is kept
    safe = torch.where(torch.isfinite(total_lse), total_lse, torch.zeros_like(total_lse))
    weights = torch.exp(lse - safe.unsqueeze(-1))  # [..., N]; 0 for dropped/empty partials
    return (weights.unsqueeze(-1) * out).sum(-2), total_lse
