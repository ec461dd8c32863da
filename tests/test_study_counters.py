"""The graph engine's study counters (StaticPlan.study_counters, StepObservers.study_counters)
equal the eager studies' values on the same trajectory (same prompt, teacher-forced tokens),
per layer and KV head, fp32: hits of the predictor's ranking at every |P| = ratio × K, |A|,
last-step overlap exactly; attention-mass recall and output error against dense attention on
the sampled steps within 1e-5. CPU: the engine's torch ops (and its Triton kernels under the
interpreter); -m gpu: captured CUDA graphs."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from hydra.utils import instantiate

from prr.config_check import compose_config
from prr.evaluation import Engine
from prr.metrics import layer_step_rows
from prr.run_inputs import DTYPES
from prr.runtime.eager_run import EagerRuntime
from prr.runtime.static_plan import StaticPlan
from prr.runtime.study_decode import graph_study_decode, layer_head_rows

ROOT = Path(__file__).resolve().parents[1]
GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (predictor_study's dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


ls = load("locality_study")
PROMPT, STEPS = 203, 7  # contexts of 13 blocks of 16 (14 from step 5): |P| = 2K = 12 fits at K = 6


def prefilled(device: str = "cpu", model_name: str = "tiny-random", extra: tuple[str, ...] = ()) -> tuple[Any, Any, list]:
    common = [f"model={model_name}", "logger=none", "predictor=ema", "budget=fixed", "budget.ratio=1.0",
              "runtime.mode=shadow", "runtime.calibration_tokens=12", "selector.dense_layers=[]",
              "task.prompt_tokens=256", f"runtime.device={device}", *extra]
    dense_cfg = compose_config(common + ["selector=dense", "predictor=none"])
    model = instantiate(dense_cfg.model).load("float32", device)
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    prefill = Engine(dense_cfg, model, PROMPT + 16).prefill(ids)
    return model, prefill, common


@pytest.fixture(scope="module")
def tiny():
    return prefilled()


def eager_sums(frame: pd.DataFrame) -> pd.DataFrame:
    """The eager study's rows (one per step, layer, KV head) summed per (layer, KV head)."""
    return frame.groupby(["layer", "kv_head"]).sum(numeric_only=True)


def assert_equal_counters(eager: pd.DataFrame, graph: pd.DataFrame, ratios: tuple[float, ...]) -> None:
    """eager: per (layer, KV head) sums of the eager rows; graph: the study counters' rows."""
    graph = graph.set_index(["layer", "kv_head"]).sort_index()
    eager = eager.sort_index()
    assert list(graph.index) == list(eager.index)
    for column in ("selected_blocks", "overlap_blocks", *(f"hits_x{r}" for r in ratios)):
        assert graph[column].tolist() == eager[column].tolist(), column  # exact counts
    assert (graph["steps"] == STEPS).all() and (graph["measured"] == eager["measured"]).all()
    for column in ("mass_recall", "output_relerr"):
        assert graph[column].to_numpy() == pytest.approx(eager[column].to_numpy(), abs=1e-5, rel=0), column


@pytest.mark.parametrize("variant", ["quest_max", "infllm"])
def test_the_locality_studys_counters_equal_on_the_graph_engine(tiny, variant):
    """locality_study.decode_variant, eager (RatioProbe, per-step records) against graph (study
    counters): every (layer, KV head)'s counts at every ratio, its overlap, mass recall and
    output error, and both pooled into the same table."""
    model, prefill, common = tiny
    cfg = compose_config(common + ls.variant_overrides(variant, 6, 16, []))
    rows, tokens, disagree, mismatch = ls.decode_variant(model, prefill, cfg, STEPS, None)
    assert (disagree, mismatch) == (0, 0)
    eager = pd.DataFrame(rows).assign(measured=1)
    g_rows, g_tokens, g_disagree, g_mismatch = ls.decode_variant(model, prefill, cfg, STEPS, tokens, engine="graph")
    assert g_tokens == tokens and (g_disagree, g_mismatch) == (0, 0)
    graph = pd.DataFrame(g_rows)
    assert_equal_counters(eager_sums(eager), graph, ls.RATIOS)
    assert eager_sums(eager)["hits_x2.0"].sum() > eager_sums(eager)["hits_x1.0"].sum()  # the ratios differ
    by_layer = [ls.pooled(f.assign(variant=variant), ["variant", "layer"]) for f in (eager, graph)]
    pd.testing.assert_frame_equal(by_layer[0], by_layer[1], atol=1e-6, rtol=0)  # the same table


