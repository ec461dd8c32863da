"""Selection reuse (prr/reuse.py; issue 53) in scored tasks (prr.evaluation.Engine, both pipelines):
- a scored task makes exactly the layer selections its summary's `reuse` entry says, in the
  layers the reuse names (reuse=layers: the anchors only);
- a request decodes the tokens run.py's decode makes from the same prompt with the same reuse,
  and teacher-forcing those tokens scores them as greedy;
- reuse=none changes nothing (the pipeline without a reuse at all, bit for bit).
Tiny random Llama, fp32, 4 layers (layer 0 dense; reuse=layers anchors 1 and 3, layer 2 reuses)."""

from __future__ import annotations

import json

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import open_dict

from prr.config_check import compose_config
from prr.evaluation import Engine
from prr.model.loading import load_model
from prr.runner import run
from prr.runtime.prr_step import PRRStep

TINY = ["model=tiny-random", "++model.num_layers=4", "logger=none", "selector=quest", "selector.dense_layers=[0]",
        "selector.topk_blocks=6", "runtime.block_size=16"]
REUSES = {"layers": ["reuse=layers", "reuse.anchors=2"], "steps": ["reuse=steps", "reuse.every=3"]}
CASES = [("layers", "eager"), ("layers", "graph"), ("steps", "eager"), ("steps", "graph")]
SPARSE = [1, 2, 3]


@pytest.fixture
def selections(monkeypatch):
    """The sparse layers whose selection the step ran, one entry per selection (PRRStep.select:
    the decode steps' selections, both engines; the prefill tail selects through the selector)."""
    layers: list[int] = []
    select = PRRStep.select
    monkeypatch.setattr(PRRStep, "select", lambda self, layer, *a, **k: (layers.append(layer),
                                                                          select(self, layer, *a, **k))[1])
    return layers


@pytest.mark.parametrize("reuse, engine", CASES, ids=[f"{r}-{e}" for r, e in CASES])
def test_a_scored_task_makes_exactly_the_selections_its_reuse_says(tmp_path, selections, reuse, engine):
    cfg = compose_config([*TINY, "task=ruler_niah", "task.context_tokens=500", "task.num_samples=2",
                          "task.max_new_tokens=7", *REUSES[reuse], f"runtime.engine={engine}"])
    summary = run(cfg, tmp_path / "run")
    counts = summary["reuse"]
    assert counts["policy"] == reuse and counts["selections_made"] == len(selections) > 0
    if reuse == "layers":  # anchors 1 and 3 select at every step, layer 2 never
        assert set(selections) == {1, 3} and counts["selections_skipped"] * 2 == counts["selections_made"]
    else:  # each request's steps 0, 3, 6, ... (eager: every step run is recorded)
        tokens = [json.loads(line) for line in (tmp_path / "run" / "records" / "tokens.jsonl").read_text().splitlines()]
        steps = [sum(r["sample"] == s for r in tokens) for s in range(2)]
        made = sum(len(range(0, n, 3)) for n in steps) * len(SPARSE)
        assert counts["selections_made"] == made and counts["selections_skipped"] == sum(steps) * len(SPARSE) - made


@pytest.mark.parametrize("reuse, engine", CASES, ids=[f"{r}-{e}" for r, e in CASES])
def test_a_request_decodes_run_pys_tokens_under_the_same_reuse(tmp_path, reuse, engine):
    cfg = compose_config([*TINY, "task.prompt_tokens=150", "task.max_new_tokens=9", "task.stop_at_eos=false",
                          *REUSES[reuse], f"runtime.engine={engine}"])
    decoded = run(cfg, tmp_path / "run")
    model = instantiate(cfg.model).load("float32", "cpu")
    ids = instantiate(cfg.task).build(model.tokenizer, model.config.vocab_size, 1).input_ids  # run.py's prompt
    engine_ = Engine(cfg, model, ids.shape[1] + 9)
    generated = engine_.generate(ids, 9).token_ids
    assert generated == decoded["generated_token_ids"][0]  # the tokens each of run.py's 9 steps read
    assert engine_.score(ids, generated)[1]  # teacher-forced under the reuse: every token the greedy one


@pytest.mark.parametrize("engine", ["eager", "graph"])
def test_reuse_none_changes_nothing_in_scored_requests(engine):
    model = load_model("tiny-random", dtype="float32", device="cpu", num_layers=4)
    with_none = compose_config([*TINY, "task=ruler_niah", "reuse=none", f"runtime.engine={engine}"])
    without = with_none.copy()
    with open_dict(without):
        del without["reuse"]  # (no reuse group: the pipeline gets none at all)
    ids = torch.randint(0, 512, (1, 150), generator=torch.Generator().manual_seed(3))
    out = []
    for cfg in (with_none, without):
        engine_ = Engine(cfg, model, 170)
        gen = engine_.generate(ids, 6)
        out.append((gen.token_ids, gen.margins, engine_.score(ids, gen.token_ids[:5]), engine_.reuse_counts()))
    assert out[0][:3] == out[1][:3]
    assert out[0][3] == {"policy": "none", "selections_made": 3 * 5 + 3 * 4, "selections_skipped": 0}
    assert out[1][3] is None
