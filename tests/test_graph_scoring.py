"""Scored requests on the graph engine (`runtime.engine=graph`, prr/runtime/graph_pipeline.py)
equal the research runtime's (`runtime.engine=eager`) on a tiny random Llama in fp32: the same
generated tokens (EOS and stop strings cut alike, across windows of steps), log-likelihoods of
given continuations within 1e-5, one engine reused across requests of different lengths; exact
PRR (quest + ema) generates serial DSA's tokens; what the graph engine cannot score is refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from prr.config_check import ConfigError, compose_config
from prr.evaluation import Engine
from prr.model.loading import load_model

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny-random", "logger=none", "task=ruler_niah", "selector=quest", "selector.dense_layers=[0]",
        "selector.topk_blocks=6", "runtime.block_size=16"]
PROMPTS = (300, 170)  # tokens: two requests through one engine (the second shorter: state reset in place)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-random", dtype="float32", device="cpu")


def engines(model, *overrides):
    """(eager, graph) Engines of one config, sized for the longest request here."""
    return tuple(Engine(compose_config([*TINY, *overrides, f"runtime.engine={e}"]), model, 340)
                 for e in ("eager", "graph"))


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(seed))


def requests(engine: Engine) -> list:
    """Two generations past a window of 16 steps, and two scored continuations, per prompt."""
    out = []
    for i, n in enumerate(PROMPTS):
        prompt = ids(n, i)
        gen = engine.generate(prompt, 20)
        out.append(("generate", gen.token_ids, gen.margins))
        cont = ids(9, 10 + i)[0].tolist()
        out.append(("score",) + engine.score(prompt, cont))
        out.append(("score greedy",) + engine.score(prompt, gen.token_ids[:7]))  # its own greedy tokens: True
    return out


def assert_same(eager: list, graph: list) -> None:
    for a, b in zip(eager, graph, strict=True):
        if a[0] == "generate":
            assert a[1] == b[1]  # identical tokens
            assert b[2] == pytest.approx(a[2], abs=1e-5)  # top-1 minus top-2 logits
        else:
            assert b[1] == pytest.approx(a[1], abs=1e-5) and b[2] == a[2]  # sum, greedy
            assert b[3] == pytest.approx(a[3], abs=1e-5)  # per-token log-probs


@pytest.mark.parametrize("predictor", ["none", "ema"])
def test_graph_scoring_equals_eager_scoring(model, predictor):
    """Serial DSA (none) and exact PRR (ema: P speculated, A \\ P repaired): generations and
    log-likelihoods equal the eager runtime's; PRR's tokens are serial DSA's, its hits counted."""
    eager, graph = engines(model, f"predictor={predictor}")
    got = requests(graph)
    assert_same(requests(eager), got)
    assert [r[2] for r in got if r[0] == "score greedy"] == [True, True]
    results = graph.results()
    assert results["engine"] == "graph" and results["last_step_overlap"] > 0
    if predictor == "ema":
        assert results["predicted_blocks"] == 6 and 0 < results["hit_rate"] <= 1
        serial = Engine(compose_config([*TINY, "predictor=none", "runtime.engine=graph"]), model, 340)
        assert [r[1] for r in requests(serial) if r[0] == "generate"] == [r[1] for r in got if r[0] == "generate"]


