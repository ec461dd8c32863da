"""The batched prefill tail (`Selector.select_tail` of quest, exact and LESS's Quest scores: the T
positions folded into the batch; LESS's feature scores: the loop itself) equals the base class's loop of one
metadata update and `select` per position:
same blocks, bitwise-equal fp32 scores, on both op backends (triton: CPU interpreter, small),
at odd sizes (prompt not a multiple of the block, GQA group 1 and 3, batch 1 and 2)."""

import pytest
import torch

from prr.cache import PagedKVCache
from prr.selectors import ExactSelector, LessSelector, QuestSelector
from prr.selectors.base import Selector
from prr.selectors.infllm_v2 import InfLLMV2Selector

SELECTORS = {"quest": QuestSelector, "exact": ExactSelector, "less_quest": LessSelector, "less_features": LessSelector,
             "infllm_v2": InfLLMV2Selector}
OPTIONS = {"less_quest": {"num_features": 8, "scores": "quest"}, "less_features": {"num_features": 8, "scores": "features"}}


def tails(name, gqa_reduce, backend, batch, group, block, prompt, tail, dtype=torch.float32, seed=0):
    """-> (loop's, batched) Selections of positions [prompt - tail, prompt), and max_blocks."""
    g = torch.Generator().manual_seed(seed)
    hkv, d = 2, 16
    q = torch.randn(batch, hkv, group, prompt, d, generator=g).to(dtype)  # [B, Hkv, G, T, D]
    k = (torch.randn(batch, hkv, prompt, d, generator=g) * 3).to(dtype)
    start = prompt - tail
    out = []
    for select_tail in (Selector.select_tail, SELECTORS[name].select_tail):
        options = {"gqa_reduce": gqa_reduce} if name != "infllm_v2" else {}  # (infllm_v2: its group sum)
        sel = SELECTORS[name](topk_blocks=3, dense_layers=[], **options, **OPTIONS.get(name, {}))
        assert sel.set_backend(backend) == backend
        cache = PagedKVCache(1, batch, hkv, d, block, prompt + 5, dtype=dtype)  # spare room past the prompt
        cache.append(0, k, k)
        sel.update_metadata(cache, 0, 0, start)
        out.append(select_tail(sel, q[:, :, :, start:], cache, 0, start, queries=q))
    return *out, cache.max_blocks


def assert_same(loop, batched, max_blocks):
    assert len(loop) == len(batched)
    for a, b in zip(loop, batched, strict=True):
        assert b.scores.dtype == torch.float32 and b.scores.shape == a.scores.shape
        assert torch.equal(a.blocks.mask(max_blocks), b.blocks.mask(max_blocks))
        assert torch.equal(a.blocks.count, b.blocks.count)
        assert torch.equal(a.scores, b.scores)


@pytest.mark.parametrize("name", ["quest", "exact"])
@pytest.mark.parametrize("gqa_reduce", ["max", "sum", "union"])
@pytest.mark.parametrize("batch,group,block,prompt,tail", [(1, 1, 8, 37, 11), (2, 3, 16, 53, 20),
                                                           (2, 3, 8, 40, 39)])
def test_batched_tail_equals_the_loop_torch(name, gqa_reduce, batch, group, block, prompt, tail):
    # (2, 3, 8, 40, 39): the tail starts at position 1, inside the first block.
    assert_same(*tails(name, gqa_reduce, "torch", batch, group, block, prompt, tail))


@pytest.mark.parametrize("name", ["less_quest", "less_features"])
@pytest.mark.parametrize("gqa_reduce,batch,group,block,prompt,tail", [("max", 2, 3, 8, 45, 13), ("union", 1, 1, 16, 37, 11)])
def test_less_tail_equals_the_loop(name, gqa_reduce, batch, group, block, prompt, tail):
    # LESS's feature scores read the open block's summaries: the tail is the loop's, not Quest's bound.
    assert_same(*tails(name, gqa_reduce, "torch", batch, group, block, prompt, tail))


@pytest.mark.parametrize("batch,group,prompt,tail", [(2, 3, 333, 45), (1, 1, 131, 130)])
def test_infllm_v2_tail_equals_the_loop(batch, group, prompt, tail):
    # Blocks of 64 tokens, windows of 32 at stride 16: the first tail crosses block 320 and three
    # window completions; the second starts at position 1 (no window complete: dense rows).
    assert_same(*tails("infllm_v2", "sum", "torch", batch, group, 64, prompt, tail))


