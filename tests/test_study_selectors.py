"""The studies' token-budget-matched selectors (prr.selectors.study_overrides): the accuracy
study builds `indexer` and `infllm_v2` at the tokens Quest gets, refuses the indexer without
trained weights, and the locality study measures an indexer variant from a kept prefill that
kept its hidden states (tiny random model, CPU)."""


import pandas as pd
import pytest
import torch
from hydra.utils import instantiate

from prr.config_check import compose_config
from prr.evaluation import Engine, hidden_layers
from prr.selectors.indexer_weights import IndexerConfig, IndexerWeights, indexer_weights_file
from prr.selectors.study_overrides import budget_overrides, indexer_weight_overrides
from tests.helpers import load_experiment

acc, ls = load_experiment("accuracy_study"), load_experiment("locality_study")


def attended_tokens(cfg) -> int:
    """The tokens a config's selector attends: its top-K (in its key) times the runtime's block size."""
    selector = instantiate(cfg.selector)
    return getattr(selector, selector.topk_option) * cfg.runtime.block_size


def test_budget_overrides_give_every_selector_the_same_tokens_and_refuse_a_budget_its_unit_splits():
    assert budget_overrides("quest", 256, 16) == ["selector=quest", "runtime.block_size=16", "selector.topk_blocks=16"]
    assert budget_overrides("indexer", 256, 16) == ["selector=indexer", "runtime.block_size=1",
                                                    "selector.topk_tokens=256"]
    assert budget_overrides("infllm_v2", 256, 16) == ["selector=infllm_v2", "runtime.block_size=64",
                                                      "selector.topk_blocks=4"]
    with pytest.raises(ValueError, match="96 tokens is not a positive multiple of selector=infllm_v2's 64-token"):
        budget_overrides("infllm_v2", 96, 16)


def test_accuracy_study_builds_indexer_and_infllm_v2_at_quests_token_budget(tmp_path):
    args = acc.parse_args(["--model", "tiny-random", "--tasks", "ruler_niah", "--contexts", "1000", "--budgets", "192",
                           "--ema-budgets", "192", "--selectors", "quest,indexer,infllm_v2", "--dense-layers", "0",
                           "--indexer-weights", "random", "--out", str(tmp_path / "acc")])
    runs = acc.study_runs(args)
    common = acc.common_overrides(args) + ["task=ruler_niah"]
    tokens = {}
    for name, sel, pred, *_, over in runs[1:]:
        cfg = compose_config(common + over)
        assert cfg.selector._target_.split(".")[-2] == sel and cfg.predictor._target_.split(".")[-2] == pred
        assert list(cfg.selector.dense_layers) == [0]  # --dense-layers holds for every selector
        tokens[name] = attended_tokens(cfg)
    assert tokens == {f"{s}-{p}-192": 192 for s in ("quest", "indexer", "infllm_v2") for p in ("none", "ema")}
    indexer = next(over for name, *_, over in runs if name == "indexer-none-192")
    assert compose_config(common + indexer).selector.weights == "random"
    with pytest.raises(SystemExit, match="--budgets/--ema-budgets: a budget of 160 tokens"):
        acc.study_runs(acc.parse_args(["--model", "tiny-random", "--tasks", "ruler_niah", "--budgets", "160",
                                       "--selectors", "infllm_v2", "--out", str(tmp_path / "b")]))


