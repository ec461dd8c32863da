"""LESS's trained feature map: training lowers its loss, the file round-trips, a missing
file is a clear error, and with every block selected LESS is still dense attention."""

import pytest
import torch

from prr.block_attention import attend_dense
from prr.model.loading import load_model
from prr.predictors import NoPredictor, OraclePredictor
from prr.selectors import LessSelector
from prr.selectors.less_training import (
    TrainedFeatureMap,
    capture,
    evaluate,
    feature_map_file,
    load_trained_map,
    text_windows,
    train,
)
from tests.test_selectors_infllm_less import run_step, structured_cache


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    return tmp_path


def trained_tiny(steps):
    torch.manual_seed(0)
    loaded = load_model("tiny-random")
    data = capture(loaded, text_windows(loaded, 2, 192, seed=0))
    mc = loaded.config
    fmap = TrainedFeatureMap(mc.num_layers, mc.head_dim, 16, hidden=16)
    before = evaluate(fmap, data, block_size=8, queries=32)
    train(fmap, data, steps, lr=2e-2, block_size=8, queries=16, progress=False)
    return fmap, before, evaluate(fmap, data, block_size=8, queries=32)


def test_training_lowers_its_loss():
    _, before, after = trained_tiny(steps=25)
    assert after["loss"] < before["loss"], (before, after)


def test_trained_map_round_trips_and_loads_into_the_selector(cache_root):
    fmap, _, _ = trained_tiny(steps=3)
    path = feature_map_file("tiny-random", 16)
    assert path.parent == cache_root / "less" and path.suffix == ".safetensors"
    fmap.save(path, {"model": "tiny-random"})
    assert not list(path.parent.glob("*.tmp"))  # atomic: no temp file left
    loaded = load_trained_map("tiny-random", 16)
    x = torch.randn(2, 3, 5, fmap.head_dim)
    for layer in range(len(fmap.layers)):
        for role in ("q", "k"):
            torch.testing.assert_close(loaded.logits(x, layer, role), fmap.logits(x, layer, role).detach())
    sel = LessSelector(topk_blocks=8, num_features=16, feature_map="trained", feature_map_model="tiny-random")
    assert sel.trained is not None and sel.trained.num_features == 16


def test_trained_without_a_file_is_a_clear_error(cache_root):
    with pytest.raises(FileNotFoundError, match="make train-less"):
        LessSelector(topk_blocks=8, num_features=16, feature_map="trained", feature_map_model="tiny-random")
    with pytest.raises(ValueError, match=r"feature_map='learned' is not one of \['random', 'trained'\]"):
        LessSelector(topk_blocks=8, feature_map="learned")


@pytest.mark.parametrize("group", [1, 3])
def test_less_trained_with_every_block_selected_is_dense(cache_root, group):
    torch.manual_seed(1)
    fmap = TrainedFeatureMap(1, 16, 16, hidden=8)
    for p in fmap.parameters():  # a non-trivial map (the MLPs start at zero)
        p.data.add_(0.1 * torch.randn_like(p))
    fmap.save(feature_map_file("toy", 16), {})
    sel = LessSelector(topk_blocks=64, num_features=16, feature_map="trained", feature_map_model="toy")
    cache, q = structured_cache(sel, 61, group, seed=group)
    comp = sel.compensation(q, cache, 0, sel.select(q, cache, 0))
    assert torch.all(comp.lse == float("-inf")) and torch.all(comp.out == 0)
    dense, _ = attend_dense(q, cache, 0, 61, 0.25)
    for predictor in (NoPredictor(), OraclePredictor()):
        result = run_step(sel, predictor, cache, q, budget_blocks=3)
        assert (result.state.out - dense.out).norm() / dense.out.norm() <= 1e-5
        assert torch.allclose(result.state.lse, dense.lse, atol=1e-5)
    # A partial selection does use the trained map: the compensation is finite somewhere.
    small = LessSelector(topk_blocks=3, num_features=16, feature_map="trained", feature_map_model="toy")
    cache, q = structured_cache(small, 61, group, seed=group)
    assert torch.isfinite(small.compensation(q, cache, 0, small.select(q, cache, 0)).lse).any()