def sparse_runtime(model, prefill, cfg, steps: int, every: int, ratios=None) -> EagerRuntime:
    """The research runtime in sparse mode, dense metrics every `every` steps, the kept prefill
    replayed and the predictor warmed (wrapped in a RatioProbe with `ratios`)."""
    settings = instantiate(cfg.runtime)
    selector = instantiate(cfg.selector)
    selector.bind_model(model.config)
    predictor = instantiate(cfg.predictor)
    if ratios is not None:
        predictor = ls.RatioProbe(predictor, ratios, selector.topk_blocks)
    runtime = EagerRuntime(model.decoder, settings, selector, predictor, instantiate(cfg.budget), "torch",
                           prefill.input_ids.shape[1] + steps, DTYPES[settings.dtype], batch=1, mode="sparse",
                           dense_metrics_every=every, check_serial=False)
    with torch.inference_mode():
        runtime.replay_prefill(prefill)
        runtime.finish_prefill()
    return runtime


def sparse_eager(model, prefill, cfg, steps: int, every: int, ratios) -> tuple[pd.DataFrame, list[int]]:
    """A sparse-mode eager greedy decode with a RatioProbe -> its rows (one per step, layer, KV
    head, with hits_x{r} and `measured`), its tokens."""
    runtime = sparse_runtime(model, prefill, cfg, steps, every, ratios)
    probe, prompt_len = runtime.backend.predictor, prefill.input_ids.shape[1]
    rows, tokens = [], []
    with torch.inference_mode():
        logits = prefill.last_logits
        for step in range(steps):
            tokens.append(int(logits[0].argmax()))
            logits, records, _, _ = runtime.step(torch.tensor(tokens[-1:]), prompt_len + step, step)
            for record in records:
                hits = probe.hits.pop(record.layer)  # [R, 1, Hkv]
                for row in layer_step_rows(record):
                    row.update({f"hits_x{r}": int(hits[i, 0, row["kv_head"]]) for i, r in enumerate(ratios)})
                    row["measured"] = int(step % every == 0)
                    row.setdefault("mass_recall", 0.0)
                    row.setdefault("output_relerr", 0.0)
                    rows.append(row)
    return pd.DataFrame(rows), tokens


# K = 14 is every block of the cache: the context holds 13 blocks for 5 steps, so at ratio 0.5 the
# budget is round(6.5) = 6 (half to even) below the static |P| = 7, and the proposal is truncated.
@pytest.mark.parametrize("predictor,ratios,topk", [("ema", (1.0, 1.25, 1.5, 2.0), 6), ("last_step", (0.5, 1.0, 1.5), 6),
                                                   ("ema", (0.5, 1.0), 14)])
def test_sampled_steps_and_other_ratios_in_sparse_mode(tiny, predictor, ratios, topk):
    """Sparse mode (the selection decides the output), dense metrics on every 3rd step, ratios below
    1 (the budget's rounding at the context's own size), another predictor: the same equality."""
    model, prefill, common = tiny
    cfg = compose_config([*common, "runtime.mode=sparse", f"predictor={predictor}", "selector=quest",
                          f"selector.topk_blocks={topk}", "runtime.dense_metrics_every=3"])
    eager, tokens = sparse_eager(model, prefill, cfg, STEPS, 3, ratios)
    runtime = sparse_runtime(model, prefill, cfg, STEPS, 3)
    run = graph_study_decode(runtime, prefill.last_logits, STEPS, ratios, tokens)
    assert run.tokens == tokens and run.disagreements == 0 and run.plan.mode == "sparse"
    rows = layer_head_rows(run.counters, list(range(model.config.num_layers)))
    graph = pd.DataFrame([{ls.GRAPH_COLUMNS.get(k, k): v for k, v in row.items()} for row in rows])
    assert (graph["measured"] == 3).all()  # steps 0, 3, 6
    assert_equal_counters(eager_sums(eager), graph, ratios)
    if topk == 14:  # |P| at ratio 0.5: 6 blocks over 5 steps, then round(7) = 7 over 2, per (layer, KV head)
        assert (graph["predicted_x0.5"] == 5 * 6 + 2 * 7).all()


def test_a_budget_the_engine_cannot_hold_static_is_refused(tiny):
    model, prefill, common = tiny
    cfg = compose_config([*common, "runtime.mode=sparse", "selector=quest", "selector.topk_blocks=6", "budget=adaptive"])
    with pytest.raises(ValueError, match="fixed budget"):
        graph_study_decode(sparse_runtime(model, prefill, cfg, 2, 1), prefill.last_logits, 2, (1.0,))


