"""The lightning indexer (selector=indexer, issue 52) from a kept dense prefill (prr.evaluation.Prefill,
replayed by the studies and by scored requests given one): the kept prefill keeps the normed hidden
states of the indexer's sparse layers only, and a replay into either pipeline makes the selections
(prefill tail and decode steps) and tokens of a straight prefill of the same tokens; a replay
without them is refused by name; a scored task with the indexer runs. Tiny random Llama, fp32."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

from prr.config_check import compose_config
from prr.evaluation import Engine, kept_prefill
from prr.model.loading import load_model
from prr.runner import run
from prr.runtime.eager_run import EagerRuntime
from prr.runtime.prr_step import PRRStep
from prr.selectors.indexer import IndexerSelector

INDEXER = ["model=tiny-random", "logger=none", "task=ruler_niah", "selector=indexer", "selector.dense_layers=[0]",
           "runtime.block_size=1", "selector.topk_tokens=24", "selector.sink_tokens=2", "selector.local_tokens=5",
           "selector.index_heads=16", "selector.index_dim=16", "selector.rope_dim=8", "predictor=ema"]
PROMPTS = (140, 97)  # tokens


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-random", dtype="float32", device="cpu")


@pytest.fixture
def selections(monkeypatch):
    """Every selection made, in order: the prefill tails' (per position) and the decode steps'
    (PRRStep.select), each as (layer, its tokens per row and KV head)."""
    made: list[tuple[int, list]] = []

    def members(layer, selection):
        blocks = selection.blocks
        made.append((layer, [[sorted(blocks.indices[b, h, : blocks.count[b, h]].tolist())
                              for h in range(blocks.count.shape[1])] for b in range(blocks.count.shape[0])]))

    tail, select = IndexerSelector.select_tail, PRRStep.select

    def recorded_tail(self, q_tail, cache, layer, start, queries=None):
        out = tail(self, q_tail, cache, layer, start, queries)
        for selection in out:
            members(layer, selection)
        return out

    def recorded_select(self, layer, *args, **kwargs):
        selection = select(self, layer, *args, **kwargs)
        members(layer, selection)
        return selection

    monkeypatch.setattr(IndexerSelector, "select_tail", recorded_tail)
    monkeypatch.setattr(PRRStep, "select", recorded_select)
    return made


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(seed))


def test_a_kept_prefill_keeps_the_hidden_states_of_the_indexers_sparse_layers_only(model):
    engine = Engine(compose_config(INDEXER), model, 200)
    prompt = ids(PROMPTS[0], 0)
    prefill = engine.prefill(prompt)
    assert sorted(prefill.hidden) == [1] and prefill.hidden[1].shape == (1, PROMPTS[0], model.config.hidden_size)
    assert kept_prefill(model, prompt, "cpu").hidden == {}  # (q/k/v only unless asked: a dense config's)
    quest = Engine(compose_config([*INDEXER[:3], "selector=quest", "runtime.block_size=16"]), model, 200)
    assert quest.prefill(prompt).hidden == {}


@pytest.mark.parametrize("engine_kind, rows", [("eager", 1), ("graph", 1), ("graph", 2)],
                         ids=["eager", "graph", "graph_ragged_rows"])
def test_a_replayed_prefill_makes_a_straight_prefills_selections(model, selections, engine_kind, rows):
    engine = Engine(compose_config([*INDEXER, f"runtime.engine={engine_kind}", f"runtime.batch_size={rows}"]),
                    model, 200)
    prompts = [ids(n, i) for i, n in enumerate(PROMPTS[:rows])]
    straight = engine.generate_batch(prompts, 9)
    straight_selections = list(selections)
    selections.clear()
    replayed = engine.generate_batch(prompts, 9, prefills=[engine.prefill(p) for p in prompts])
    assert [g.token_ids for g in replayed] == [g.token_ids for g in straight]
    assert [g.margins for g in replayed] == [g.margins for g in straight]
    assert selections == straight_selections and len(selections) > 9  # (tail and steps; layer 1 selects)


def test_a_replay_without_the_hidden_states_is_refused_by_name(model):
    cfg = compose_config(INDEXER)
    selector = instantiate(cfg.selector)
    selector.bind_model(model.config)
    runtime = EagerRuntime(model.decoder, instantiate(cfg.runtime), selector, instantiate(cfg.predictor),
                           instantiate(cfg.budget), "torch", 120, torch.float32, batch=1)
    with pytest.raises(ValueError, match=r"has none for layers \[1\]: keep them"):
        runtime.replay_prefill(kept_prefill(model, ids(PROMPTS[1], 1), "cpu"))  # (no hidden states kept)


@pytest.mark.parametrize("engine_kind", ["eager", "graph"])
def test_a_scored_task_runs_with_the_indexer(tmp_path, engine_kind):
    summary = run(compose_config([*INDEXER, "task.context_tokens=500", "task.num_samples=2", "task.max_new_tokens=4",
                                  f"runtime.engine={engine_kind}"]), tmp_path / "run")
    assert summary["status"] == "complete" and summary["num_samples"] == 2 and summary["decode_steps"] > 0
