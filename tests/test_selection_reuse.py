"""Selection reuse (prr/reuse.py, prr/runtime/selection_reuse.py; issue 53), named approximations:
- reuse=layers: a reusing layer's A is its anchor's A of the same step, and its selector never runs;
- reuse=steps: A changes only on selection steps (between them: the last A plus the blocks begun since);
  on the graph engine a selecting and a between-selections view of the step, replayed by step number
  (prr/runtime/step_views.py), decide and attend what the eager step does;
- reuse=none: the step is the one without reuse, bit for bit;
in the eager step (the research runtime's) and the graph engine's step, through whole runs of both
engines, and the config refusals before any work."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prr.blocks import BlockSet, Selection
from prr.cache import PagedKVCache
from prr.config_check import compose_config, problems_before_torch
from prr.predictors.last_step import LastStepPredictor
from prr.reuse import LayerReuse, NoReuse, StepReuse
from prr.runtime.engine_ops import engine_ops
from prr.runtime.prr_step import PRRStep
from prr.runtime.selection_reuse import ReusedSelections
from prr.runtime.static_plan import StaticPlan
from prr.runtime.timing import StageTimer
from prr.selectors.quest import QuestSelector
from tests.test_one_engine import GPU, overrides, run_case

ROOT = Path(__file__).resolve().parents[1]
LAYERS, B, HKV, G, D, BS, PROMPT, STEPS = 6, 1, 2, 2, 16, 4, 45, 7  # odd sizes; a new block every 4 steps


def test_layer_anchors_are_the_nearest_selecting_sparse_layer_at_or_below():
    sparse = [False, True, True, True, True, True, True]
    assert LayerReuse(2).anchors(sparse) == [None, None, 1, None, 3, None, 5]
    assert LayerReuse(1).anchors(sparse) == [None] * 7  # every sparse layer selects: reuse=none
    # an explicit list; the first sparse layer selects always
    assert LayerReuse([4]).anchors(sparse) == [None, None, 1, 1, None, 4, 4]
    assert NoReuse().anchors(sparse) == [None] * 7


def test_the_summary_counts_selections_made_and_skipped():
    sparse = [False, True, True, True, True]
    assert LayerReuse(2).summary(sparse, 10) == {"policy": "layers", "selections_made": 20, "selections_skipped": 20}
    assert StepReuse(every=3).summary(sparse, 10) == {"policy": "steps", "selections_made": 16,
                                                       "selections_skipped": 24}  # steps 0, 3, 6, 9 select
    assert NoReuse().summary(sparse, 10)["selections_skipped"] == 0


def context(seed: int = 0) -> tuple[PagedKVCache, QuestSelector, torch.Generator]:
    """A cache of PROMPT random tokens in every layer, Quest's metadata over it (layer 0 dense)."""
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(LAYERS, B, HKV, D, BS, PROMPT + STEPS + 1, torch.float32, "cpu")
    selector = QuestSelector(topk_blocks=4, sink_blocks=1, local_blocks=0, force_newest=True, dense_layers=[0])
    for layer in range(LAYERS):
        k, v = (torch.randn(B, HKV, PROMPT, D, generator=gen) for _ in range(2))
        cache.append(layer, k, v)
        selector.update_metadata(cache, layer, 0, PROMPT)
    return cache, selector, gen


