"""run.py through the CUDA-graph engine (runtime.engine=graph, prr/runtime/graph_run.py) on a
tiny random Llama with head_dim 64. CPU: the engine's kernels run under TRITON_INTERPRET=1
(conftest); the run's decode must equal the eager research runtime's, token for token."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

from prr.config_check import ConfigError
from prr.runner import run

ROOT = Path(__file__).resolve().parents[1]
GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
TINY = ["model=tiny-random-d64", "logger=none", "selector.dense_layers=[0]", "task.prompt_tokens=300",
        "task.max_new_tokens=6", "task.stop_at_eos=false", "selector.topk_blocks=6", "runtime.block_size=16"]


def run_tiny(tmp_path, *overrides, name="run"):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*TINY, *overrides])
    return run(cfg, tmp_path / name)


def test_graph_engine_decodes_like_the_eager_runtime(tmp_path):
    """Serial DSA and exact PRR (P = last step's A) on the engine give the eager runtime's
    serial-DSA tokens; PRR's hit rate is counted; the run directory has its files."""
    eager = run_tiny(tmp_path, "predictor=none", name="eager")
    serial = run_tiny(tmp_path, "predictor=none", "runtime.engine=graph", name="serial")
    prr = run_tiny(tmp_path, "predictor=last_step", "runtime.engine=graph", name="prr")
    assert serial["generated_token_ids"] == eager["generated_token_ids"]
    assert prr["generated_token_ids"] == eager["generated_token_ids"]
    assert serial["variant"] == "serial" and serial["hit_rate"] is None
    assert prr["variant"] == "prr" and prr["predicted_blocks"] == 6 and 0 < prr["hit_rate"] <= 1
    assert prr["decode_steps"] == 6 and prr["token_latency_median_ms"] > 0
    run_dir = tmp_path / "prr"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["command"].startswith("python ") and summary["torch"]
    layers = pd.read_csv(run_dir / "layers.csv")
    assert layers["layer"].tolist() == [1] and 0 < layers["hit_rate"].iloc[0] <= 1  # layer 0 is dense
    assert layers["command"].str.startswith("python ").all()
    assert len((run_dir / "records" / "tokens.jsonl").read_text().splitlines()) == 6


@pytest.mark.parametrize("predictor", ["last_step", "ema_membership"])
def test_graph_engine_proposes_what_the_eager_runtime_proposes(tmp_path, predictor):
    """Same predictor, same warm-up on the prefill tail: the engine's hit rate equals the eager
    runtime's (the P sets agree step by step), and the tokens equal serial DSA's."""
    extra = ["budget.ratio=1.5"] if predictor == "ema_membership" else []
    eager = run_tiny(tmp_path, f"predictor={predictor}", *extra, name="eager")
    graph = run_tiny(tmp_path, f"predictor={predictor}", *extra, "runtime.engine=graph", name="graph")
    assert graph["generated_token_ids"] == eager["generated_token_ids"]
    assert graph["predicted_blocks"] == (9 if extra else 6)
    assert graph["hit_rate"] == pytest.approx(eager["hit_rate"], abs=1e-12) and 0 < graph["hit_rate"] < 1


@pytest.mark.parametrize("predictor", ["last_step", "ema_membership"])
def test_graph_engine_adaptive_switches_between_serial_and_prr(tmp_path, predictor):
    """budget=adaptive: both variants run over one cache (each measured, then the faster), the
    tokens stay serial DSA's, and the hit rate counts PRR's steps only."""
    eager = run_tiny(tmp_path, "predictor=none", name="eager")
    graph = run_tiny(tmp_path, f"predictor={predictor}", "budget=adaptive", "budget.min_hit=0",
                     "budget.window_steps=1", "runtime.engine=graph", name="graph")
    assert graph["generated_token_ids"] == eager["generated_token_ids"]
    setup = graph["budget_setup"]
    assert graph["variant"] == "adaptive"
    assert setup["policy"] == "AdaptiveBudget" and setup["steps_prr"] + setup["steps_serial"] == 6
    assert [w["variant"] for w in setup["windows"]][:2] == ["serial", "prr"] and setup["steps_prr"] >= 1
    steps = [json.loads(line) for line in (tmp_path / "graph" / "records" / "tokens.jsonl").read_text().splitlines()]
    assert [s["variant"] for s in steps] == [w["variant"] for w in setup["windows"]]  # one step per window
    assert 0 < graph["hit_rate"] <= 1


def test_eos_stop_after_every_row_read_one():
    """A decode stops after the first step by which every row has read an EOS."""
    from prr.eos import steps_until_eos

    inputs = torch.tensor([[1, 5, 2, 5], [3, 3, 5, 1]])
    assert steps_until_eos(inputs, torch.tensor([5])) == 3
    assert steps_until_eos(inputs, torch.tensor([9])) is None
    assert steps_until_eos(inputs[:, :2], torch.tensor([5])) is None
    assert steps_until_eos(inputs, torch.tensor([], dtype=torch.long)) is None


def test_ema_membership_predictor_state_is_the_membership_average():
    """s <- alpha s + (1 - alpha) [b in A]: after A1 = {0, 2}, A2 = {2, 3} with alpha 0.5 the
    state is (0.25, 0, 0.75, 0.5), so P of size 2 is {2, 3} and of size 3 adds block 0."""
    from prr.blocks import BlockSet
    from prr.predictors.ema_membership import EmaMembershipPredictor
    from prr.selectors.base import Selection

    pred = EmaMembershipPredictor(alpha=0.5)
    state = pred.init_state(1, 1, 1, 5, "cpu")
    for ids in ([0, 2], [2, 3]):
        blocks = BlockSet(torch.tensor([[ids]]), torch.tensor([[2]]))
        pred.update(state, 0, Selection(blocks=blocks, scores=torch.zeros(1, 1, 5)))
    assert state[0, 0, 0].tolist() == [0.25, 0.0, 0.75, 0.5, 0.0]
    assert pred.propose(state, 0, 5, 2).indices.sort(-1).values.tolist() == [[[2, 3]]]
    assert sorted(pred.propose(state, 0, 5, 3).indices[0, 0].tolist()) == [0, 2, 3]
    assert pred.rank(state, 0, 3)[0, 0, 3] == float("-inf")  # outside the next step's context
    with pytest.raises(ValueError, match="alpha=1.0"):
        EmaMembershipPredictor(alpha=1.0)


@pytest.mark.parametrize("overrides,match", [
    (["predictor=ema_membership", "budget.ratio=0"], "needs |P| >= 1"),
    (["predictor=none", "task.temperature=0.7"], "greedily"),
    (["predictor=none", "model=tiny-random", "backend=triton"], "head_dim=16"),  # (torch ops take any)
    (["predictor=ema_membership", "budget.ratio=4"], "exceeds the prompt"),
    (["predictor=none", "budget=adaptive"], "needs a predictor"),
])
def test_graph_engine_refuses_what_it_cannot_run(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        run_tiny(tmp_path, "runtime.engine=graph", *overrides)
    assert not (tmp_path / "run").exists()  # refused before any work


def test_the_engine_backend_follows_the_backend_group_on_a_gpu():
    from prr.runtime.graph_run import engine_backend

    assert engine_backend("cuda", "torch") == "torch"  # backend=torch: torch ops on a GPU too
    assert engine_backend("cuda:1", "torch", "triton") == "triton"  # backend=auto (the default): the kernels
    assert engine_backend("cpu", "torch", "triton") == "torch"
    assert engine_backend("cpu", "triton") == engine_backend("cuda", "triton") == "triton"


@pytest.mark.parametrize("backend,projections,refused", [
    ("torch", "auto", True), ("torch", "fused", True), ("torch", "torch", False), ("auto", "auto", False)])
def test_backend_torch_on_a_gpu_is_refused_where_the_engine_needs_triton(backend, projections, refused):
    """The checks before any work (graph_problems) on runtime.device=cuda, without a GPU:
    backend=torch runs the engine on torch ops, which lack the fused projections (runtime.projections=auto
    picks them on a GPU at batch 1)."""
    from types import SimpleNamespace

    from hydra.utils import instantiate

    from prr.runtime.graph_run import graph_problems

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*TINY, "predictor=none", "runtime.engine=graph",
                                                       f"backend={backend}", f"runtime.projections={projections}"])
    built = {g: instantiate(cfg[g]) for g in ("runtime", "selector", "predictor", "budget", "task", "backend")}
    built["runtime"].device = "cuda"
    problems = graph_problems(built, SimpleNamespace(head_dim=64))
    chosen = "fused" if projections == "fused" else "auto (fused on a GPU at batch 1)"
    assert [p for p in problems if "backend=torch runs torch ops" in p] == (
        [f"runtime.engine=graph with runtime.projections={chosen} runs Triton GEMVs, and backend=torch runs torch "
         "ops: use backend=auto or triton (CUDA, or the CPU under TRITON_INTERPRET=1) or runtime.projections=torch"]
        if refused else [])
    assert len(problems) == refused  # nothing else stands in the way


