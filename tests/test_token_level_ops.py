"""The Triton op backend at runtime.block_size=1 (token lists, selector=indexer) against the torch
references (prr/runtime/engine_ops.py): attention over token lists (prr.kernels.token_sparse_decode),
merged, as unmerged splits and as token states (scores only), and PRR's repair + merge over token ids, at odd
sizes under the interpreter."""

from __future__ import annotations

import pytest
import torch
from prr.kernels.reference_sparse_decode import random_sparse_decode_inputs, sparse_decode_reference

from prr.runtime.engine_ops import TorchOps, TritonOps, triton_shape_problems


def inputs(seed: int, capacity: int = 13):
    # lengths 27 and 61 tokens, Hq 6 over Hkv 2 (G = 3), D 64 (the token kernel's smallest)
    return random_sparse_decode_inputs(seed, [27, 61], 6, 2, 64, 1, capacity, empty_rows=((0, 1),))


def test_block_size_one_is_a_triton_shape_and_other_small_ones_are_not():
    assert triton_shape_problems(64, 1) == []
    (problem,) = triton_shape_problems(64, 8)
    assert "runtime.block_size >= 16, or 1 (token lists" in problem


@pytest.mark.parametrize("per_block", [False, True])
def test_attention_over_token_lists_is_the_references(per_block):
    x = inputs(0)
    want = sparse_decode_reference(*x.args(), per_block=per_block)
    got = TritonOps().sparse_decode(*x.args(), per_block=per_block)
    torch.testing.assert_close(got[1].double(), want[1], rtol=1e-5, atol=1e-5)  # lse (-inf where empty)
    if per_block:  # token states: the scores only, in both backends (the values stay in the cache)
        assert got[0] is None and TorchOps().sparse_decode(*x.args(), per_block=True)[0] is None
        return
    torch.testing.assert_close(got[0].double(), want[0], rtol=1e-5, atol=1e-5)
    # unmerged splits: merged by merge_speculation with nothing kept, the same state
    split_out, split_lse = TritonOps().sparse_decode(*x.args(), merge_splits=False)
    keep = torch.zeros(2, 2, 1, dtype=torch.bool)
    out, lse = TorchOps().merge_speculation(torch.zeros(2, 6, 1, 64), torch.full((2, 6, 1), float("-inf")),
                                            keep, split_out, split_lse)
    torch.testing.assert_close(out.double(), want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("token_states", [True, False])
def test_repair_and_merge_over_token_ids_is_the_references(token_states):
    """A (13 tokens) and P (11 tokens, some outside A) over the same cache: the one-call repair at
    block size 1 gives the torch backend's output, lse and kept entries, from token states (the
    speculation's scores, values read from the cache: what the engine passes) or from per-token
    states [B, Hq, |P|, D]."""
    a, p = inputs(1), inputs(2, capacity=11)  # P: p's lists over a's cache and query
    over_p = (a.q, a.k_cache, a.v_cache, p.block_ids, p.block_counts, a.lengths, 1, a.scale)
    spec_out, spec_lse = sparse_decode_reference(*over_p, per_block=True, compute_dtype=torch.float32)
    ops_out, ops_lse = TritonOps().sparse_decode(*over_p, per_block=True)
    assert ops_out is None
    torch.testing.assert_close(ops_lse, spec_lse, rtol=1e-5, atol=1e-5)
    # (the engine's A and P: int32 ids and counts)
    ids = [t.int().contiguous() for t in (a.block_ids, a.block_counts, p.block_ids, p.block_counts)]
    args = (a.q, a.k_cache, a.v_cache, *ids, a.lengths, None if token_states else spec_out, spec_lse, 1, a.scale)
    want = TorchOps().repair_and_merge(*args)
    got = TritonOps().repair_and_merge(*args)
    assert torch.equal(got[2], want[2])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    if token_states:  # the same attention as from per-token states
        states = TorchOps().repair_and_merge(*args[:8], spec_out, spec_lse, 1, a.scale)
        torch.testing.assert_close(want[0], states[0], rtol=1e-6, atol=1e-6)
