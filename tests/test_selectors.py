"""Selectors' defining properties on random inputs at odd sizes."""

import itertools

import pytest
import torch

from prr.block_attention import attend_dense
from prr.selectors import DenseSelector, ExactSelector, QuestSelector
from tests.helpers import random_cache


@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_quest_score_bounds_every_key_dot_product(group):
    sel = QuestSelector(topk_blocks=4)
    cache = random_cache(sel, length=113, num_kv_heads=2, head_dim=24, block_size=16, seed=group)
    q = torch.randn(1, 2, group, 24) * 3
    bound = sel.head_scores(q, cache, 0, 113)  # [1, 2, G, max_blocks]
    keys = cache.keys[0][:, :, :113]  # [1, 2, T, D]
    dots = torch.einsum("bhgd,bhtd->bhgt", q, keys)
    for t in range(113):
        assert torch.all(bound[..., t // 16] >= dots[..., t] - 1e-4)


def test_quest_incremental_metadata_equals_rebuild():
    sel = QuestSelector(topk_blocks=4)
    cache = random_cache(sel, length=27, block_size=8, extra=40)
    g = torch.Generator().manual_seed(1)
    for _ in range(37):  # one token at a time, crossing block boundaries
        k = torch.randn(1, 2, 1, 16, generator=g)
        start, end = cache.append(0, k, k)
        sel.update_metadata(cache, 0, start, end)
    incremental = {n: t.clone() for n, t in cache.metadata[0].items()}
    cache.metadata[0].clear()
    sel.update_metadata(cache, 0, 0, cache.length(0))
    for name, tensor in cache.metadata[0].items():
        assert torch.equal(incremental[name], tensor), name


@pytest.mark.parametrize("reduce", ["max", "sum", "union"])
@pytest.mark.parametrize("length,k", [(113, 5), (61, 3), (27, 9), (1110, 12)])
def test_selection_size_and_forced_blocks(reduce, length, k):
    sel = QuestSelector(topk_blocks=k, sink_blocks=1, local_blocks=1, force_newest=True, gqa_reduce=reduce)
    cache = random_cache(sel, length=length, block_size=8)
    q = torch.randn(1, 2, 3, 16)
    a = sel.select(q, cache, 0)
    nb = cache.num_blocks(0)
    mask = a.blocks.mask(cache.max_blocks)
    if reduce != "union":
        assert torch.all(a.blocks.count == min(k, nb))
    else:
        assert torch.all(a.blocks.count >= min(k, nb)) and torch.all(a.blocks.count <= min(3 * k, nb))
    assert torch.all(mask[..., 0]) and torch.all(mask[..., nb - 1]) and torch.all(mask[..., nb - 2])
    assert not mask[..., nb:].any()


def test_topk_at_least_number_of_blocks_selects_all():
    sel = QuestSelector(topk_blocks=64)
    cache = random_cache(sel, length=61, block_size=8)
    a = sel.select(torch.randn(1, 2, 3, 16), cache, 0)
    assert torch.all(a.blocks.count == 8)


def test_exact_selector_carries_at_least_the_mass_of_any_same_size_set():
    sel = ExactSelector(topk_blocks=4, sink_blocks=0, force_newest=False, gqa_reduce="sum")
    cache = random_cache(sel, length=61, block_size=8, num_kv_heads=1)
    q = torch.randn(1, 1, 3, 16) * 2
    _, mass = attend_dense(q, cache, 0, 61, 0.25)
    mass = mass.sum(2)[0, 0, :8]  # KV-head mass per block
    chosen = sel.select(q, cache, 0).blocks.mask(cache.max_blocks)[0, 0, :8]
    best = mass[chosen].sum()
    for other in itertools.combinations(range(8), 4):
        assert best >= mass[list(other)].sum() - 1e-6


def test_dense_selector_selects_every_block():
    sel = DenseSelector()
    cache = random_cache(sel, length=113, block_size=16)
    a = sel.select(torch.randn(1, 2, 3, 16), cache, 0)
    assert torch.all(a.blocks.count == 8) and torch.all(a.blocks.mask(cache.max_blocks)[..., :8])


def test_bad_selector_options_are_clear_errors():
    with pytest.raises(ValueError, match="topk_blocks=0"):
        QuestSelector(topk_blocks=0)
    with pytest.raises(ValueError, match="gqa_reduce='mean'"):
        QuestSelector(topk_blocks=4, gqa_reduce="mean")
    with pytest.raises(ValueError, match="raise topk_blocks"):
        QuestSelector(topk_blocks=2, sink_blocks=2, local_blocks=1)


def test_set_backend_goes_both_ways():
    """A selector reused by an engine of the other backend takes that backend (a torch-vs-triton
    comparison on one object must not compare the kernels with themselves)."""
    sel = QuestSelector(topk_blocks=4)
    assert sel.set_backend("triton") == "triton" and sel.set_backend("torch") == "torch"
    assert QuestSelector(topk_blocks=4, gqa_reduce="union").set_backend("triton") == "torch"  # no kernel for union