def test_the_indexer_is_refused_without_trained_weights_and_finds_them_when_stored(tmp_path, monkeypatch):
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    argv = ["--model", "tiny-random", "--tasks", "ruler_niah", "--contexts", "1000", "--budgets", "128",
            "--selectors", "quest,indexer", "--out", str(tmp_path / "acc")]
    with pytest.raises(SystemExit) as refused:
        acc.main(argv)
    message = str(refused.value.code)
    assert "make train-indexer MODEL=tiny-random" in message and "\n" not in message
    assert not (tmp_path / "acc_samples.csv").exists()  # refused before any work
    # a stored indexer of the model (and another model's, not counted): its shape and dense layers are used
    mc = instantiate(compose_config(["model=tiny-random", "selector=dense", "task.prompt_tokens=256"]).model).load("float32", "cpu").config
    shape = IndexerConfig(index_heads=2, index_dim=8, rope_dim=4, dense_layers=(0,))
    IndexerWeights.for_model(mc, shape).save(indexer_weights_file("tiny-random", shape), {})
    IndexerWeights.for_model(mc, IndexerConfig(index_heads=3, index_dim=8, rope_dim=4)).save(
        indexer_weights_file("other-model", IndexerConfig(index_heads=3, index_dim=8, rope_dim=4)), {})
    assert indexer_weight_overrides("tiny-random", "trained") == [
        "selector.weights=trained", "selector.index_heads=2", "selector.index_dim=8", "selector.rope_dim=4",
        "selector.dense_layers=[0]"]
    runs = acc.study_runs(acc.parse_args(argv))
    indexer = compose_config(acc.common_overrides(acc.parse_args(argv)) + ["task=ruler_niah"] + runs[-1][-1]).selector
    assert (indexer.weights, indexer.index_heads, list(indexer.dense_layers)) == ("trained", 2, [0])


@pytest.fixture(scope="module")
def tiny_indexer():
    """The tiny model, a 331-token prompt and the study's common overrides with the indexer variant's
    (random weights) at K = 6 blocks of 16 = 96 tokens."""
    common = ["model=tiny-random", "logger=none", "predictor=ema", "budget=fixed", "budget.ratio=1.0",
              "runtime.mode=shadow", "runtime.calibration_tokens=12", "selector.dense_layers=[]",
              "task.prompt_tokens=512"]
    dense_cfg = compose_config(common + ["selector=dense", "predictor=none"])
    model = instantiate(dense_cfg.model).load("float32", "cpu")
    ids = torch.randint(0, model.config.vocab_size, (1, 331), generator=torch.Generator().manual_seed(5))
    return common, model, Engine(dense_cfg, model, 331 + 8), ids


def test_locality_indexer_variant_gives_overlap_and_hit_rates_from_a_prefill_that_kept_its_hidden_states(tiny_indexer):
    common, model, dense, ids = tiny_indexer
    cfg = compose_config(common + ls.variant_overrides("indexer", 6, 16, ["selector.weights=random"]))
    assert (cfg.runtime.block_size, cfg.selector.topk_tokens) == (1, 96)
    keep = hidden_layers(instantiate(cfg.selector), model.config.num_layers)
    assert keep == list(range(model.config.num_layers))  # every layer measured: the study's dense_layers=[]
    with pytest.raises(ValueError, match="normed hidden states"):
        ls.decode_variant(model, dense.prefill(ids), cfg, 3, None)  # the dense config's prefill keeps none
    rows, tokens, disagree, mismatch = ls.decode_variant(model, dense.prefill(ids, hidden=keep), cfg, 3, None)
    assert (disagree, mismatch) == (0, 0) and len(tokens) == 3
    frame = pd.DataFrame(rows).assign(task="t", sample=0, variant="indexer")
    assert len(frame) == 3 * model.config.num_layers * model.config.num_kv_heads
    assert (frame["selected_blocks"] == 96).all()  # tokens: the indexer's unit
    table = ls.over_prompts(frame, ["variant"]).iloc[0]
    assert 0 < table["last_step_overlap"] <= 1 and 0 < table["ema_hit_x1.0"] <= table["ema_hit_x2.0"] <= 1
    assert table["prompts"] == 1


def test_locality_infllm_v2_variant_runs_at_the_same_tokens_in_its_64_token_blocks(tiny_indexer):
    common, model, dense, ids = tiny_indexer
    cfg = compose_config(common + ls.variant_overrides("infllm_v2", 16, 16, []))
    assert (cfg.runtime.block_size, cfg.selector.topk_blocks) == (64, 4)
    rows, _, disagree, mismatch = ls.decode_variant(model, dense.prefill(ids), cfg, 3, None)
    frame = pd.DataFrame(rows)
    assert (disagree, mismatch) == (0, 0) and (frame["selected_blocks"] == 4).all()
    assert frame["overlap_blocks"].between(0, 4).all()
