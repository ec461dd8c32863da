"""One definition per option: every selector and every predictor config runs in the
CUDA-graph engine (runtime.engine=graph; CPU: its kernels under TRITON_INTERPRET=1) and there
decodes what the eager research runtime decodes from the same prompt, model and prefill:
identical tokens over 16 steps, equal hit rate, precision and last-step overlap (pooled
|P ∩ A|, |P|, |A_t ∩ A_{t-1}| over every step, layer, row and KV head, fp32: the same A and P
at every step, or the counts would differ), and the same attention-mass recall and output
error against dense attention on the sampled steps; in shadow mode too."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from prr.runner import run
from tests.helpers import replays_selections
from tests.test_graph_run import TINY

ROOT = Path(__file__).resolve().parents[1]
GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
SELECTORS = sorted(p.stem for p in (ROOT / "conf" / "selector").glob("*.yaml"))
# predictors that replay a serial pass only the graph engine records (bench_hit_rate, a benchmark tool:
# the eager runtime refuses it) are left out: tests/test_bench_hit_rate.py checks it against serial DSA.
PREDICTORS = sorted(p.stem for p in (ROOT / "conf" / "predictor").glob("*.yaml") if not replays_selections(p.stem))
BUDGETS = sorted(p.stem for p in (ROOT / "conf" / "budget").glob("*.yaml"))
# 2 layers (layer 0 dense), 16 steps; sinks + newest forced in a top-K of 6 blocks of 16;
# dense metrics on every 4th step (the engine's sampled-step graphs and the always-measured ones).
COMMON = ["++model.num_layers=2", "task.max_new_tokens=16", "runtime.calibration_tokens=12",
          "runtime.dense_metrics_every=4"]
# `make test`: every selector and every predictor config at least once (each predictor paired
# with a selector other than Quest where it can be), and every mode and Quest GQA reduction.
# On a plain CPU the engine runs torch ops (prr/runtime/engine_ops.py); cases with backend=triton
# run its Triton kernels under the interpreter (the eager runtime's step then runs them too).
# CURATED pairs the built-in options; an option of conf/ it leaves out (a new one) runs with the
# default partner below, so a new option is tested here with no line of this file edited.
# Selectors whose paper fixes the block size (they refuse TINY's 16), sized for it in every case:
# InfLLM-v2's 64-token blocks, 9 prompt blocks, 2 forced + 2 chosen.
# The lightning indexer selects tokens (block_size 1; its top-K key is topk_tokens): 24 of ~316 tokens,
# 2 sinks + the newest 6 forced, a small indexer (16 heads: few tokens score exactly 0, every ReLU 0, a tie).
SIZED = {"infllm_v2": ["runtime.block_size=64", "task.prompt_tokens=600", "selector.topk_blocks=4",
                       "selector.local_blocks=0"],
         "indexer": ["runtime.block_size=1", "selector.topk_tokens=24", "selector.sink_tokens=2",
                     "selector.local_tokens=5", "selector.index_heads=16", "selector.index_dim=16",
                     "selector.rope_dim=8"]}
CURATED = [("quest", "ema"), ("quest", "none"), ("quest", "spin", "runtime.mode=shadow"),
         ("quest", "cross_layer", "selector.gqa_reduce=sum"), ("quest", "oracle", "selector.gqa_reduce=union"),
         ("exact", "last_step"), ("infllm", "ema_membership", "runtime.dense_metrics_every=3"),
         ("infllm", "query_similarity"), ("infllm_prr", "last_step", "selector.per_head=true"),
         ("less", "ema_calibrated", "runtime.repair_mode=superset"),
         ("dense", "ema")]
CASES = CURATED + [(s, "ema") for s in SELECTORS if s not in {c[0] for c in CURATED}] \
    + [("quest", p) for p in PREDICTORS if p not in {c[1] for c in CURATED}]
# `make test-full` adds the rest of every selector x ema and Quest x every predictor.
# (InfLLM's Triton kernels against its torch ops: tests/test_kernels_infllm.py in `make test`; through
# both engines here, 30 s under the interpreter, in `make test-full`.)
MORE_CASES = [c for c in [(s, "ema") for s in SELECTORS] + [("quest", p) for p in PREDICTORS] if c not in CASES]
# Quest with ema on the kernels: 55 s under the interpreter; make test runs the Triton engine through
# test_graph_decode.py (ema and query_similarity learning at once, fused append and merge on the kernels)
MORE_CASES.append(("quest", "ema", "backend=triton"))
MORE_CASES.append(("infllm", "ema_membership", "runtime.dense_metrics_every=3", "backend=triton"))
MORE_CASES.append(("infllm_v2", "ema", "backend=triton"))  # its kernels (prr.kernels.infllm_v2) in both engines
# the indexer's kernels (index keys, scores, top-K) and token-list attention at block size 1 in both engines
MORE_CASES.append(("indexer", "ema", "backend=triton"))
# every predictor over token sets; spin's learning sums in another order on its kernel (the graph engine's
# layer-range update) than in torch, and over ~316 tokens a near-tie of its rank falls the other way once in
# 768 proposals (quest at block size 1 too): docs/design.md, "Token-level selection"
MORE_CASES += [("indexer", p) for p in PREDICTORS if p not in ("ema", "spin")]
# exact on the kernels: the graph engine speculates inside the q·K launch, the eager runtime beside it
MORE_CASES.append(("exact", "ema", "backend=triton"))
# the predictors whose kernels the graph engine runs layer range at once (last_step, spin) and
# query_similarity's two-launch propose with its counters at the step's end, against the eager runtime
MORE_CASES += [("quest", p, "backend=triton") for p in ("last_step", "spin", "query_similarity")]


def overrides(selector: str, predictor: str, *extra: str) -> list[str]:
    out = [*TINY, *SIZED.get(selector, []), f"selector={selector}", f"predictor={predictor}", *extra, *COMMON]
    # dense: no top-K, every block (|P| = every block too); the indexer's is topk_tokens (SIZED)
    if selector == "dense" or any(o.startswith("selector.topk_tokens") for o in SIZED.get(selector, [])):
        out = [o for o in out if not o.startswith("selector.topk_blocks")]
    return out


def run_case(tmp_path: Path, args: list[str], name: str) -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=args)
    return run(cfg, tmp_path / name)


def case_id(case: tuple[str, ...]) -> str:
    return "-".join(x.split("=")[-1] for x in case)


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in MORE_CASES], ids=case_id)
def test_graph_engine_runs_the_same_algorithm(tmp_path, case):
    check_same_algorithm(tmp_path, case, [])


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
@pytest.mark.parametrize("case", CASES + MORE_CASES, ids=case_id)
def test_captured_engine_runs_the_same_algorithm_on_a_gpu(tmp_path, case):
    """The same on a GPU, fp32: the engine's steps are CUDA-graph replays with speculation on a
    second stream; the eager runtime runs the same objects op by op, with backend=triton so
    Quest's scores come from the same kernel (the torch ops sum in another order on a GPU, and
    a predictor ranking by scores, SPIN, then breaks a near-tie differently: seen on the H200)."""
    ops = [] if "union" in "".join(case) else ["backend=triton"]  # (union has no Triton Quest kernel)
    check_same_algorithm(tmp_path, case, ["runtime=cuda", "runtime.dtype=float32", "runtime.dense_metrics_every=1",
                                          *ops])


def check_same_algorithm(tmp_path: Path, case: tuple[str, ...], device: list[str]) -> None:
    selector, predictor, *extra = case
    args = [*overrides(selector, predictor, *extra), *device]
    eager = run_case(tmp_path, [*args, "runtime.engine=eager"], "eager")
    graph = run_case(tmp_path, [*args, "runtime.engine=graph"], "graph")
    assert graph["generated_token_ids"] == eager["generated_token_ids"]
    assert graph["decode_steps"] == eager["decode_steps"] == 16
    for key in ("hit_rate", "precision", "last_step_overlap"):
        want = eager.get(key)
        if predictor == "none" and key != "last_step_overlap":
            assert graph.get(key) is None, key
            continue
        assert graph.get(key) == pytest.approx(want, abs=1e-12), key
    # Dense-reference metrics on the same sampled steps (float sums in another order).
    assert graph["mean_mass_recall"] == pytest.approx(eager["mean_mass_recall"], abs=1e-6)
    assert graph["mean_output_relerr"] == pytest.approx(eager["mean_output_relerr"], rel=1e-3, abs=1e-6)
    assert graph["mode"] == eager["mode"]
    kernels = "backend=triton" in args or "runtime=cuda" in args
    assert graph["engine_ops"] == ("triton" if kernels else "torch")


def test_a_dense_selection_with_a_partial_static_p_is_refused(tmp_path):
    """|P| that grows with the context (dense, ratio != 1) has no static shape: refused, named."""
    from prr.config_check import ConfigError

    with pytest.raises(ConfigError, match="budget.ratio=1"):
        run_case(tmp_path, [*overrides("dense", "last_step"), "budget.ratio=0.5", "runtime.engine=graph"], "refused")
    assert not (tmp_path / "refused").exists()


def test_every_budget_config_runs_in_the_graph_engine(tmp_path, monkeypatch):
    """Every YAML in conf/budget under runtime.engine=graph (Quest + last-step P, exact repair):
    each decodes serial DSA's tokens and records its decision: fixed |P| = |A|; profiled its
    timed choice (on the CPU by the host clock: the machinery, not a speed claim); adaptive its
    windows of serial and PRR steps."""
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path / "cache"))
    base = [*TINY, "++model.num_layers=2", "selector=quest", "predictor=last_step"]
    serial = run_case(tmp_path, [*base, "predictor=none", "runtime.engine=eager"], "serial")
    for budget in BUDGETS:
        # (profiled: one ratio and one round, each timing under the interpreter costs seconds)
        fast = ["budget.ratios=[1.0]", "budget.max_rounds=1"] if budget == "profiled" else []
        graph = run_case(tmp_path, [*base, f"budget={budget}", *fast, "runtime.engine=graph"], budget)
        assert graph["generated_token_ids"] == serial["generated_token_ids"], budget
        setup = graph["budget_setup"]
        if budget == "fixed":
            assert graph["variant"] == "prr" and graph["predicted_blocks"] == 6 and 0 < graph["hit_rate"] <= 1
        elif budget == "profiled":  # the prompt's context profiled on the engine, its table sized |P|
            (row,) = setup["profile_measurements"]
            assert '"timer": "cpu_wall_clock"' in setup["profile_key"] and setup["choice"] == graph["variant"]
            assert setup["profile_choice"] == {str(row["context_blocks"]): graph["predicted_blocks"]}
            assert (graph["predicted_blocks"] > 0) == (graph["variant"] == "prr")
        elif budget == "adaptive":
            assert graph["variant"] == "adaptive"
            assert setup["steps_prr"] + setup["steps_serial"] == graph["decode_steps"] == 6
        else:
            raise AssertionError(f"conf/budget/{budget}.yaml has no check here: add one")


def test_adaptive_decides_the_same_windows_in_both_engines(tmp_path):
    """budget=adaptive is one rule: with min_hit = 1 (PRR never chosen after a window it missed
    in, whatever the timings) the windows' variants follow from the hit rates alone, and both
    engines run the same windows with the same hit rates (the predictor learns in serial
    windows too, in both) and decode serial DSA's tokens."""
    args = [*overrides("quest", "last_step"), "budget=adaptive", "budget.min_hit=1.0", "budget.window_steps=2",
            "budget.probe_every=2"]
    eager = run_case(tmp_path, [*args, "runtime.engine=eager"], "eager")
    graph = run_case(tmp_path, [*args, "runtime.engine=graph"], "graph")
    assert graph["generated_token_ids"] == eager["generated_token_ids"]
    windows = [(w["variant"], w["hit_rate"]) for w in eager["budget_setup"]["windows"]]
    assert len(windows) == 8 and all(h is None or h < 1.0 for _, h in windows)
    assert [v for v, _ in windows] == ["serial", "prr", "prr", "serial", "prr", "serial", "prr", "serial"]
    assert [(w["variant"], w["hit_rate"]) for w in graph["budget_setup"]["windows"]] == \
        [(v, pytest.approx(h, abs=1e-12) if h is not None else None) for v, h in windows]