def test_a_ragged_batch_decodes_each_row_as_alone(tmp_path):
    """runtime.row_tokens: rows holding the prompt's last 300 (all of it) and 170 tokens decode
    in one batch what each decodes alone (exact PRR: serial DSA's tokens whatever P is), and a
    single row of the whole prompt decodes what the uniform run does, with the same hit rate."""
    common = ["predictor=ema", "runtime.engine=graph", "runtime.calibration_tokens=24"]
    both = run_tiny(tmp_path, *common, "runtime.batch_size=2", "runtime.row_tokens=[300,170]", name="both")
    alone = [run_tiny(tmp_path, *common, f"runtime.row_tokens=[{n}]", name=f"alone{n}") for n in (300, 170)]
    uniform = run_tiny(tmp_path, *common, name="uniform")
    assert both["generated_token_ids"] == [a["generated_token_ids"][0] for a in alone]
    assert both["generated_token_ids"][0] != both["generated_token_ids"][1]  # the rows' contexts differ
    assert both["row_tokens"] == [300, 170] and uniform["row_tokens"] == [300]
    assert alone[0]["generated_token_ids"] == uniform["generated_token_ids"]
    assert alone[0]["hit_rate"] == pytest.approx(uniform["hit_rate"], abs=1e-12)


@pytest.mark.parametrize("overrides,match", [
    (["runtime.engine=eager", "runtime.batch_size=2", "runtime.row_tokens=[300,100]"], "runtime.engine=graph only"),
    (["runtime.engine=graph", "runtime.batch_size=3", "runtime.row_tokens=[300,100]"], "one length per row"),
    (["runtime.engine=graph", "runtime.row_tokens=[20]"], "must exceed runtime.calibration_tokens"),
    (["runtime.engine=graph", "runtime.batch_size=2", "runtime.row_tokens=[400,100]"], "holds at most the prompt's task.prompt_tokens=300"),
])
def test_a_ragged_batch_refuses_bad_lengths(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        run_tiny(tmp_path, "predictor=none", *overrides)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
@pytest.mark.parametrize("budget", ["fixed", "profiled"])
def test_graph_engine_on_the_gpu_decodes_like_the_eager_runtime(tmp_path, budget):
    """On a GPU the engine captures one step in a CUDA graph and replays it per token (its
    warm-up steps are undone); fp32, so the tokens equal the eager runtime's serial DSA."""
    cuda = ["runtime=cuda", "runtime.dtype=float32", "task.max_new_tokens=8"]
    eager = run_tiny(tmp_path, *cuda, "predictor=none", name="eager")
    graph = run_tiny(tmp_path, *cuda, "predictor=last_step", "runtime.engine=graph", f"budget={budget}", name="graph")
    assert graph["generated_token_ids"] == eager["generated_token_ids"]
    assert graph["variant"] in ("prr", "serial") and graph["decode_steps"] == 8
    if graph["variant"] == "prr":  # counted inside the captured step
        assert 0 < graph["hit_rate"] <= 1
    if budget == "profiled":
        assert graph["budget_setup"]["choice"] == graph["variant"]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
def test_graph_engine_adaptive_on_the_gpu_replays_both_graphs(tmp_path):
    """budget=adaptive captures serial DSA and PRR over one cache and replays either per
    16-step window; fp32, so the tokens equal the eager runtime's serial DSA."""
    cuda = ["runtime=cuda", "runtime.dtype=float32", "task.max_new_tokens=40"]
    eager = run_tiny(tmp_path, *cuda, "predictor=none", name="eager")
    graph = run_tiny(tmp_path, *cuda, "predictor=last_step", "runtime.engine=graph", "budget=adaptive",
                     "budget.min_hit=0", name="graph")
    assert graph["generated_token_ids"] == eager["generated_token_ids"]
    setup = graph["budget_setup"]
    assert [w["variant"] for w in setup["windows"]][:2] == ["serial", "prr"] and len(setup["windows"]) == 3
    assert setup["steps_prr"] >= 16 and 0 < graph["hit_rate"] <= 1


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
def test_graph_engine_bf16_selects_what_the_eager_runtime_selects():
    """bf16 on a GPU: the engine keeps Quest metadata in bf16 and scores on tensor cores, the
    eager runtime keeps fp32 metadata (the same values) and scores in fp32 torch. From one
    prefill, the first decode step's selections agree (near-ties aside: >= 95% of blocks)."""
    from hydra.utils import instantiate

    from prr.cache import PagedKVCache
    from prr.run_inputs import build_run
    from prr.runtime.dsa_backend import DSABackend
    from prr.runtime.graph_decode import GraphDecoder
    from prr.runtime.graph_run import graph_plan

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*TINY, "runtime=cuda", "predictor=none",
                                                       "task.prompt_tokens=2000", "selector.topk_blocks=16"])
    r = build_run(cfg)
    mc, prompt_len = r.model.config, r.input_ids.shape[1]

    def prefilled() -> tuple[PagedKVCache, DSABackend, torch.Tensor]:
        cache = PagedKVCache(mc.num_layers, 1, mc.num_kv_heads, mc.head_dim, 16, prompt_len + 8, r.dtype, r.device)
        backend = DSABackend(cache, mc.num_heads, r.selector, r.predictor, r.budget,
                             backend=instantiate(cfg.backend).name)
        logits = r.model.decoder(r.input_ids, 0, backend)[:, -1]
        return cache, backend, logits.argmax(-1)

    with torch.inference_mode():
        cache, backend, first = prefilled()
        backend.finish_prefill()
        r.model.decoder(first[:, None], prompt_len, backend)
        records, _ = backend.end_step()
        eager = {rec.layer: rec.selected for rec in records}  # [B, Hkv, NB] bool
        cache, _, first = prefilled()
        plan = graph_plan(r.settings, r.selector, r.predictor, r.budget, -(-(prompt_len + 8) // 16))
        engine = GraphDecoder(r.model.decoder, plan, 1, prompt_len + 8, selector=r.selector, predictor=None)
        engine.fill_from_cache(cache.keys, cache.values, prompt_len, first)
        engine.step(advance=True)
    for layer, selection in enumerate(engine.last_selection):
        if selection is None or layer not in eager:
            continue
        idx, cnt = selection
        want = eager[layer].cpu()
        got = torch.zeros_like(want)
        for h in range(want.shape[1]):
            got[0, h, idx[0, h, : int(cnt[0, h])].long().cpu()] = True
        agree = (got & want).sum() / want.sum()
        assert agree >= 0.95, f"layer {layer}: {float(agree):.3f} of the eager selection"
