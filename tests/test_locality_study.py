"""experiments/locality_study.py's measuring parts on the tiny random model (CPU): the ratio
probe counts what the wrapped predictor would have proposed and changes nothing it does, and
every selector variant decodes the same dense trajectory. accuracy_study's --report rebuilds
a cut-short run's tables."""

import json

import numpy as np
import pandas as pd
import pytest
import torch
from hydra.utils import instantiate

from prr.blocks import BlockSet
from prr.config_check import compose_config
from prr.evaluation import Engine
from prr.predictors.ema import EmaPredictor
from prr.selectors.base import Selection
from tests.helpers import load_experiment

ls = load_experiment("locality_study")


def random_selection(gen: torch.Generator, batch: int, heads: int, max_blocks: int, nb: int, k: int) -> Selection:
    """A = the top min(k, nb) of random scores over nb blocks (capacity k, padded with 0)."""
    scores = torch.randn(batch, heads, max_blocks, generator=gen)
    scores[..., nb:] = float("-inf")
    kept = min(k, nb)
    idx = torch.zeros(batch, heads, k, dtype=torch.int32)
    idx[..., :kept] = scores.topk(kept, -1).indices.sort(-1).values.to(torch.int32)
    return Selection(BlockSet(idx, torch.full((batch, heads), kept, dtype=torch.int32)), scores)


def test_ratio_probe_counts_each_ratios_proposal_and_changes_nothing():
    gen = torch.Generator().manual_seed(7)
    heads, max_blocks, k, ratios = 3, 37, 5, (1.0, 1.4, 2.0)
    plain, inner = EmaPredictor(calibrate=False), EmaPredictor(calibrate=False)
    probe = ls.RatioProbe(inner, ratios, k)
    s_plain = plain.init_state(2, 1, heads, max_blocks, "cpu")
    s_probe = probe.init_state(2, 1, heads, max_blocks, "cpu")
    for nb in (3, 4, 6, 7, 9, 12, 20, 36):  # fewer blocks than K, fewer than 2K, many
        for layer in range(2):
            selection = random_selection(gen, 1, heads, max_blocks, nb, k)
            assert torch.equal(plain.propose(s_plain, layer, nb, k).indices, probe.propose(s_probe, layer, nb, k).indices)
            a = selection.blocks.mask(max_blocks)
            sizes = [min(round(r * min(k, nb)), nb) for r in ratios]  # a fixed budget's |P| in a run at ratio r
            want = [(a & plain.propose(s_plain, layer, nb, size).mask(max_blocks)).sum(-1) for size in sizes]
            probe.update(s_probe, layer, selection)
            plain.update(s_plain, layer, selection)
            assert torch.equal(probe.hits.pop(layer), torch.stack(want))
            assert torch.equal(s_plain.ema, s_probe.ema)
    probe.update(s_probe, 0, random_selection(gen, 1, heads, max_blocks, 30, k))  # no propose first: warm-up
    assert probe.hits == {}


def test_ratio_probe_refuses_what_it_cannot_count():
    from prr.predictors.query_similarity import QuerySimilarityPredictor

    with pytest.raises(ValueError, match="history-only"):
        ls.RatioProbe(QuerySimilarityPredictor(), (1.0,), 4)
    probe = ls.RatioProbe(EmaPredictor(calibrate=False), (1.0,), 4)
    state = probe.init_state(1, 2, 1, 16, "cpu")
    probe.propose(state, 0, 10, 4)
    with pytest.raises(ValueError, match="batch 1"):
        probe.update(state, 0, random_selection(torch.Generator().manual_seed(0), 2, 1, 16, 10, 4))


@pytest.fixture(scope="module")
def tiny():
    common = ["model=tiny-random", "logger=none", "predictor=ema", "budget=fixed", "budget.ratio=1.0",
              "runtime.mode=shadow", "runtime.calibration_tokens=12", "selector.dense_layers=[]",
              "task.prompt_tokens=256"]
    dense_cfg = compose_config(common + ["selector=dense", "predictor=none"])
    model = instantiate(dense_cfg.model).load("float32", "cpu")
    ids = torch.randint(0, model.config.vocab_size, (1, 203), generator=torch.Generator().manual_seed(3))
    prefill = Engine(dense_cfg, model, 203 + 16).prefill(ids)
    return common, model, prefill