def test_profiled_applies_one_rule_in_both_engines(tmp_path, monkeypatch):
    """budget=profiled is one rule over each engine's own timings: given the same timings (both
    probes patched to one table: every |P| hides and PRR's stage is faster), both engines choose
    the same |P| and decode the same tokens with equal hit rates."""
    from prr.budget.base import StageTiming
    from prr.runtime.graph_budget import GraphProbe
    from prr.runtime.probe import StageProbe

    def fixed(seconds):
        return StageTiming(seconds, seconds, seconds, seconds, seconds)
    monkeypatch.setattr(StageProbe, "stages_in_sequence", False)  # time it as if it could overlap (else |P| = 0 untimed)
    for probe in (StageProbe, GraphProbe):
        monkeypatch.setattr(probe, "time_select", lambda self, c: fixed(1e-3))
        monkeypatch.setattr(probe, "time_speculate", lambda self, n, c: fixed(1e-5 * n))
        monkeypatch.setattr(probe, "time_stage", lambda self, c, n, hit: fixed(1e-3 if n == 0 else 5e-4))
    args = [*overrides("quest", "last_step"), "budget=profiled", "budget.ratios=[0.5,1.0]", "budget.use_cache=false"]
    eager = run_case(tmp_path, [*args, "runtime.engine=eager"], "eager")
    graph = run_case(tmp_path, [*args, "runtime.engine=graph"], "graph")
    assert set(eager["budget_setup"]["profile_choice"].values()) == {6}  # |P| = |A| at every profiled context
    assert graph["budget_setup"]["profile_choice"] == {str(k): 6 for k in graph["budget_setup"]["profile_choice"]}
    assert graph["variant"] == "prr" and graph["predicted_blocks"] == 6
    assert graph["generated_token_ids"] == eager["generated_token_ids"]
    assert graph["hit_rate"] == pytest.approx(eager["hit_rate"], abs=1e-12) and 0 < graph["hit_rate"] < 1
