"""RULER-style generators: the answer is really in the haystack (at the requested depth),
a seed reproduces the data exactly, prompts fit the context, scoring is RULER's string
match; and scored runs through the runner and the Engine (accuracy in summary.json,
continuation log-probs equal to a dense forward, prefill replay identical to a prefill)."""

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from prr.model.dense import DenseAttention
from prr.model.loading import load_model
from prr.runner import run
from prr.tasks.niah import NeedleTask
from prr.tasks.perplexity import PerplexityTask
from prr.tasks.qa import ClozeQATask
from prr.tasks.samples import ByteTokenizer, count_tokens, string_match_all
from prr.tasks.variable_tracking import VariableTrackingTask
from prr.tasks.word_extraction import CommonWordsTask, FrequentWordsTask

ROOT = Path(__file__).resolve().parents[1]
TOK = ByteTokenizer()  # one token per byte: token counts are exact and fast


def context_of(prompt: str) -> str:
    """The haystack part of a NIAH prompt: between the header paragraph and the question."""
    return prompt.split("\n\n")[1]


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0])
def test_needle_is_in_the_haystack_at_the_requested_depth(depth):
    task = NeedleTask(context_tokens=6000, num_samples=2, depth=depth, seed=3)
    for sample in task.samples(TOK):
        (value,) = sample.answers
        key = sample.metadata["queried_keys"][0]
        needle = f"One of the special magic numbers for {key} is: {value}."
        context = context_of(sample.prompt)
        assert context.count(needle) == 1 and key in sample.prompt.split("\n\n")[-1]  # hidden once, asked for
        # Where it sits: the fraction of haystack text before it, within one sentence of the request.
        before = context.index(needle)
        haystack_chars = len(context) - len(needle) - 1
        sentences = [s for s in re.split(r"(?<=[.!?]) ", context) if s and s != needle]
        tolerance = max(len(s) + 1 for s in sentences) / haystack_chars
        assert abs(before / haystack_chars - depth) <= tolerance + 1e-9, (before / haystack_chars, depth, tolerance)


