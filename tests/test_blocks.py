import pytest
import torch
from prr.kernels.reference_selection import make_topk_scores

from prr.blocks import BlockSet, top_blocks, top_blocks_ascending
from prr.selectors.base import ascending


def test_mask_round_trip_on_random_sets():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(2, 3, 61, generator=g) < 0.3
    blocks = BlockSet.from_mask(mask, capacity=61)
    assert torch.equal(blocks.mask(61), mask)
    assert torch.equal(blocks.count, mask.sum(-1))
    # Members first, ascending.
    for b in range(2):
        for h in range(3):
            ids = blocks.indices[b, h, : blocks.count[b, h]]
            assert torch.equal(ids, torch.nonzero(mask[b, h]).flatten())


def test_top_blocks_takes_best_never_neg_inf_and_breaks_ties_to_lower_index():
    scores = torch.tensor([[[1.0, 3.0, 3.0, float("-inf"), 2.0, 3.0]]])
    best = top_blocks(scores, 2)
    assert best.indices[0, 0].tolist() == [1, 2] and best.count.item() == 2
    assert top_blocks(scores, 6).count.item() == 5  # the -inf block is never taken
    assert top_blocks(scores, 100).capacity == 6  # top-K >= number of blocks


def test_empty_set():
    empty = BlockSet.empty(2, 3)
    assert empty.capacity == 0 and empty.mask(7).sum() == 0


@pytest.mark.parametrize("kind", ["randn", "ties", "integers", "extremes"])
@pytest.mark.parametrize("k", [0, 1, 5, 37, 41, 60])
def test_top_blocks_ascending_is_the_sorted_top_blocks(kind, k):
    # The sort-free set equals the stable sort's first k (ties to the lower id, -inf never taken),
    # ascending, at k below, at and past N = 41 (±0 mixed, ±inf, denormals, all -inf rows).
    scores, _ = make_topk_scores(batch=3, num_kv_heads=5, n=41, kind=kind, seed=k)
    scores[2, 2, :] = float("-inf")
    got = top_blocks_ascending(scores, k)
    want = ascending(top_blocks(scores, k))
    assert got.indices.dtype == torch.int32 and got.count.dtype == torch.int32
    assert torch.equal(got.indices, want.indices) and torch.equal(got.count, want.count)


def test_top_blocks_ascending_never_takes_nan():
    scores = torch.tensor([[[1.0, float("nan"), 3.0, float("nan"), 2.0, float("-inf")]]])
    got = top_blocks_ascending(scores, 3)
    assert got.indices.tolist() == [[[0, 2, 4]]] and got.count.tolist() == [[3]]
