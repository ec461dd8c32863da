"""LESS: its defining properties on random inputs at odd sizes (InfLLM's are in
tests/test_selectors_infllm.py). LESS with every block selected is dense attention, and its
compensation of the unselected blocks lowers the output error of plain top-K on inputs with
structure."""


import pytest
import torch

from prr.block_attention import attend_blocks, attend_dense
from prr.blocks import BlockSet
from prr.cache import PagedKVCache
from prr.predictors import EmaPredictor, LastStepPredictor, NoPredictor, OraclePredictor
from prr.selectors import LessSelector, QuestSelector
from tests.helpers import eager_step, random_cache
from tests.test_runtime import run_backend

# --- LESS -------------------------------------------------------------------------------------


def structured_cache(sel, length, group, num_kv_heads=2, head_dim=16, block_size=8, seed=0):
    """Keys share a common component plus small noise (diffuse attention over many blocks), a
    few blocks hold keys aligned with the query (peaked mass); values are smooth per block."""
    g = torch.Generator().manual_seed(seed)
    b, h, d = 1, num_kv_heads, head_dim
    common = torch.randn(b, h, 1, d, generator=g) * 1.5
    keys = common + 0.6 * torch.randn(b, h, length, d, generator=g)
    q = torch.randn(b, h, group, d, generator=g)
    nb = -(-length // block_size)
    hot = torch.randperm(nb, generator=g)[:3]
    for blk in hot.tolist():
        keys[:, :, blk * block_size : (blk + 1) * block_size] += 0.8 * q.mean(2, keepdim=True)
    trend = torch.randn(b, h, 1, d, generator=g)
    values = (torch.randn(b, h, 1, d, generator=g) + trend * torch.linspace(-1, 1, length).view(1, 1, length, 1)
              + 0.5 * torch.randn(b, h, length, d, generator=g))
    cache = PagedKVCache(1, b, h, d, block_size, length)
    cache.append(0, keys, values)
    sel.update_metadata(cache, 0, 0, length)
    return cache, q


def run_step(sel, predictor, cache, q, budget_blocks):
    """-> the eager PRR step's output [B, Hkv, G, D] fp32."""
    return eager_step(sel, predictor, cache, q, budget_blocks)[0]


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("length", [61, 113])
def test_less_with_every_block_selected_is_dense(group, length):
    sel = LessSelector(topk_blocks=64, num_features=16, scores="features")
    cache, q = structured_cache(sel, length, group, seed=group)
    comp = sel.compensation(q, cache, 0, sel.select(q, cache, 0))
    assert torch.all(comp.lse == float("-inf")) and torch.all(comp.out == 0)
    dense, _ = attend_dense(q, cache, 0, length, 0.25)
    for predictor in (NoPredictor(), OraclePredictor()):
        out = run_step(sel, predictor, cache, q, budget_blocks=3)
        assert (out - dense.out).norm() / dense.out.norm() <= 1e-5


@pytest.mark.parametrize("group", [1, 3, 4])
def test_less_compensation_lowers_output_error_of_plain_topk(group):
    errors = {"topk": [], "less": []}
    for seed in range(4):
        sel = LessSelector(topk_blocks=4, num_features=64, gqa_reduce="max")
        quest = QuestSelector(topk_blocks=4, gqa_reduce="max")
        cache, q = structured_cache(sel, 203, group, seed=10 * group + seed)
        dense, _ = attend_dense(q, cache, 0, 203, 0.25)
        a = sel.select(q, cache, 0)
        assert torch.equal(a.blocks.indices, quest.select(q, cache, 0).blocks.indices)  # scores=quest: Quest's A
        sparse = attend_blocks(q, cache, 0, a.blocks, 203, 0.25)
        less = run_step(sel, NoPredictor(), cache, q, 0)
        for name, out in (("topk", sparse.out), ("less", less)):
            errors[name].append(((out - dense.out).norm() / dense.out.norm()).item())
    assert all(lo < hi for lo, hi in zip(errors["less"], errors["topk"], strict=True)), errors
    assert sum(errors["less"]) < 0.75 * sum(errors["topk"]), errors


def test_less_compensation_estimates_the_unselected_state():
    """With many random features, mass and output of the unselected blocks are close to exact."""
    sel = LessSelector(topk_blocks=3, num_features=4096)
    cache, q = structured_cache(sel, 113, 3, seed=5)
    a = sel.select(q, cache, 0)
    nb = cache.num_blocks(0)
    rest = ~a.blocks.mask(cache.max_blocks) & (torch.arange(cache.max_blocks) < nb)
    exact = attend_blocks(q, cache, 0, BlockSet.from_mask(rest), 113, 0.25)
    comp = sel.compensation(q, cache, 0, a)
    assert (comp.lse - exact.lse).abs().max() < 0.2  # mass within ~20% (a Monte Carlo estimate)
    assert (comp.out - exact.out).norm() / exact.out.norm() < 0.15


def test_less_incremental_metadata_equals_rebuild():
    sel = LessSelector(topk_blocks=4, num_features=8)
    cache = random_cache(sel, length=27, block_size=8, extra=40)
    g = torch.Generator().manual_seed(1)
    for _ in range(37):  # one token at a time, crossing block boundaries
        k = torch.randn(1, 2, 1, 16, generator=g)
        start, end = cache.append(0, k, torch.randn(1, 2, 1, 16, generator=g))
        sel.update_metadata(cache, 0, start, end)
    incremental = {n: t.clone() for n, t in cache.metadata[0].items()}
    cache.metadata[0].clear()
    sel.update_metadata(cache, 0, 0, 27)  # the same centre (fixed by the first update) ...
    sel.update_metadata(cache, 0, 27, cache.length(0))  # ... then the rest at once
    for name, tensor in cache.metadata[0].items():
        finite = torch.isfinite(tensor)
        assert torch.equal(finite, torch.isfinite(incremental[name])), name
        torch.testing.assert_close(tensor[finite], incremental[name][finite], rtol=1e-4, atol=1e-5, msg=name)


SELECTORS = {"less": lambda: LessSelector(topk_blocks=6, local_blocks=1, num_features=16)}


@pytest.mark.parametrize("predictor", [LastStepPredictor(), EmaPredictor(), OraclePredictor()],
                         ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_exact_prr_equals_serial_dsa(name, predictor, group):
    _, outs, rows = run_backend(predictor, selector=SELECTORS[name](), group=group, seed=group, steps=6)
    assert rows["serial_relerr"].max() <= 1e-5  # the runtime's own check (same compensation both ways)
    _, serial, _ = run_backend(NoPredictor(), selector=SELECTORS[name](), group=group, seed=group, steps=6)
    for (_, _, out), (_, _, ref) in zip(outs, serial, strict=True):  # and against a serial-DSA run
        assert (out - ref).norm() <= 1e-5 * ref.norm()


def test_less_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match=r"scores='mass' is not one of \['quest', 'features'\]"):
        LessSelector(topk_blocks=8, scores="mass")
    with pytest.raises(ValueError, match="num_features=0"):
        LessSelector(topk_blocks=8, num_features=0)
    with pytest.raises(ValueError, match=r"compensate='no' is not one of \[True, False\]"):
        LessSelector(topk_blocks=8, compensate="no")
    assert LessSelector(topk_blocks=8).triton_problems() == []  # Quest's selection kernels + the compensation kernel
    assert LessSelector(topk_blocks=8, scores="features").triton_problems() is None  # no kernel for feature scores
