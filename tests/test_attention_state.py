"""The LSE merge: associative, commutative, and splitting a key set then merging equals
attending the whole set; a keep-mask drops partials exactly."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prr.attention_state import AttentionState, merge, merge_many


def attend(q, k, v):
    """q: [D], k, v: [T, D] -> state over T keys (fp64 reference)."""
    if k.shape[0] == 0:
        return AttentionState(torch.zeros(v.shape[-1], dtype=q.dtype), torch.tensor(float("-inf"), dtype=q.dtype))
    s = (k @ q) / math.sqrt(q.shape[-1])
    p = torch.softmax(s, 0)
    return AttentionState(p @ v, torch.logsumexp(s, 0))


def close(a: AttentionState, b: AttentionState, tol=1e-10):
    assert torch.allclose(a.out, b.out, atol=tol, rtol=tol)
    assert torch.allclose(a.lse, b.lse, atol=tol, rtol=tol)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 40), st.integers(0, 40), st.integers(0, 40), st.integers(1, 33), st.integers(0, 10_000))
def test_merge_associative_commutative_and_split_equals_whole(n1, n2, n3, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(d, generator=g, dtype=torch.float64)
    ks = [torch.randn(n, d, generator=g, dtype=torch.float64) * 3 for n in (n1, n2, n3)]
    vs = [torch.randn(n, d, generator=g, dtype=torch.float64) for n in (n1, n2, n3)]
    a, b, c = (attend(q, k, v) for k, v in zip(ks, vs, strict=True))
    close(merge(a, b), merge(b, a))
    close(merge(merge(a, b), c), merge(a, merge(b, c)))
    whole = attend(q, torch.cat(ks), torch.cat(vs))
    merged = merge(merge(a, b), c)
    if n1 + n2 + n3 == 0:
        assert torch.isneginf(merged.lse) and torch.all(merged.out == 0)
    else:
        close(merged, whole)


def test_merge_many_with_keep_mask_equals_attending_kept_set():
    g = torch.Generator().manual_seed(3)
    d, parts = 19, 7
    q = torch.randn(d, generator=g, dtype=torch.float64)
    ks = [torch.randn(5 + i, d, generator=g, dtype=torch.float64) for i in range(parts)]
    vs = [torch.randn(5 + i, d, generator=g, dtype=torch.float64) for i in range(parts)]
    states = [attend(q, k, v) for k, v in zip(ks, vs, strict=True)]
    out = torch.stack([s.out for s in states])
    lse = torch.stack([s.lse for s in states])
    keep = torch.tensor([True, False, True, True, False, False, True])
    kept = merge_many(out, lse, keep)
    ref = attend(q, torch.cat([k for k, m in zip(ks, keep, strict=True) if m]),
                 torch.cat([v for v, m in zip(vs, keep, strict=True) if m]))
    close(kept, ref)
    nothing = merge_many(out, lse, torch.zeros(parts, dtype=torch.bool))
    assert torch.isneginf(nothing.lse) and torch.all(nothing.out == 0) and not torch.isnan(nothing.out).any()