def decode(reuse, eager: bool, predictor=None, predicted_blocks: int = 3,
           seed: int = 0) -> tuple[list[list], list[list[int]], list, list[list]]:
    """STEPS decode steps of every sparse layer through one PRRStep -> (A per step and layer as
    (indices, count), the layers whose selector ran at each step, outputs per step and layer, P
    per step and layer where a predictor runs)."""
    cache, selector, gen = context(seed)
    calls: list[int] = []
    select = selector.select
    selector.select = lambda q, c, layer, *a, **k: (calls.append(layer), select(q, c, layer, *a, **k))[1]
    if eager:
        step = PRRStep.eager(cache, HKV * G, selector, predictor, "torch", "exact", StageTimer(torch.device("cpu")),
                             reuse)
        if predictor is not None:
            step.schedule.adopt_state(predictor.init_state(LAYERS, B, HKV, cache.max_blocks, "cpu"))
    else:  # the graph engine's step (uncaptured on the CPU): serial, the plan's variant
        step = PRRStep(StaticPlan(variant="serial", block_size=BS), cache, HKV * G, selector=selector, predictor=None,
                       backend="torch", reuse=reuse)
    # the graph engine's views (reuse=steps: the host replays the one between selections where the policy does not select)
    views = {False: step, True: step.with_plan(dataclasses.replace(step.plan, between_selections=True))}
    selections, selected, outs, predictions = [], [], [], []
    for t in range(STEPS):
        calls.clear()
        row_a, row_out, row_p = [], [], []
        for layer in range(LAYERS):
            k, v = (torch.randn(B, HKV, 1, D, generator=gen) for _ in range(2))
            start, end = cache.append(layer, k, v)
            q = torch.randn(B, HKV * G, D, generator=gen)
            if layer == 0:
                continue
            selector.append_metadata(cache, layer, torch.full((B,), start))
            lengths = torch.full((B,), end, dtype=torch.int32)
            num_blocks = torch.full((B,), cache.num_blocks(layer), dtype=torch.int32)
            if eager:
                out, a = step.sparse_attention(layer, q, lengths, num_blocks, step=t,
                                               predicted_blocks=predicted_blocks if predictor else 0)
            else:  # (no step number: the view decides)
                between = reuse is not None and reuse.varies_by_step and not reuse.selects_at(t)
                out, a = views[between].sparse_attention(layer, q, lengths, num_blocks)
            row_a.append((a.blocks.indices.clone(), a.blocks.count.clone()))
            row_out.append(out.clone())
            p = step.schedule.prediction(layer) if predictor is not None else None
            row_p.append(None if p is None else (p.indices.clone(), p.count.clone()))
        selections.append(row_a)
        selected.append(sorted(calls))
        outs.append(row_out)
        predictions.append(row_p)
    return selections, selected, outs, predictions


def members(a: tuple[torch.Tensor, torch.Tensor]) -> list[list[set[int]]]:
    idx, cnt = a
    return [[set(idx[b, h, : cnt[b, h]].tolist()) for h in range(HKV)] for b in range(B)]


@pytest.mark.parametrize("eager", [True, False], ids=["eager_step", "graph_step"])
def test_a_reusing_layer_attends_its_anchors_a_and_never_selects(eager):
    selections, selected, _, _ = decode(LayerReuse(2), eager)  # sparse layers 1..5: anchors 1, 3, 5
    for t in range(STEPS):
        assert selected[t] == [1, 3, 5]
        a = {layer: members(selections[t][layer - 1]) for layer in range(1, LAYERS)}
        assert a[2] == a[1] and a[4] == a[3]
        assert a[3] != a[1]  # (anchors select their own: the check above is not vacuous)


def test_a_reusing_layer_with_a_predictor_learns_from_the_a_it_attends():
    """last_step with |P| >= |A|: P_t = A_{t-1}, so a reusing layer's P is the A it attended last
    step (its anchor's): it learned from that A, and its hit rate counts against it."""
    selections, selected, _, predictions = decode(LayerReuse(2), True, LastStepPredictor(), predicted_blocks=12)
    assert all(s == [1, 3, 5] for s in selected)
    for t in range(1, STEPS):
        for layer in (2, 4):
            assert members(predictions[t][layer - 1]) == members(selections[t - 1][layer - 2])


def test_reuse_across_steps_changes_a_only_on_selection_steps():
    selections, selected, _, _ = decode(StepReuse(every=3), True)
    sparse = list(range(1, LAYERS))
    for t in range(STEPS):
        assert selected[t] == (sparse if t % 3 == 0 else [])
    for layer in range(len(sparse)):
        for t in range(1, STEPS):
            now, before = members(selections[t][layer]), members(selections[t - 1][layer])
            if t % 3:  # between selections: the last A, plus the newest block where one began
                newest = (PROMPT + t) // BS  # this step's token's block
                assert all(n == p | {newest} for rn, rp in zip(now, before, strict=True)
                           for n, p in zip(rn, rp, strict=True))
    changed = [t for t in range(1, STEPS) if members(selections[t][0]) != members(selections[t - 1][0])]
    assert set(changed) & {3, 6}, "selection steps re-select (and here change A)"