def test_depths_spread_over_samples_when_not_fixed():
    task = NeedleTask(context_tokens=3000, num_samples=5, seed=0)
    assert [s.metadata["depth"] for s in task.samples(TOK)] == [0.0, 0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("keys,values,queries", [(4, 1, 1), (1, 4, 1), (4, 1, 4), (3, 2, 2)])
def test_multi_needle_variants_hide_every_value_and_ask_only_the_queried_ones(keys, values, queries):
    task = NeedleTask(context_tokens=4000, num_samples=2, num_keys=keys, num_values=values, num_queries=queries, seed=1)
    for sample in task.samples(TOK):
        needles = sample.metadata["needles"]
        assert len(needles) == keys * values and all(context_of(sample.prompt).count(n) == 1 for n in needles)
        queried = sample.metadata["queried_keys"]
        assert len(queried) == queries and len(sample.answers) == queries * values
        expected = [re.search(r"is: (\d+)\.", n).group(1) for n, k in zip(needles, sample.metadata["needle_keys"], strict=True)
                    if k in queried]
        assert sorted(sample.answers) == sorted(expected)
        distractors = [re.search(r"is: (\d+)\.", n).group(1) for n, k in zip(needles, sample.metadata["needle_keys"], strict=True)
                       if k not in queried]
        assert not set(distractors) & set(sample.answers)


GENERATORS = [
    lambda seed, n=3: NeedleTask(context_tokens=3000, num_samples=n, num_keys=2, depth=0.3, seed=seed),
    lambda seed, n=3: NeedleTask(context_tokens=3000, num_samples=n, haystack="noise", depth=0.6, seed=seed),
    lambda seed, n=3: VariableTrackingTask(context_tokens=3000, num_samples=n, num_chains=2, seed=seed),
    lambda seed, n=3: CommonWordsTask(context_tokens=6000, num_samples=n, common_repeats=6, rare_repeats=2, num_common=5, seed=seed),
    lambda seed, n=3: FrequentWordsTask(context_tokens=3000, num_samples=n, seed=seed),
    lambda seed, n=3: ClozeQATask(context_tokens=12000, num_samples=n, depth=0.4, seed=seed),
]


@pytest.mark.parametrize("make", GENERATORS)
def test_a_seed_reproduces_the_data_exactly(make):
    first, again, other = make(7).samples(TOK), make(7).samples(TOK), make(8).samples(TOK)
    assert first == again
    assert [s.prompt for s in first] != [s.prompt for s in other]
    assert make(7, n=2).samples(TOK) == first[:2]  # at a fixed depth, a sample does not depend on how many are drawn


@pytest.mark.parametrize("make", GENERATORS)
def test_prompts_fill_but_do_not_exceed_the_context(make):
    task = make(0)
    for sample in task.samples(TOK):
        used = count_tokens(TOK, sample.prompt) + count_tokens(TOK, sample.gen_prefix)
        assert 0.85 * task.context_tokens <= used <= task.context_tokens, used


def test_variable_tracking_chain_is_in_order_and_complete():
    for sample in VariableTrackingTask(context_tokens=3000, num_samples=3, num_hops=5, seed=2).samples(TOK):
        chain, value = sample.metadata["chains"][0], sample.metadata["values"][0]
        assert list(sample.answers) == chain and len(chain) == 6
        positions = [sample.prompt.index(f"VAR {chain[0]} = {value}.")]
        positions += [sample.prompt.index(f"VAR {b} = VAR {a}.") for a, b in zip(chain, chain[1:], strict=False)]
        assert positions == sorted(positions) and str(value) in sample.prompt.split("\n\n")[-1]


def test_common_words_are_the_most_common():
    task = CommonWordsTask(context_tokens=6000, num_samples=2, num_common=5, common_repeats=6, rare_repeats=2, seed=4)
    for sample in task.samples(TOK):
        counts = Counter(re.findall(r"\d+\. ([\w-]+)", sample.prompt))
        assert all(counts[w] == 6 for w in sample.answers)
        assert max(c for w, c in counts.items() if w not in sample.answers) == 2


def test_frequent_words_are_the_top_three_of_the_text():
    for sample in FrequentWordsTask(context_tokens=3000, num_samples=2, seed=5).samples(TOK):
        counts = Counter(sample.prompt.split("\n\n")[1].split()[:-1])  # the coded text, without the "...."
        top = sorted(counts.values(), reverse=True)
        assert [counts[w] for w in sample.answers] == top[:3]


def test_qa_answer_ends_a_sentence_of_the_golden_document_at_its_depth():
    task = ClozeQATask(context_tokens=12000, num_samples=3, seed=6)
    for sample in task.samples(TOK):
        (answer,) = sample.answers
        docs = sample.prompt.split("\n\n")[2:-1]
        golden = docs[sample.metadata["golden_index"]]
        assert golden.startswith(f"Document [{sample.metadata['golden']}]")
        cloze = re.search(r'the sentence "(.*) \.\.\."\?', sample.prompt).group(1)
        assert f"{cloze} {answer}." in golden
        others = [len(d.encode()) + 2 for d in docs if d is not golden]
        share = sum(others[: sample.metadata["golden_index"]]) / sum(others)
        assert abs(share - sample.metadata["depth"]) <= max(others) / sum(others)


def test_string_match_all_gives_partial_credit_case_insensitively():
    assert string_match_all("The numbers are 123 and 456.", ("123", "456")) == 1.0
    assert string_match_all("only 123", ("123", "456")) == 0.5
    assert string_match_all("ANCIENT-badger", ("ancient-Badger",)) == 1.0
    assert string_match_all("nothing", ("123",)) == 0.0


def test_bad_options_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match=r"num_queries=3 exceeds task.num_keys=2"):
        NeedleTask(num_keys=2, num_queries=3)
    with pytest.raises(ValueError, match=r"task.depth=1.5"):
        NeedleTask(depth=1.5)
    with pytest.raises(ValueError, match=r"task.haystack='essays'"):
        NeedleTask(haystack="essays")
    with pytest.raises(ValueError, match="leaves no room for a haystack"):
        NeedleTask(context_tokens=100, num_samples=1).samples(TOK)