@pytest.mark.parametrize("name", ["quest", "exact"])
@pytest.mark.parametrize("gqa_reduce,batch,group,block,prompt,tail", [("max", 2, 3, 16, 34, 4),
                                                                      ("sum", 1, 1, 8, 26, 3)])
def test_batched_tail_equals_the_loop_triton(name, gqa_reduce, batch, group, block, prompt, tail):
    # Few positions (the interpreter is slow), each tail crossing a block boundary.
    pytest.importorskip("triton")
    assert_same(*tails(name, gqa_reduce, "triton", batch, group, block, prompt, tail))


@pytest.mark.parametrize("name", ["quest", "exact"])
def test_batched_tail_equals_the_loop_in_16_bit(name):
    # Quest's metadata is kept in the cache dtype: the running max / min of bf16 keys is exact too.
    assert_same(*tails(name, "max", "torch", 2, 3, 8, 45, 13, dtype=torch.bfloat16))


def test_quest_tail_metadata_ends_as_the_loops():
    # select_tail leaves the metadata the loop does (covering the whole prompt).
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 2, 45, 16, generator=g)
    metas = []
    for select_tail in (Selector.select_tail, QuestSelector.select_tail):
        sel, cache = QuestSelector(topk_blocks=3), PagedKVCache(1, 2, 2, 16, 8, 50)
        cache.append(0, k, k)
        sel.update_metadata(cache, 0, 0, 30)
        select_tail(sel, torch.randn(2, 2, 1, 15, 16, generator=g), cache, 0, 30)
        metas.append(sel.metadata(cache, 0))
    assert all(torch.equal(a, b) for a, b in zip(*metas, strict=True))


def test_quest_tail_in_chunks_of_one_position_equals_the_loop(monkeypatch):
    # The torch path scores its positions in cache-sized chunks (one position each here).
    import prr.selectors.quest as quest

    monkeypatch.setattr(quest, "TAIL_CHUNK_ELEMENTS", {"cpu": 1})
    assert_same(*tails("quest", "sum", "torch", 2, 3, 8, 45, 13))


@pytest.mark.parametrize("name", ["ema", "query_similarity"])
def test_warm_up_of_layer_runs_at_once_equals_layer_by_layer(monkeypatch, name):
    # finish_prefill on the kernels: one update_layers per tail step and run of consecutive sparse
    # layers (dense layer 1 splits 0 | 2, 3) leaves the state of T updates per layer, bitwise
    # (query_similarity: no query pending in the tail, so nothing is paired).
    # (gqa_reduce=union: torch selection, only the predictor on the interpreter: faster.)
    pytest.importorskip("triton")
    from prr.budget.fixed import FixedBudget
    from prr.predictors import EmaPredictor, QuerySimilarityPredictor
    from prr.runtime.dsa_backend import DSABackend
    from prr.runtime.predictor_schedule import state_tensors

    make = {"ema": lambda: EmaPredictor(alpha=0.7, calibrate=False),
            "query_similarity": lambda: QuerySimilarityPredictor(cache_size=3, neighbours=2)}[name]

    g = torch.Generator().manual_seed(7)
    hkv, group, d, prompt = 2, 3, 16, 29
    qkv = [[torch.randn(1, h, prompt, d, generator=g) for h in (hkv * group, hkv, hkv)] for _ in range(4)]
    states = []
    for at_once in (False, True):
        predictor = make()
        backend = DSABackend(PagedKVCache(4, 1, hkv, d, 8, prompt + 2), hkv * group,
                             QuestSelector(topk_blocks=2, gqa_reduce="union", dense_layers=[1]), predictor, FixedBudget(),
                             calibration_tokens=3, backend="triton")
        assert predictor.learns_layers_at_once()
        if not at_once:
            monkeypatch.setattr(predictor, "learns_layers_at_once", lambda: False)
        for layer in range(4):
            backend.prefill(layer, *qkv[layer])
        backend.finish_prefill()
        assert backend._warm_runs() == ([(0, range(0, 1)), (2, range(2, 4))] if at_once else [])
        states.append(state_tensors(backend.predictor_state))
    assert sum(float(t.float().abs().sum()) for t in states[0]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*states, strict=True))