def test_every_variant_decodes_the_same_dense_trajectory_and_its_probe_agrees(tiny):
    common, model, prefill = tiny
    mc, steps = model.config, 6
    dense = Engine(compose_config(common + ["selector=dense", "predictor=none"]), model, 203 + 16)
    greedy = dense.generate(prefill.input_ids, steps, prefill=prefill).token_ids  # the dense trajectory, decoded apart
    tokens = None
    for variant in ("quest_max", "infllm", "exact"):
        cfg = compose_config(common + ls.variant_overrides(variant, 6, 16, []))
        rows, followed, disagree, mismatch = ls.decode_variant(model, prefill, cfg, steps, tokens)
        tokens = tokens or followed
        assert (disagree, mismatch) == (0, 0) and followed == tokens and followed[:len(greedy)] == greedy
        frame = pd.DataFrame(rows)
        assert len(frame) == steps * mc.num_layers * mc.num_kv_heads
        table = ls.pooled(frame, ["layer"])
        assert table["last_step_overlap"].between(0, 1).all() and table["mass_recall"].between(0, 1).all()
        hits = [table[f"ema_hit_x{r}"] for r in ls.RATIOS]
        assert all((a <= b + 1e-12).all() for a, b in zip(hits, hits[1:], strict=False))  # a larger P hits more


@pytest.mark.parametrize("topk", [6, 12])  # 12 of 13-14 blocks: |P| = 2K is capped at the context
def test_each_ratios_hits_are_what_a_run_at_that_ratio_speculates(tiny, topk):
    common, model, prefill = tiny
    over = ls.variant_overrides("quest_max", topk, 16, [])
    rows, tokens, _, _ = ls.decode_variant(model, prefill, compose_config(common + over), 5, None)
    probed = pd.DataFrame(rows)
    for r in ls.RATIOS[1:]:
        run, *_ = ls.decode_variant(model, prefill, compose_config(common + over + [f"budget.ratio={r}"]), 5, tokens)
        run = pd.DataFrame(run)
        assert run["predicted_blocks"].max() > topk or r * topk < 13  # the ratio changed |P| (or the cap did)
        assert run["hits"].tolist() == probed[f"hits_x{r}"].tolist()


def test_accuracy_report_rebuilds_the_tables_of_a_cut_short_run(tmp_path):
    acc = load_experiment("accuracy_study")
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
    assert table.loc["dense", "accuracy_hi"] == 1.0 and 0.34 < table.loc["dense", "accuracy_lo"] < 0.35  # Wilson, 2/2


def test_rates_are_means_over_prompts_with_a_bootstrap_interval_over_prompts():
    """over_prompts: each prompt (task, sample) pooled over its rows first, then the mean over prompts
    and its interval; rows of one prompt never count as independent samples."""
    rng = np.random.default_rng(5)
    rows = []
    for task, sample, overlap in (("a", 0, 0.9), ("a", 1, 0.5), ("b", 0, 0.7)):
        for step in range(4 if sample else 9):  # prompts of different lengths: a pooled-over-rows mean would weigh them
            row = {"task": task, "sample": sample, "variant": "quest", "layer": step % 2, "selected_blocks": 10,
                   "overlap_blocks": round(10 * overlap), "mass_recall": overlap, "output_relerr": 1 - overlap}
            row.update({f"hits_x{r}": int(rng.integers(0, 11)) for r in ls.RATIOS})
            rows.append(row)
    frame = pd.DataFrame(rows)
    table = ls.over_prompts(frame, ["variant"]).iloc[0]
    assert table["prompts"] == 3 and table["rows"] == len(frame)
    assert table["last_step_overlap"] == pytest.approx((0.9 + 0.5 + 0.7) / 3)
    assert 0.5 <= table["last_step_overlap_lo"] < table["last_step_overlap"] < table["last_step_overlap_hi"] <= 0.9
    by_task = ls.over_prompts(frame, ["task"]).set_index("task")
    assert by_task.loc["b", "prompts"] == 1  # one prompt: its interval is the value itself, and n says so
    assert by_task.loc["b", "last_step_overlap_lo"] == by_task.loc["b", "last_step_overlap_hi"] == pytest.approx(0.7)
    assert list(by_task["prompts"]) == [2, 1]