def test_reuse_across_steps_between_predicted_attends_the_predictors_proposal():
    predictor = LastStepPredictor()  # P_t = A_{t-1}: between=predicted attends the last A, as between=last
    last = decode(StepReuse(every=3), True, LastStepPredictor(), predicted_blocks=12)[0]
    predicted, selected, _, _ = decode(StepReuse(every=3, between="predicted"), True, predictor, predicted_blocks=12)
    assert selected == [list(range(1, LAYERS)) if t % 3 == 0 else [] for t in range(STEPS)]
    for t in range(STEPS):
        for a, b in zip(last[t], predicted[t], strict=True):
            assert members(a) == members(b)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_keep_is_one_op_on_a_selecting_step_and_none_between_selections(backend):
    """A selected A goes into the layer's buffers by `keep_selection` alone; between selections
    (between=last) `with_newest` writes the buffers in place and `keep` copies nothing: one op a
    layer either way (one launch each on backend triton)."""
    calls = []
    ops = engine_ops(backend)
    for name in ("keep_selection", "append_newest_block"):
        op = getattr(ops, name)
        setattr(ops, name, lambda *a, op=op, name=name, **k: calls.append(name) or op(*a, **k))
    reuse = ReusedSelections(StepReuse(every=3), [False, True], 1, HKV, 37, 4, torch.device("cpu"), ops)
    assert reuse.kept[0] is None and reuse.width == 6
    chosen = BlockSet(torch.tensor([[[0, 5, 9, 3], [0, 2, 7, 7]]]), torch.tensor([[4, 3]]))  # int64, best first
    scores = torch.randn(1, HKV, 37)
    kept = reuse.keep(1, Selection(chosen, scores))
    assert calls == ["keep_selection"] and kept is reuse.kept[1]
    assert kept.blocks.indices.tolist() == [[[0, 5, 9, 3, 0, 0], [0, 2, 7, 7, 0, 0]]] and torch.equal(kept.scores, scores)
    for num_blocks in (11, 12):  # the two steps before the next selection, a new block each
        between = reuse.with_newest(1, kept.blocks, torch.tensor([num_blocks], dtype=torch.int32))
        assert between.indices is kept.blocks.indices and between.count is kept.blocks.count
        assert reuse.keep(1, Selection(between, kept.scores)) is kept
    assert calls == ["keep_selection", "append_newest_block", "append_newest_block"]
    assert kept.blocks.indices.tolist() == [[[0, 3, 5, 9, 10, 11], [0, 2, 7, 10, 11, 0]]]
    assert kept.blocks.count.tolist() == [[6, 5]]


