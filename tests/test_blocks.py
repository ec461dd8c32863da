import torch

from prr.blocks import BlockSet, top_blocks


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