def test_accuracy_study_resumes_its_results_store_and_never_overwrites_it(tmp_path):
    """The samples file is the store: a second run with --resume keeps every finished
    (task, context, sample, config) row and runs only the missing ones; without --resume an
    existing store is refused (exit 2) before any work."""
    acc = load_experiment("accuracy_study")
    out = str(tmp_path / "acc")
    args = ["--model", "tiny-random", "--tasks", "ruler_niah", "--contexts", "1000", "--budgets", "128",
            "--ema-budgets", "", "--selectors", "quest", "--max-new-tokens", "3", "--out", out]
    acc.main([*args, "--samples", "1"])
    first = pd.read_csv(f"{out}_samples.csv")
    with pytest.raises(SystemExit) as refused:
        acc.main([*args, "--samples", "2"])
    assert refused.value.code == 2
    acc.main([*args, "--samples", "2", "--resume"])
    store = pd.read_csv(f"{out}_samples.csv")
    assert sorted(zip(store["sample"], store["config"], strict=True)) == [
        (0, "dense"), (0, "quest-none-128"), (1, "dense"), (1, "quest-none-128")]
    kept = store[store["sample"] == 0].reset_index(drop=True)
    assert kept.drop(columns="command").equals(first.drop(columns="command"))  # the first run's rows, untouched
    assert store["command"].nunique() == 2  # each row names the run that made it
    assert json.loads((tmp_path / "acc.json").read_text())["finished_samples"] == {"ruler_niah 1000": 2}


def test_accuracy_study_decodes_a_batch_of_samples_as_it_decodes_each_alone(tmp_path):
    """--batch-size 2 (graph engine, one sample per row of the cache, ragged) gives every sample
    and config the tokens a batch-1 run gives; each row's hit rate is its own device counters'
    (a sample alone in its batch, beside a padding row, has batch 1's); the research runtime's
    batch > 1 is refused (exit 2)."""
    acc = load_experiment("accuracy_study")
    args = ["--model", "tiny-random", "--tasks", "ruler_niah", "--contexts", "700", "--budgets", "64",
            "--ema-budgets", "64", "--selectors", "quest", "--dense-layers", "0", "--max-new-tokens", "6",
            "--samples", "3", "--engine", "graph"]
    acc.main([*args, "--out", str(tmp_path / "one")])
    # sample 0 alone (beside a padding row), then resumed: the missing samples 1-2 form one full batch
    acc.main([*args[:-4], "--samples", "1", "--engine", "graph", "--batch-size", "2", "--out", str(tmp_path / "two")])
    acc.main([*args, "--batch-size", "2", "--resume", "--out", str(tmp_path / "two")])
    one, two = (pd.read_csv(tmp_path / f"{n}_samples.csv").set_index(["sample", "config"]).sort_index()
                for n in ("one", "two"))
    assert len(one) == 9 and one.index.equals(two.index)
    assert one["token_ids"].equals(two["token_ids"])
    prr = one["predictor"] == "ema"
    assert one.loc[prr, "hit_rate"].notna().all()  # (layer 1 is sparse: PRR speculated and was counted)
    assert two.loc[prr, "hit_rate"].notna().all()
    # sample 0 ran alone (its batch padded with a copy): its own counters, not the padding's. Samples 1
    # and 2 shared a batch, whose PRR is calibrated on both tails: their rates may differ from batch 1's.
    assert one.loc[(0, "quest-ema-64"), "hit_rate"] == two.loc[(0, "quest-ema-64"), "hit_rate"]
    assert one["includes_capture"].tolist() == [True] * 3 + [False] * 6  # each config's first batch builds it
    assert two["batch_rows"].tolist() == [1, 1, 1, 2, 2, 2, 2, 2, 2]  # sample 0 alone, then 1-2 together
    with pytest.raises(SystemExit) as refused:
        acc.main([*args[:-2], "--batch-size", "2", "--out", str(tmp_path / "eager")])
    assert refused.value.code == 2
