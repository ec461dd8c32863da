"""experiments/locality_study.py's measuring parts on the tiny random model (CPU): the ratio
probe counts what the wrapped predictor would have proposed and changes nothing it does, and
every selector variant decodes the same dense trajectory. accuracy_study's --report rebuilds
a cut-short run's tables."""

import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from hydra.utils import instantiate

from prr.blocks import BlockSet
from prr.evaluation import Engine
from prr.predictors.ema import EmaPredictor
from prr.selectors.base import Selection

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ls = load("locality_study")


def random_selection(gen: torch.Generator, batch: int, heads: int, max_blocks: int, nb: int, k: int) -> Selection:
    scores = torch.randn(batch, heads, max_blocks, generator=gen)
    scores[..., nb:] = float("-inf")
    idx = scores.topk(k, -1).indices.sort(-1).values.to(torch.int32)
    return Selection(BlockSet(idx, torch.full((batch, heads), k, dtype=torch.int32)), scores)


def test_ratio_probe_counts_each_ratios_proposal_and_changes_nothing():
    gen = torch.Generator().manual_seed(7)
    batch, heads, max_blocks, k = 2, 3, 37, 5
    plain, inner = EmaPredictor(calibrate=False), EmaPredictor(calibrate=False)
    probe = ls.RatioProbe(inner, (1.0, 1.4, 2.0), k)
    s_plain = plain.init_state(2, batch, heads, max_blocks, "cpu")
    s_probe = probe.init_state(2, batch, heads, max_blocks, "cpu")
    for step in range(9):
        nb = 20 + step
        for layer in range(2):
            selection = random_selection(gen, batch, heads, max_blocks, nb, k)
            p_plain = plain.propose(s_plain, layer, nb, k)
            p_probe = probe.propose(s_probe, layer, nb, k)
            assert torch.equal(p_plain.indices, p_probe.indices)
            a = selection.blocks.mask(max_blocks)
            want = [(a & plain.propose(s_plain, layer, nb, size).mask(max_blocks)).sum(-1) for size in (5, 7, 10)]
            probe.update(s_probe, layer, selection)
            plain.update(s_plain, layer, selection)
            assert torch.equal(probe.hits.pop(layer), torch.stack(want))  # |P| = round(r·K): 5, 7, 10
            assert torch.equal(s_plain.ema, s_probe.ema)
    probe.update(s_probe, 0, random_selection(gen, batch, heads, max_blocks, 30, k))  # no propose first: warm-up
    assert probe.hits == {}


@pytest.fixture(scope="module")
def tiny():
    common = ["model=tiny-random", "logger=none", "predictor=ema", "budget=fixed", "budget.ratio=1.0",
              "runtime.mode=shadow", "runtime.calibration_tokens=12", "selector.dense_layers=[]",
              "task.prompt_tokens=256"]
    dense_cfg = ls.config(common + ["selector=dense", "predictor=none"])
    model = instantiate(dense_cfg.model).load("float32", "cpu")
    ids = torch.randint(0, model.config.vocab_size, (1, 203), generator=torch.Generator().manual_seed(3))
    prefill = Engine(dense_cfg, model, 203 + 16).prefill(ids)
    return common, model, prefill


def test_every_variant_decodes_the_same_dense_trajectory_and_its_probe_agrees(tiny):
    common, model, prefill = tiny
    mc, steps = model.config, 6
    tokens = None
    for variant in ("quest_max", "infllm", "exact"):
        cfg = ls.config(common + ls.VARIANTS[variant] + ["selector.dense_layers=[]", "selector.topk_blocks=6"])
        rows, followed, disagree, mismatch = ls.decode_variant(model, prefill, cfg, steps, tokens, block_size=16)
        tokens = tokens or followed
        assert (disagree, mismatch) == (0, 0) and followed == tokens
        frame = pd.DataFrame(rows)
        assert len(frame) == steps * mc.num_layers * mc.num_kv_heads
        table = ls.pooled(frame, ["layer"])
        assert table["last_step_overlap"].between(0, 1).all() and table["mass_recall"].between(0, 1).all()
        hits = [table[f"ema_hit_x{r}"] for r in ls.RATIOS]
        assert all((a <= b + 1e-12).all() for a, b in zip(hits, hits[1:], strict=False))  # a larger P hits more


def test_accuracy_report_rebuilds_the_tables_of_a_cut_short_run(tmp_path):
    acc = load("accuracy_study")
    rows = []
    for sample in range(2):
        for config, selector, predictor, budget, tokens in (("dense", "dense", "none", None, [1, 2, 3]),
                                                              ("quest-none-32", "quest", "none", 32, [1, 2, 4]),
                                                              ("quest-ema-32", "quest", "ema", 32,
                                                               [1, 2, 4] if sample == 0 else [1, 5, 6])):
            rows.append({"task": "ruler:vt", "context_tokens": 4096, "sample": sample, "prompt_tokens": 4000,
                         "config": config, "selector": selector, "predictor": predictor, "budget_tokens": budget,
                         "score": float(tokens == [1, 2, 3]), "prediction": "", "token_ids": json.dumps(tokens),
                         "margins": json.dumps([0.5, 0.25, 0.125]), "max_serial_relerr": 0.0 if predictor == "ema" else None,
                         "hit_rate": 0.9 if predictor == "ema" else None, "decode_s": 1.0, "prefill_s": 0.1})
    samples = tmp_path / "cut_samples.csv"
    pd.DataFrame(rows).to_csv(samples, index=False)
    acc.main(["--report", str(samples), "--out", str(tmp_path / "acc")])
    record = json.loads((tmp_path / "acc.json").read_text())
    assert record["finished_samples"] == {"ruler:vt 4096": 2}
    assert record["prr_vs_serial"]["compared_samples"] == 2 and record["prr_vs_serial"]["token_identical_samples"] == 1
    (diff,) = record["prr_vs_serial"]["differences"]
    assert (diff["sample"], diff["first_divergent_step"], diff["serial_top2_margin_there"]) == (1, 1, 0.25)
    table = pd.read_csv(tmp_path / "acc.csv").set_index("selector")
    assert table.loc["dense", "accuracy"] == 1.0 and not (tmp_path / "acc_samples.csv").exists()
