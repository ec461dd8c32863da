"""Partial attention states and their log-sum-exp merge (online softmax).

A state (out, lse) is attention of a query over some set of keys:
out = softmax-weighted mean of their values, lse = log Σ exp(scale · q·k) over those keys.
Convention: lse is fp32, natural log, of *scaled* scores; an empty key set has
lse = -inf and out = 0. The merge ⊕ is commutative and associative, so partial states
over disjoint key sets combine in any order into attention over their union.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class AttentionState:
    out: Tensor  # [..., D] fp32 normalised attention output over this state's keys
    lse: Tensor  # [...] fp32 natural-log sum of exp(scaled scores); -inf for no keys


def merge(a: AttentionState, b: AttentionState) -> AttentionState:
    """a ⊕ b: attention over the union of two disjoint key sets."""
    m = torch.maximum(a.lse, b.lse)
    # When both are empty, m = -inf; use 0 so the weights are exp(-inf) = 0, not NaN.
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa = torch.exp(a.lse - m_safe)
    wb = torch.exp(b.lse - m_safe)
    total = wa + wb
    denom = torch.where(total > 0, total, torch.ones_like(total))
    out = (wa.unsqueeze(-1) * a.out + wb.unsqueeze(-1) * b.out) / denom.unsqueeze(-1)
    return AttentionState(out=out, lse=m_safe + torch.log(total))


def merge_many(out: Tensor, lse: Tensor, keep: Tensor | None = None) -> AttentionState:
    """⊕ over the second-to-last axis of stacked partial states.

    out: [..., N, D], lse: [..., N], keep: [..., N] bool (partials to include; others are
    dropped exactly, never subtracted) -> AttentionState over [...].
    """
    if keep is not None:
        lse = torch.where(keep, lse, torch.full_like(lse, float("-inf")))
    total_lse = torch.logsumexp(lse, dim=-1)  # [...]; -inf when nothing is kept
    safe = torch.where(torch.isfinite(total_lse), total_lse, torch.zeros_like(total_lse))
    weights = torch.exp(lse - safe.unsqueeze(-1))  # [..., N]; 0 for dropped/empty partials
    merged = (weights.unsqueeze(-1) * out).sum(-2)
    return AttentionState(out=merged, lse=total_lse)