# torch ops; the Triton kernels (ema_membership's propose among them) under the interpreter take 16 s
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_study_counters_change_nothing_the_step_does(backend):
    """Two engines over the same random context (3 layers, 2 sparse, batch 2), study counters off
    and on: bit-equal logits and step counters, the study buffer untouched when off; per (layer,
    row, KV head) the ranking at round(1.25 × 6) = 8 blocks hits what the engine's own P of 8
    blocks hits (on triton: the ema_membership kernel's set)."""
    from prr.model.decoder import Decoder
    from prr.runtime.graph_decode import GraphDecoder
    from tests.helpers import graph_predictor, graph_selector
    from tests.test_graph_decode import CONFIG, decode

    logits, engines = {}, {}
    for on in (False, True):
        plan = StaticPlan(variant="prr", predicted_blocks=8, count_hits=True, study_counters=on)
        model = Decoder(CONFIG, torch.float32, "cpu").init_random_(seed=3, std=0.05)
        engine = engines[on] = GraphDecoder(model, plan, batch=2, max_tokens=243, backend=backend,
                                            selector=graph_selector("quest", 6, dense_layers=(0,)),
                                            predictor=graph_predictor("ema_membership"))
        engine.fill_random_context(203, seed=5)
        engine.prime_predictions(203)  # the first step's P, as a run's
        logits[on] = decode(engine, 4)
    for a, b in zip(logits[False], logits[True], strict=True):
        assert torch.equal(a, b)
    assert engines[False].counters() == engines[True].counters()
    assert not engines[False].attn.observers.study.counts.any()
    study = engines[True].study_counters(per_row=True)  # [L, B, Hkv] each
    assert study["hits_x1.25"].shape == (3, 2, 2) and torch.equal(study["hits_x1.25"], study["hits"])
    assert torch.equal(study["predicted_x1.25"], study["predicted"]) and study["hits"][1:].sum() > 0
    assert not study["steps"][0].any() and (study["steps"][1:] == 4).all()  # layer 0 dense
    with pytest.raises(ValueError, match="study_counters=True needs count_hits=True"):
        engines[True].with_plan(count_hits=False)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
@pytest.mark.parametrize("variant", ["quest_max", "infllm"])
def test_the_captured_engines_study_counters_equal_the_eager_studys_on_a_gpu(variant):
    """The same equality on a GPU, fp32: the engine's steps are CUDA-graph replays (speculation and
    the study counters on the side stream); both runtimes on the Triton kernels (backend=triton:
    Quest's scores from the same kernel), so near-ties fall alike."""
    check_on_the_kernels("cuda", variant)


@pytest.mark.slow  # 30 s under the interpreter: make test-full
def test_the_study_counters_equal_the_eager_studys_on_the_kernels():
    """The GPU test's case on the CPU, both runtimes on the Triton kernels under the interpreter
    (uncaptured, one stream): Quest's selection kernel, the ema kernels' P beside the study's torch
    ranking, the attention kernels' mass recall and output error."""
    check_on_the_kernels("cpu", "quest_max")


def check_on_the_kernels(device: str, variant: str) -> None:
    model, prefill, common = prefilled(device, "tiny-random-d64", ("backend=triton",))
    cfg = compose_config(common + ls.variant_overrides(variant, 6, 16, []))
    rows, tokens, disagree, mismatch = ls.decode_variant(model, prefill, cfg, STEPS, None)
    assert (disagree, mismatch) == (0, 0)
    g_rows, g_tokens, g_disagree, g_mismatch = ls.decode_variant(model, prefill, cfg, STEPS, tokens, engine="graph")
    assert g_tokens == tokens and (g_disagree, g_mismatch) == (0, 0)
    assert_equal_counters(eager_sums(pd.DataFrame(rows).assign(measured=1)), pd.DataFrame(g_rows), ls.RATIOS)


def test_the_predictor_studys_hits_equal_on_the_graph_engine():
    """predictor_study.py: the host replay of every predictor over the eager trace against one
    graph-engine decode per predictor with the study counters, on the same prompt and trajectory:
    per (predictor, ratio, layer) hits, |A| and |P| exactly (SPIN's exploration and
    query_similarity's query included: |P| = round(ratio × K) fits the context)."""
    ps = load("predictor_study")
    overrides = ["model=tiny-random", "runtime.device=cpu", "runtime.dtype=float32", "runtime.engine=eager",
                 "task.prompt_tokens=203", "selector.topk_blocks=4", "selector.dense_layers=[]",
                 "runtime.calibration_tokens=12"]
    # (last_step and ema: above; these three rank from more than their own layer's past selections)
    names, ratios, steps = ["spin", "query_similarity", "cross_layer_ema"], [1.0, 1.5], 5
    trace, info = ps.capture("long_text", steps, overrides)
    frames, _, graph_info = ps.graph_capture("long_text", steps, overrides, 0, names, ratios)
    assert graph_info["engine_checks"].keys() == set(names)  # each engine's own |P| = K hits = its study x1.0
    assert graph_info["prompt_tokens"] == info["prompt_tokens"]
    columns = ["layer", "hits", "selected", "predicted"]
    for name in names:
        node = compose_config(ps.PREDICTORS[name], check=False).predictor
        for ratio in ratios:
            predictor = instantiate(node)
            with torch.inference_mode():
                replayed, _ = ps.replay(trace, predictor, ratio, info["topk_blocks"])
            want = replayed.groupby("layer", as_index=False)[columns[1:]].sum()
            got = frames[name, ratio][columns]
            assert got.to_dict("list") == want.to_dict("list"), (name, ratio)
            assert frames[name, ratio]["heads"].tolist() == [steps * 2] * 2  # 5 steps × 2 KV heads per layer