def test_perplexity_windows_are_seeded_slices_of_the_text():
    task = PerplexityTask(context_tokens=300, score_tokens=20, num_samples=3, seed=1)
    windows = task.windows(TOK)
    assert windows == PerplexityTask(context_tokens=300, score_tokens=20, num_samples=3, seed=1).windows(TOK)
    assert all(len(w) == 320 for w in windows)
    from prr.tasks.text_sources import python_reference_text

    source = python_reference_text().encode("utf-8")
    assert all(bytes(w) in source for w in windows) and len({tuple(w) for w in windows}) == 3


# --- the runtime side: Engine and runner ---------------------------------------------------
TINY = ["model=tiny-random", "logger=none", "selector.dense_layers=[]", "selector.topk_blocks=6",
        "runtime.block_size=16"]


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        base = [o for o in TINY if not ("selector=dense" in overrides and o.startswith("selector."))]
        return compose(config_name="config", overrides=[*base, *overrides])


def test_scored_run_reports_accuracy_as_the_mean_sample_score(tmp_path):
    cfg = compose_cfg("task=ruler_niah", "task.context_tokens=700", "task.num_samples=3", "task.max_new_tokens=6")
    summary = run(cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "records" / "samples.jsonl").read_text().splitlines()]
    assert summary["status"] == "complete" and summary["num_samples"] == 3 == len(rows)
    assert summary["accuracy"] == pytest.approx(sum(r["score"] for r in rows) / 3)
    assert all(r["score"] == string_match_all(r["prediction"], tuple(r["answers"])) for r in rows)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["accuracy"] == summary["accuracy"]
    steps = [json.loads(line) for line in (tmp_path / "run" / "records" / "steps.jsonl").read_text().splitlines()]
    assert {r["sample"] for r in steps} == {0, 1, 2} and summary["decode_steps"] > 0


def engine_for(*overrides):
    from prr.evaluation import Engine

    cfg = compose_cfg("task=ruler_niah", *overrides)
    model = load_model("tiny-random")
    return Engine(cfg, model, 600), model


def test_continuation_logprobs_through_sparse_decode_equal_a_dense_forward_for_the_dense_selector():
    engine, model = engine_for("selector=dense", "predictor=none")
    ids = torch.randint(0, 512, (1, 200), generator=torch.Generator().manual_seed(0))
    continuation = torch.randint(0, 512, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    total, greedy, per_token = engine.score(ids, continuation)
    full = torch.cat([ids, torch.tensor([continuation])], 1)
    with torch.inference_mode():
        logits = model.decoder(full, 0, DenseAttention(model.config.num_layers))[0].float()  # [T, V]
    ref = torch.log_softmax(logits[199:-1], -1).gather(1, torch.tensor(continuation)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(per_token), ref, atol=1e-4) and total == pytest.approx(float(ref.sum()), abs=1e-3)
    assert greedy == bool((logits[199:-1].argmax(-1) == torch.tensor(continuation)).all())


def test_prefill_replay_decodes_exactly_like_a_fresh_prefill():
    engine, _ = engine_for("selector=quest", "predictor=ema", "runtime.check_serial=true")
    engine.collect = True
    ids = torch.randint(0, 512, (1, 300), generator=torch.Generator().manual_seed(2))
    fresh = engine.generate(ids, 10)
    fresh_rows = engine.request_rows
    replayed = engine.generate(ids, 10, prefill=engine.prefill(ids))
    assert replayed.token_ids == fresh.token_ids and replayed.margins == fresh.margins
    strip = lambda rows: [{k: v for k, v in r.items() if k != "sample" and not k.startswith("t_")} for r in rows]  # noqa: E731
    assert strip(engine.request_rows) == strip(fresh_rows) and len(fresh_rows) > 0