def test_graph_engine_stops_at_eos_and_stop_strings_as_the_eager_runtime(model):
    """EOS and a stop string inside a window of steps: the same tokens kept, the text cut alike;
    a kept dense prefill replays into the engine's cache; a one-token context is scored."""
    eager, graph = engines(model, "predictor=none")
    prompt = ids(300, 3)
    free = graph.generate(prompt, 20)
    assert free.token_ids == eager.generate(prompt, 20).token_ids and len(free.token_ids) == 20
    for engine in (eager, graph):
        engine.eos_ids = {free.token_ids[5]}
    first_eos = free.token_ids.index(free.token_ids[5])
    cut = [e.generate(prompt, 20).token_ids for e in (eager, graph)]
    assert cut[0] == cut[1] == free.token_ids[: first_eos + 1]
    for engine in (eager, graph):
        engine.eos_ids = set()
    stop = free.text[len(free.text) // 2 :][:2]
    stopped = [e.generate(prompt, 20, stop=(stop,)) for e in (eager, graph)]
    assert stopped[0] == stopped[1] and stopped[1].text == free.text[: free.text.index(stop)]
    replayed = graph.generate(prompt, 20, prefill=graph.prefill(prompt))
    assert replayed.token_ids == free.token_ids
    one = [e.score(prompt[:, :1], [5, 7, 11]) for e in (eager, graph)]
    assert one[1][0] == pytest.approx(one[0][0], abs=1e-5) and one[1][2] == pytest.approx(one[0][2], abs=1e-5)


def test_a_scored_run_on_the_graph_engine_scores_like_the_eager_runtime(tmp_path):
    """run.py task=ruler_niah runtime.engine=graph: the eager run's predictions and accuracy,
    tokens.jsonl per kept step, the engine's counters in the summary."""
    over = ["task.context_tokens=400", "task.num_samples=3", "task.max_new_tokens=6", "predictor=last_step"]
    summaries = {}
    for name, engine in (("eager", ["runtime.engine=eager"]), ("graph", ["runtime.engine=graph"]),
                         ("batched", ["runtime.engine=graph", "runtime.batch_size=2"])):  # (3 samples: 2 + 1 rows)
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[*TINY, *over, *engine])
        from prr.runner import run

        summaries[name] = run(cfg, tmp_path / name)
    eager = summaries["eager"]
    rows = {e: [json.loads(x) for x in (tmp_path / e / "records" / "samples.jsonl").read_text().splitlines()]
            for e in summaries}
    for name in ("graph", "batched"):
        graph = summaries[name]
        assert graph["accuracy"] == eager["accuracy"] and graph["engine"] == "graph" and 0 < graph["hit_rate"] <= 1
        assert [(r["sample"], r["prediction"]) for r in rows[name]] == [(r["sample"], r["prediction"])
                                                                         for r in rows["eager"]]
        tokens = [json.loads(x) for x in (tmp_path / name / "records" / "tokens.jsonl").read_text().splitlines()]
        assert graph["decode_steps"] == len(tokens) == eager["decode_steps"]
        assert {t["sample"] for t in tokens} == {0, 1, 2}


def test_what_the_graph_engine_cannot_score_is_refused(model):
    with pytest.raises(ConfigError, match="budget=adaptive switches variants"):
        compose_config([*TINY, "predictor=ema", "budget=adaptive", "runtime.engine=graph"])
    with pytest.raises(ConfigError, match="research runtime decodes scored tasks one request at a time"):
        compose_config([*TINY, "runtime.batch_size=2"])
    with pytest.raises(ConfigError, match="task=perplexity sends one request at a time"):
        compose_config([*TINY, "task=perplexity", "runtime.engine=graph", "runtime.batch_size=2"])
    graph = Engine(compose_config([*TINY, "predictor=none", "runtime.engine=graph"]), model, 340)
    graph.collect = True  # the studies' per-head rows: the eager runtime's records
    with pytest.raises(ValueError, match="runtime.engine=graph does not write; use runtime.engine=eager"):
        graph.generate(ids(300, 0), 3)


