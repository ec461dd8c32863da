"""backend=triton through the same PRR step as the torch reference (CPU under
TRITON_INTERPRET=1, fp32): identical selections, outputs within fp32 tolerance."""

import pytest
import torch

from prr.budget.fixed import FixedBudget
from prr.cache import PagedKVCache
from prr.predictors import EmaPredictor, LastStepPredictor
from prr.runtime.dsa_backend import DSABackend
from prr.runtime.engine_ops import triton_problems as problems
from prr.selectors import QuestSelector


def decode_outputs(ops, predictor, repair_mode, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    hkv, d, bs, prompt, steps = 2, 64, 16, 150, 4
    cache = PagedKVCache(2, 1, hkv, d, bs, prompt + steps)
    backend = DSABackend(cache, hkv * group, QuestSelector(topk_blocks=4, dense_layers=[0]), predictor,
                         FixedBudget(ratio=1.5), repair_mode=repair_mode, calibration_tokens=8, backend=ops)
    for layer in range(2):
        backend.prefill(layer, torch.randn(1, hkv * group, prompt, d, generator=g),
                        torch.randn(1, hkv, prompt, d, generator=g), torch.randn(1, hkv, prompt, d, generator=g))
    backend.finish_prefill()
    outs = []
    for _ in range(steps):
        for layer in range(2):
            outs.append(backend.decode(layer, torch.randn(1, hkv * group, d, generator=g),
                                       torch.randn(1, hkv, d, generator=g), torch.randn(1, hkv, d, generator=g)))
        backend.end_step()
    return torch.stack(outs)


@pytest.mark.parametrize("repair_mode", ["exact", "superset"])
@pytest.mark.parametrize("group", [1, 4])
def test_triton_backend_matches_torch_reference(repair_mode, group):
    ref = decode_outputs("torch", LastStepPredictor(), repair_mode, group)
    got = decode_outputs("triton", LastStepPredictor(), repair_mode, group)
    assert ((got - ref).norm() / ref.norm()) < 1e-5


def test_triton_backend_with_ema_predictor():
    ref = decode_outputs("torch", EmaPredictor(), "exact", 3, seed=1)
    got = decode_outputs("triton", EmaPredictor(), "exact", 3, seed=1)
    assert ((got - ref).norm() / ref.norm()) < 1e-5


def test_triton_backend_reports_what_it_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reasons = problems("cpu", 96, 8)
    assert any("CUDA device" in r for r in reasons)
    assert any("head_dim" in r and "96" in r for r in reasons)
    assert any("block_size >= 16" in r for r in reasons)


def test_triton_head_dims_are_the_kernels_own():
    """One source of truth for the head dims backend=triton takes: the attention kernels' list
    (config checks and the graph engine's read it; head_dim 256 runs the engine, tested equal
    to the torch ops)."""
    from prr.kernels.sparse_decode import SUPPORTED_HEAD_DIMS

    assert SUPPORTED_HEAD_DIMS == (64, 128, 256)
    for d in SUPPORTED_HEAD_DIMS:
        assert not any("head_dim" in r for r in problems("cuda", d, 16))
    assert any(str(list(SUPPORTED_HEAD_DIMS)) in r for r in problems("cuda", 96, 16))


def decode_with_selector_backend(backend, gqa_reduce="max", seed=2):
    g = torch.Generator().manual_seed(seed)
    hkv, group, d, bs, prompt, steps = 2, 3, 64, 16, 170, 20  # crosses a block boundary while decoding
    sel = QuestSelector(topk_blocks=4, local_blocks=1, gqa_reduce=gqa_reduce)
    assert sel.set_backend(backend) == backend
    cache = PagedKVCache(1, 1, hkv, d, bs, prompt + steps)
    dsa = DSABackend(cache, hkv * group, sel, LastStepPredictor(), FixedBudget(), calibration_tokens=8,
                     backend=backend)
    dsa.prefill(0, torch.randn(1, hkv * group, prompt, d, generator=g), torch.randn(1, hkv, prompt, d, generator=g),
                torch.randn(1, hkv, prompt, d, generator=g))
    dsa.finish_prefill()
    masks = []
    for _ in range(steps):
        dsa.decode(0, torch.randn(1, hkv * group, d, generator=g) * 2, torch.randn(1, hkv, d, generator=g) * 2,
                   torch.randn(1, hkv, d, generator=g))
        masks += [r.selected for r in dsa.end_step()[0]]
    return torch.stack(masks), cache.metadata[0]


@pytest.mark.parametrize("gqa_reduce", ["max", pytest.param("sum", marks=pytest.mark.slow)])
def test_triton_quest_selection_and_metadata_equal_torch(gqa_reduce):
    torch_masks, torch_meta = decode_with_selector_backend("torch", gqa_reduce)
    triton_masks, triton_meta = decode_with_selector_backend("triton", gqa_reduce)
    assert torch.equal(torch_masks, triton_masks)
    for name in torch_meta:
        assert torch.equal(torch_meta[name], triton_meta[name]), name


def test_union_reduction_has_no_triton_quest_path():
    sel = QuestSelector(topk_blocks=4, gqa_reduce="union")
    assert sel.triton_problems() and sel.set_backend("triton") == "torch"
