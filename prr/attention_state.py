"""Partial attention states and their log-sum-exp merge (online softmax).

A state (out, lse) is attention of a query over some set of keys:
out = softmax-weighted mean of their values, lse = log Σ exp(scale · q·k) over those keys.
Convention: lse is fp32, natural log, of *scaled* scores; an empty key set has
lse = -inf and out = 0. The merge ⊕ is commutative and associative, so partial states
over disjoint key sets combine in any order into attention over their union.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from prr.kernels.reference_merge import lse_merge, lse_merge_many


@dataclass(frozen=True)
class AttentionState:
    out: Tensor  # [..., D] fp32 normalised attention output over this state's keys
    lse: Tensor  # [...] fp32 natural-log sum of exp(scaled scores); -inf for no keys


def merge(a: AttentionState, b: AttentionState) -> AttentionState:
    """a ⊕ b: attention over the union of two disjoint key sets."""
    return AttentionState(*lse_merge(a.out, a.lse, b.out, b.lse))


def merge_many(out: Tensor, lse: Tensor, keep: Tensor | None = None) -> AttentionState:
    """⊕ over the second-to-last axis of stacked partial states.

    out: [..., N, D], lse: [..., N], keep: [..., N] bool (partials to include; others are
    dropped exactly, never subtracted) -> AttentionState over [...].
    """
    return AttentionState(*lse_merge_many(out, lse, keep))