@pytest.mark.slow  # 14 s: make test-full (make test keeps the Engine-level equalities)
def test_prr_lm_eval_model_on_the_graph_engine_equals_the_eager_one():
    """prr-lm-eval's model (`--model prr --model_args runtime.engine=graph,...`): the same
    log-likelihoods, greedy flags and generations as on the research runtime."""
    from types import SimpleNamespace

    from prr.lm_eval_model import PRRLM

    args = {"selector": "quest", "predictor": "last_step", "selector.dense_layers": "[0]",
            "selector.topk_blocks": 4, "runtime.block_size": 16, "task.context_tokens": 200}
    lms = [PRRLM(model="tiny-random", **args, **{"runtime.engine": e, "runtime.batch_size": b})
           for e, b in (("eager", 1), ("graph", 1), ("graph", 2))]  # (the last: batches of 2 ragged requests)
    assert lms[1].engine.pipeline.label == "graph" and lms[2].engine.rows == 2
    context = "Sparse attention keeps the blocks that matter; the predictor guesses them early. " * 2
    requests = [SimpleNamespace(args=(context[:n], " The magic number is 1234567.")) for n in (160, 100, 130)]
    eager, *graph = [lm.loglikelihood(requests) for lm in lms]
    for got in graph:
        assert [g[0] for g in got] == pytest.approx([e[0] for e in eager], abs=1e-5)
        assert [g[1] for g in got] == [e[1] for e in eager]
    until = [SimpleNamespace(args=(context[:n], {"max_gen_toks": 20, "until": ["\n"]})) for n in (160, 90, 120)]
    eager_text = lms[0].generate_until(until)
    assert lms[1].generate_until(until) == eager_text == lms[2].generate_until(until)
    text = [SimpleNamespace(args=(context * 2,))]  # several windows of max_length, scored in batches
    assert lms[2].loglikelihood_rolling(text) == pytest.approx(lms[0].loglikelihood_rolling(text), abs=1e-4)


@pytest.mark.parametrize("predictor", ["none", "ema"])
def test_batches_of_ragged_requests_equal_one_request_at_a_time(model, predictor):
    """runtime.batch_size=2 on the graph engine: requests of different lengths share the
    engine's rows (each prefilled into its row; a short last batch padded), generations and
    log-likelihoods equal the eager runtime's, one request at a time."""
    eager = Engine(compose_config([*TINY, f"predictor={predictor}"]), model, 340)
    graph = Engine(compose_config([*TINY, f"predictor={predictor}", "runtime.engine=graph", "runtime.batch_size=2"]),
                   model, 340)
    prompts = [ids(n, i) for i, n in enumerate((300, 170, 240))]
    batched = graph.generate_batch(prompts, 20)
    assert [g.token_ids for g in batched] == [eager.generate(p, 20).token_ids for p in prompts]
    requests = [(prompts[0], ids(9, 10)[0].tolist()), (prompts[1], ids(4, 11)[0].tolist()),
                (prompts[2], batched[2].token_ids[:6])]
    if predictor == "none":  # (ema calibrates on a prefill tail a one-token context does not have)
        requests.insert(2, (prompts[2][:, :1], [5, 7, 11]))
    got, want = graph.score_batch(requests), [eager.score(*r) for r in requests]
    for (total, greedy, per_token), (total_e, greedy_e, per_token_e) in zip(got, want, strict=True):
        assert total == pytest.approx(total_e, abs=1e-5) and greedy == greedy_e
        assert per_token == pytest.approx(per_token_e, abs=1e-5)
    assert got[-1][1] is True  # its own greedy tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs CUDA and TRITON_INTERPRET=0")
@pytest.mark.parametrize("predictor", ["none", "ema"])
def test_batches_of_ragged_requests_in_cuda_graphs_equal_one_request_at_a_time(predictor):
    """The batched path on a GPU (Triton kernels, captured steps): runtime.batch_size=2 decodes
    and scores ragged requests as batch-1 graph engines do, in fp32."""
    gpu = load_model("tiny-random-d64", dtype="float32", device="cuda")  # (the Triton kernels' head dims)
    one, two = (Engine(compose_config(["model=tiny-random-d64", *TINY[1:], f"predictor={predictor}", "runtime.engine=graph", "runtime.device=cuda",
                                       f"runtime.batch_size={b}"]), gpu, 340) for b in (1, 2))
    prompts = [ids(n, i) for i, n in enumerate((300, 170, 240))]
    batched = two.generate_batch(prompts, 20)
    assert [g.token_ids for g in batched] == [one.generate(p, 20).token_ids for p in prompts]
    requests = [(prompts[0], ids(9, 10)[0].tolist()), (prompts[1], ids(4, 11)[0].tolist()),
                (prompts[2], batched[2].token_ids[:6])]
    for (total, greedy, per_token), (total_1, greedy_1, per_token_1) in zip(
            two.score_batch(requests), [one.score(*r) for r in requests], strict=True):
        assert total == pytest.approx(total_1, abs=1e-4) and greedy == greedy_1
        assert per_token == pytest.approx(per_token_1, abs=1e-4)
