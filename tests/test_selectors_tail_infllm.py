"""InfLLM's batched prefill tail (`InfLLMSelector.select_tail`) against the base class's loop of one
metadata update and `select` per position, run on a deep copy of the same state: the same
selections (blocks, counts, bitwise fp32 scores) and afterwards every metadata slot of the cache
bitwise equal (representatives, live means, window scores, counters), for both representative
rules, both scorings, per_head, window / sink variants, on both op backends (triton: CPU
interpreter, tiny), at odd sizes (prompt not a multiple of the block, tails crossing 2-5 block
boundaries, GQA groups 1, 3, 7, batch 1 and 2)."""

import copy
from types import SimpleNamespace

import pytest
import torch

from prr.cache import PagedKVCache
from prr.selectors import InfLLMSelector
from prr.selectors.base import Selector

PUBLISHED = {"scoring": "position_agnostic", "representatives_from": "window_attention"}
PRR_VARIANT = {"scoring": "rope", "representatives_from": "one_query"}


def tails(options, backend="torch", batch=2, group=3, head_dim=16, block=8, prompt=53, tail=20,
          dtype=torch.float32, seed=0):
    """-> (loop's, batched) Selections of positions [prompt - tail, prompt), their caches after."""
    g = torch.Generator().manual_seed(seed)
    hkv = 2
    q = torch.randn(batch, hkv, group, prompt, head_dim, generator=g).to(dtype)  # [B, Hkv, G, T, D]
    k = (torch.randn(batch, hkv, prompt, head_dim, generator=g) * 2).to(dtype)
    sel = InfLLMSelector(**{"topk_blocks": 4, "sink_blocks": 1, "local_blocks": 1, **options})
    sel.bind_model(SimpleNamespace(head_dim=head_dim, rope_theta=10000.0, rope_scaling=None))
    assert sel.set_backend(backend) == backend
    cache = PagedKVCache(1, batch, hkv, head_dim, block, prompt + 5, dtype=dtype)  # spare room past the prompt
    cache.append(0, k, k)
    start = prompt - tail
    sel.update_metadata(cache, 0, 0, start)
    twin, twin_cache = copy.deepcopy(sel), copy.deepcopy(cache)
    loop = Selector.select_tail(twin, q[:, :, :, start:], twin_cache, 0, start, queries=q)
    batched = sel.select_tail(q[:, :, :, start:], cache, 0, start, queries=q)
    return loop, batched, twin_cache, cache


def assert_same(loop, batched, loop_cache, batched_cache):
    assert len(loop) == len(batched)
    for a, b in zip(loop, batched, strict=True):
        assert torch.equal(a.blocks.indices, b.blocks.indices) and torch.equal(a.blocks.count, b.blocks.count)
        assert b.scores.dtype == torch.float32 and torch.equal(a.scores, b.scores)
    want, got = loop_cache.metadata[0], batched_cache.metadata[0]
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


@pytest.mark.parametrize("rule", ["window_attention", "one_query"])
@pytest.mark.parametrize("scoring", ["position_agnostic", "rope"])
@pytest.mark.parametrize("per_head,gqa_reduce", [(False, "sum"), (True, "max"), (True, "union")])
def test_batched_tail_equals_the_loop(rule, scoring, per_head, gqa_reduce):
    # Positions 33..52 in blocks of 8: three blocks leave the window during the tail.
    options = {"scoring": scoring, "representatives_from": rule, "per_head": per_head, "gqa_reduce": gqa_reduce}
    assert_same(*tails(options))


@pytest.mark.parametrize("options", [PUBLISHED, PRR_VARIANT])
def test_batched_tail_equals_the_loop_at_block_16_and_group_7(options):
    # Qwen's group, blocks of 16, an odd prompt: positions 36..74 cross 3 block boundaries.
    assert_same(*tails(options, batch=1, group=7, block=16, prompt=75, tail=39))


@pytest.mark.parametrize("options", [
    {**PRR_VARIANT, "local_blocks": 0, "force_newest": False, "sink_blocks": 0, "topk_blocks": 2},  # no window
    {**PRR_VARIANT, "local_blocks": 0, "force_newest": False, "sink_blocks": 2, "per_head": True},
    {**PUBLISHED, "sink_blocks": 0, "local_blocks": 2, "representatives": 20},  # r > S: the whole block
    {**PUBLISHED, "sink_blocks": 2, "local_blocks": 0, "topk_blocks": 3},  # the newest block only
])
def test_batched_tail_equals_the_loop_for_window_variants(options):
    # The tail starts at position 1, inside the first block (catch_up's backlog is empty).
    assert_same(*tails(options, batch=2, group=1, prompt=41, tail=40))


@pytest.mark.parametrize("options", [PUBLISHED, PRR_VARIANT])
def test_batched_tail_equals_the_loop_in_16_bit(options):
    assert_same(*tails(options, group=3, prompt=45, tail=13, dtype=torch.bfloat16))


def test_batched_tail_in_chunks_of_one_position_equals_the_loop(monkeypatch):
    # The scores are made in chunks of positions (memory-bounded): one position each here.
    import prr.selectors.infllm as infllm

    monkeypatch.setattr(infllm, "TAIL_CHUNK_ELEMENTS", {"cpu": 1})
    assert_same(*tails(PUBLISHED, batch=2, group=3, prompt=37, tail=11))


@pytest.mark.parametrize("options,batch", [(PUBLISHED, 2), ({**PRR_VARIANT, "per_head": True, "gqa_reduce": "max"}, 1)])
def test_batched_tail_equals_the_loop_triton(options, batch):
    # Few positions (the interpreter is slow): 30..33 in blocks of 8, a block leaving at 32.
    pytest.importorskip("triton")
    assert_same(*tails(options, backend="triton", batch=batch, group=3, prompt=34, tail=4))