@pytest.mark.parametrize("eager", [True, False], ids=["eager_step", "graph_step"])
def test_reuse_none_is_the_step_without_reuse_bit_for_bit(eager):
    with_none, selected, out_none, _ = decode(NoReuse(), eager)
    without, _, out_without, _ = decode(None, eager)
    assert all(s == list(range(1, LAYERS)) for s in selected)
    for t in range(STEPS):
        for a, b in zip(with_none[t], without[t], strict=True):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for x, y in zip(out_none[t], out_without[t], strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("every", [2, 3])
def test_the_graph_engines_step_views_reuse_across_steps_as_the_eager_step_does(every):
    """The graph engine's step with no step number: its view between selections attends the A the
    eager step attends at that step (the last one, kept in static buffers, plus the newest block),
    bit for bit, and only the selecting view runs the selector."""
    eager, eager_selected, eager_out, _ = decode(StepReuse(every=every), True)
    graph, graph_selected, graph_out, _ = decode(StepReuse(every=every), False)
    assert graph_selected == eager_selected == [list(range(1, LAYERS)) if t % every == 0 else [] for t in range(STEPS)]
    for t in range(STEPS):
        for a, b in zip(eager[t], graph[t], strict=True):
            assert members(a) == members(b)
        for x, y in zip(eager_out[t], graph_out[t], strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    # A grows between selections exactly where a block begins (step 3 here: every=2 reuses there, every=3 selects)
    grown = [t for t in range(1, STEPS) if t % every and members(graph[t][0]) != members(graph[t - 1][0])]
    assert grown == [t for t in range(1, STEPS) if t % every and (PROMPT + t) % BS == 0] == ([3] if every == 2 else [])


@pytest.mark.parametrize("extra", [("reuse=layers", "reuse.anchors=1"), ("reuse=layers", "reuse.anchors=[1]")],
                         ids=["every_layer", "one_anchor"])
def test_both_engines_decode_the_same_with_layer_reuse(tmp_path, extra):
    """The eager runtime and the graph engine (ema, PRR) decode the same tokens with the same hit
    rates and dense metrics under reuse=layers; the summary counts the skipped selections."""
    args = [*overrides("quest", "ema"), "++model.num_layers=4", *extra]
    eager = run_case(tmp_path, [*args, "runtime.engine=eager"], "eager")
    graph = run_case(tmp_path, [*args, "runtime.engine=graph"], "graph")
    assert graph["generated_token_ids"] == eager["generated_token_ids"]
    for key in ("hit_rate", "last_step_overlap"):
        assert graph[key] == pytest.approx(eager[key], abs=1e-12), key
    assert graph["mean_mass_recall"] == pytest.approx(eager["mean_mass_recall"], abs=1e-6)
    skipped = {"reuse.anchors=1": 0, "reuse.anchors=[1]": 2 * 16}[extra[1]]  # sparse layers 1..3
    assert eager["reuse"]["selections_skipped"] == graph["reuse"]["selections_skipped"] == skipped
    assert eager["reuse"]["selections_made"] + skipped == 3 * 16


@pytest.fixture
def reuse_log(monkeypatch) -> dict[str, list]:
    """Per engine (log["engine"] names the one running), in order, every reuse=steps layer's
    (layer, whether it attended a reused A instead of selecting) and (layer, the A it attended
    as [row, KV head, block] members): spied on `ReusedSelections`, which both runtimes' steps ask."""
    log: dict[str, list] = {"engine": None}
    instead, keep = ReusedSelections.instead_of_selecting, ReusedSelections.keep

    def spy_instead(self, layer, *args):
        out = instead(self, layer, *args)
        if self.policy.name == "steps":
            log[log["engine"]].append(("reused", layer, out[0] is not None))
        return out

    def spy_keep(self, layer, selection):
        # (a captured step's A is a tensor to be: reading it would end the capture)
        if self.policy.name == "steps" and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            log[log["engine"]].append(("attended", layer, selection.blocks.mask(self.max_blocks).nonzero().tolist()))
        return keep(self, layer, selection)
    monkeypatch.setattr(ReusedSelections, "instead_of_selecting", spy_instead)
    monkeypatch.setattr(ReusedSelections, "keep", spy_keep)
    return log


REUSE_STEPS = 7  # decode steps of the whole runs below (3 layers: dense 0, sparse 1 and 2; a block begins at step 4)


def step_reuse_runs(tmp_path: Path, log: dict, extra: list[str], engines=("eager", "graph")) -> dict[str, dict]:
    """The whole run of each engine with ema, tiny and fp32 on the CPU (torch ops unless extra says)."""
    args = [*overrides("quest", "ema"), "++model.num_layers=3", f"task.max_new_tokens={REUSE_STEPS}", *extra]
    out = {}
    for engine in engines:
        log["engine"], log[engine] = engine, []
        out[engine] = run_case(tmp_path, [*args, f"runtime.engine={engine}"], engine)
    return out


def check_same_step_reuse(runs: dict[str, dict], log: dict, every: int) -> None:
    eager, graph = runs["eager"], runs["graph"]
    assert graph["generated_token_ids"] == eager["generated_token_ids"]
    assert log["graph"] == log["eager"]  # the same layers reuse at the same steps, attending the same A
    reused = [r[2] for r in log["graph"] if r[0] == "reused"]  # per step, per sparse layer
    assert reused == [t % every != 0 for t in range(REUSE_STEPS) for _ in (1, 2)]
    for key in ("hit_rate", "precision", "last_step_overlap"):
        assert graph[key] == pytest.approx(eager[key], abs=1e-12), key
    assert graph["mean_mass_recall"] == pytest.approx(eager["mean_mass_recall"], abs=1e-6)
    assert graph["reuse"] == eager["reuse"]
    assert graph["reuse"]["selections_made"] == reused.count(False)
    assert graph["reuse"]["selections_skipped"] == reused.count(True)


@pytest.mark.parametrize("every, between", [
    (3, "last"), (2, "predicted"),
    pytest.param(2, "last", marks=pytest.mark.slow), pytest.param(3, "predicted", marks=pytest.mark.slow)])
def test_both_engines_decode_the_same_with_step_reuse(tmp_path, reuse_log, every, between):
    """reuse=steps on the graph engine (its selecting and between-selections views, replayed by step
    number) decodes what the eager runtime decodes: the same tokens, the same layers reusing at the
    same steps and attending the same A, the same counters; the summary counts what ran."""
    runs = step_reuse_runs(tmp_path, reuse_log, ["reuse=steps", f"reuse.every={every}", f"reuse.between={between}"])
    check_same_step_reuse(runs, reuse_log, every)


@pytest.mark.slow  # (40 s: the Triton kernels under the interpreter, both engines)
def test_both_engines_decode_the_same_with_step_reuse_on_the_kernels(tmp_path, reuse_log):
    """The same on the Triton kernels (the step counters and sparse attention at the reuse buffers' width)."""
    runs = step_reuse_runs(tmp_path, reuse_log, ["reuse=steps", "reuse.every=3", "backend=triton"])
    check_same_step_reuse(runs, reuse_log, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
@pytest.mark.parametrize("between", ["last", "predicted"])
def test_captured_engine_decodes_the_same_with_step_reuse_on_a_gpu(tmp_path, reuse_log, between):
    """The same with the views captured as CUDA graphs (fp32, the kernels in both engines): the host
    replays the selecting or the between-selections graph per step. (The spy sees the captures, not
    the replays: the A attended is compared through the counters.)"""
    runs = step_reuse_runs(tmp_path, reuse_log, ["reuse=steps", "reuse.every=3", f"reuse.between={between}",
                                                 "runtime=cuda", "runtime.dtype=float32",
                                                 "runtime.dense_metrics_every=1", "backend=triton"])
    eager, graph = runs["eager"], runs["graph"]
    assert graph["generated_token_ids"] == eager["generated_token_ids"]
    for key in ("hit_rate", "precision", "last_step_overlap"):
        assert graph[key] == pytest.approx(eager[key], abs=1e-12), key
    assert graph["mean_mass_recall"] == pytest.approx(eager["mean_mass_recall"], abs=1e-4)
    assert graph["reuse"] == eager["reuse"]


def test_step_reuse_every_step_is_no_reuse_on_the_graph_engine(tmp_path, reuse_log):
    """reuse=steps with every=1 selects at every step: the graph engine decodes as with reuse=none."""
    every_step = step_reuse_runs(tmp_path / "every", reuse_log, ["reuse=steps", "reuse.every=1"], ("graph",))["graph"]
    assert [r[2] for r in reuse_log["graph"] if r[0] == "reused"] == [False] * (2 * REUSE_STEPS)
    none = step_reuse_runs(tmp_path / "none", reuse_log, ["reuse=none"], ("graph",))["graph"]
    assert every_step["generated_token_ids"] == none["generated_token_ids"]
    for key in ("hit_rate", "precision", "last_step_overlap", "mean_mass_recall", "mean_output_relerr"):
        assert every_step[key] == none[key], key
    assert every_step["reuse"]["selections_skipped"] == 0 and "reuse" not in none


@pytest.mark.parametrize("args, message", [
    (["reuse=steps", "reuse.every=0"], "reuse.every=0 must be an int >= 1"),
    (["reuse=steps", "reuse.between=sometimes"], "reuse.between='sometimes' is not one of ['last', 'predicted']"),
    (["reuse=layers", "reuse.anchors=[0,5]"], "reuse.anchors=[0, 5]: [0] are not sparse layers"),
    (["reuse=layers", "reuse.anchors=0"], "reuse.anchors=0 must be >= 1"),
    (["reuse=layers", "predictor=oracle"], "reuse=layers with predictor=oracle"),
    (["reuse=steps", "reuse.between=predicted", "predictor=none"], "reuse.between=predicted needs a predictor"),
])
def test_bad_reuse_is_refused_in_one_line_before_torch(args, message):
    problems = problems_before_torch(compose_config(args, check=False))
    assert len(problems) == 1 and message in problems[0], problems


@pytest.mark.parametrize("between", ["last", "predicted"])
def test_step_reuse_on_the_graph_engine_is_not_refused(between):
    args = ["reuse=steps", f"reuse.between={between}", "runtime.engine=graph"]
    assert problems_before_torch(compose_config(args, check=False)) == []


@pytest.mark.parametrize("args", [["reuse=layers"], ["reuse=steps"], ["reuse=layers", "runtime.engine=graph"],
                                  ["reuse=steps", "runtime.engine=graph"]])
def test_scored_tasks_take_reuse(args):
    """(tests/test_scored_reuse.py: the selections they make and the tokens they decode)"""
    assert problems_before_torch(compose_config([*args, "task=ruler_niah"], check=False)) == []


def test_run_py_refuses_bad_reuse_with_exit_code_2():
    done = subprocess.run([sys.executable, "run.py", "reuse=steps", "reuse.every=0", "runtime=cpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "reuse.every=0 must be an int >= 1" in done.stderr and "Traceback" not in done.stderr
