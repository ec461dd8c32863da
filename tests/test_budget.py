"""Speculation budgets: fixed arithmetic, and profiled keeps the |P| whose whole PRR stage
beats serial DSA's fastest (stage_check) or the largest whose speculation hides inside
selection (the paper's rule), 0 where none does, cached per device and shape."""

import json
import logging
import os
import time

import pytest

from prr.budget.base import StageTiming
from prr.budget.fixed import FixedBudget
from prr.budget.profiled import ProfiledBudget


class FakeProbe:
    """Stage times linear in the blocks; `spreads` gives each round's q3/q1 ratio (the
    last repeats for later rounds), 1.0: perfectly steady."""

    device_name = "fake"
    shape_key = "shape"

    def __init__(self, select_per_block=1.0, spec_per_block=2.0, spreads=(1.0,), prr_stage_share=0.5):
        self.a, self.b, self.calls, self.spreads = select_per_block, spec_per_block, 0, list(spreads)
        self.prr_stage_share = prr_stage_share  # PRR's whole stage / serial DSA's (< 1: PRR faster)
        self.stages = []  # (context, |P|) of each time_stage call
        self.round, self._select_calls_done = 0, False

    def _timing(self, median):
        spread = self.spreads[min(self.round, len(self.spreads) - 1)]
        return StageTiming(median, median, median, median * spread, median * spread)

    def time_select(self, context_blocks):
        if self._select_calls_done:  # a new round starts with selection again
            self.round += 1
            self._select_calls_done = False
        self.calls += 1
        return self._timing(self.a * context_blocks)

    def time_speculate(self, predicted_blocks, context_blocks):
        self.calls += 1
        self._select_calls_done = True
        return self._timing(self.b * predicted_blocks)

    def time_stage(self, context_blocks, predicted_blocks, hit_rate):
        """Serial DSA 3 x selection; PRR prr_stage_share of that, plus the speculation's time
        beyond selection's (what does not hide lengthens the stage)."""
        self.calls += 1
        self.stages.append((context_blocks, predicted_blocks))
        serial = 3.0 * self.a * context_blocks
        if not predicted_blocks:
            return self._timing(serial)
        beyond = max(0.0, self.b * predicted_blocks - self.a * context_blocks)
        return self._timing(serial * self.prr_stage_share + beyond)


def test_fixed_budget():
    assert FixedBudget(ratio=1.5).predicted_blocks(0, 100, 16) == 24
    assert FixedBudget(blocks=7).predicted_blocks(0, 100, 16) == 7
    assert FixedBudget(ratio=2.0).predicted_blocks(0, 10, 16) == 10  # never more than the context
    with pytest.raises(ValueError, match="ratio=-1"):
        FixedBudget(ratio=-1)


def test_profiled_picks_largest_hidden_budget(tmp_path, monkeypatch):
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    budget = ProfiledBudget(ratios=[0.5, 1.0, 2.0], context_points=3)
    probe = FakeProbe(select_per_block=1.0, spec_per_block=2.0)  # spec(n) <= select(c) iff n <= c/2
    budget.setup(probe, selected_blocks=16, max_blocks=256)
    for context, expected in [(16, 8), (64, 32), (256, 32)]:
        assert budget.predicted_blocks(0, context, 16) == expected
    # Cached: a second setup measures nothing.
    again, probe2 = ProfiledBudget(ratios=[0.5, 1.0, 2.0], context_points=3), FakeProbe()
    info = again.setup(probe2, selected_blocks=16, max_blocks=256)
    assert probe2.calls == 0 and info["profile_cached"] and again.table == budget.table


@pytest.mark.parametrize("share,stage_check,expected", [(0.99, True, 0), (0.99, False, 32), (0.97, True, 32)])
def test_profiled_keeps_a_hidden_p_only_where_the_whole_stage_is_faster(tmp_path, monkeypatch, share, stage_check,
                                                                        expected):
    """Step 3 of the rule: the PRR stage at the hidden |P| must beat serial DSA's by > margin
    (0.02), or |P| = 0; stage_check=false keeps the paper's rule alone."""
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    budget = ProfiledBudget(ratios=[0.5, 1.0, 2.0], context_points=1, stage_check=stage_check)
    probe = FakeProbe(select_per_block=1.0, spec_per_block=2.0, prr_stage_share=share)
    info = budget.setup(probe, selected_blocks=16, max_blocks=64)
    assert budget.predicted_blocks(0, 64, 16) == expected
    assert probe.stages == ([(64, 0), (64, 8), (64, 16), (64, 32)] if stage_check else [])  # every |P|
    row = info["profile_measurements"][0]
    assert row["hidden_blocks"] == 32 and ("stage_prr_s" in row) == stage_check


@pytest.mark.parametrize("stage_check,expected", [(True, 8), (False, 0)])
def test_profiled_keeps_a_faster_stage_where_speculation_does_not_hide(tmp_path, monkeypatch, stage_check, expected):
    """Speculation a little longer than selection at every |P| (nothing hides: the paper's rule
    says 0) while the whole PRR stage is faster (it takes the attention over P off the step): the
    stage check times every size and keeps the fastest."""
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    budget = ProfiledBudget(ratios=[0.5, 1.0, 2.0], context_points=1, stage_check=stage_check)
    # select 32 at 64 blocks, spec(8) = 32.8: PRR's stage 0.67 x 96 + 0.8 = 65.1 against serial's 96
    probe = FakeProbe(select_per_block=0.5, spec_per_block=4.1, prr_stage_share=0.67)
    info = budget.setup(probe, selected_blocks=16, max_blocks=64)
    row = info["profile_measurements"][0]
    assert row["hidden_blocks"] == 0 and budget.predicted_blocks(0, 64, 16) == expected
    assert probe.stages == ([(64, 0), (64, 8), (64, 16), (64, 32)] if stage_check else [])


def test_profiled_takes_the_fastest_hidden_p_not_the_widest(tmp_path, monkeypatch):
    """A wider P costs the merge more: where the widest |P| that hides loses to serial DSA and a
    narrower one wins, the narrower one is chosen."""
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))

    class WiderCostsMore(FakeProbe):
        def time_stage(self, context_blocks, predicted_blocks, hit_rate):
            self.stages.append((context_blocks, predicted_blocks))
            serial = 3.0 * self.a * context_blocks
            return self._timing(serial * (1.0 if predicted_blocks == 0 else 0.9 + 0.005 * predicted_blocks))
    budget = ProfiledBudget(ratios=[0.5, 1.0, 2.0], context_points=1, use_cache=False)
    info = budget.setup(WiderCostsMore(select_per_block=1.0, spec_per_block=2.0), selected_blocks=16, max_blocks=64)
    row = info["profile_measurements"][0]
    assert row["hidden_blocks"] == 32 and row["stage_best_blocks"] == 8  # 0.94, 0.98, 1.06 x serial
    assert budget.predicted_blocks(0, 64, 16) == 8 and set(row["stage_prr_by_size_s"]) == {8, 16, 32}


def test_profiled_profiles_the_contexts_it_is_given(tmp_path, monkeypatch):
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    budget = ProfiledBudget(ratios=[1.0])
    budget.setup(FakeProbe(), selected_blocks=4, max_blocks=64, contexts=[40])
    assert budget.table == [(40, 4)]
    with pytest.raises(ValueError, match="contexts"):
        ProfiledBudget().setup(FakeProbe(), selected_blocks=4, max_blocks=64, contexts=[65])


def test_profiled_chooses_zero_when_speculation_cannot_hide(tmp_path, monkeypatch):
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    budget = ProfiledBudget(ratios=[0.5, 1.0], context_points=2, use_cache=False)
    budget.setup(FakeProbe(select_per_block=0.001, spec_per_block=10.0), selected_blocks=16, max_blocks=64)
    assert budget.predicted_blocks(0, 64, 16) == 0


def test_profiled_lookup_between_and_below_grid_points(tmp_path, monkeypatch):
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    budget = ProfiledBudget(ratios=[0.5, 1.0, 2.0], context_points=3, use_cache=False)
    budget.setup(FakeProbe(select_per_block=1.0, spec_per_block=2.0), selected_blocks=16, max_blocks=256)
    assert [c for c, _ in budget.table] == [16, 64, 256]
    assert budget.predicted_blocks(0, 100, 16) == budget.predicted_blocks(0, 64, 16)  # the grid point below
    assert budget.predicted_blocks(0, 4, 16) == 4  # below the grid: the first row, capped by the context


def test_stage_timing_spread_is_the_interquartile_ratio():
    # One interrupt among the repeats (the 5 ms) moves max, not the quartiles: an idle machine stays steady.
    timing = StageTiming.of([1.0, 1.0, 1.1, 1.0, 1.2, 1.0, 5.0, 1.1, 1.0])
    assert (timing.min_s, timing.median_s, timing.max_s) == (1.0, 1.0, 5.0) and timing.spread == pytest.approx(1.1)
    with pytest.raises(ValueError, match="got 1"):
        StageTiming.of([1.0])


def test_profiled_says_its_choice_and_where_the_table_came_from(tmp_path, monkeypatch, caplog):
    """Issue 23: a run names |P| per profiled context and whether the table was measured now
    or loaded from the cache (which file, how old), in one console line and in its record."""
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, logger="prr")
    info = ProfiledBudget(ratios=[0.5, 1.0, 2.0], context_points=3).setup(FakeProbe(), selected_blocks=16, max_blocks=256)
    path = info["profile_cache"]
    assert info["profile_source"] == "measured" and info["profile_choice"] == {"16": 8, "64": 32, "256": 32}
    assert path.startswith(str(tmp_path)) and os.path.exists(path)
    (line,) = [r.getMessage() for r in caplog.records if "budget=profiled" in r.getMessage()]
    assert "16 blocks -> 8, 64 blocks -> 32, 256 blocks -> 32" in line and "measured now" in line and path in line

    hour_ago = time.time() - 3600
    os.utime(path, (hour_ago, hour_ago))
    caplog.clear()
    info = ProfiledBudget(ratios=[0.5, 1.0, 2.0], context_points=3).setup(FakeProbe(), selected_blocks=16, max_blocks=256)
    assert info["profile_source"] == "cache" and info["profile_cache"] == path
    assert 3600 <= info["profile_cache_age_s"] < 3700 and info["profile_choice"] == {"16": 8, "64": 32, "256": 32}
    (line,) = [r.getMessage() for r in caplog.records if "budget=profiled" in r.getMessage()]
    assert "loaded from cache" in line and path in line and "60 min ago" in line


def test_profiled_records_the_spread_and_measures_a_noisy_profile_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    probe = FakeProbe(spreads=[3.0, 1.2])  # a loaded first round, a steady second
    info = ProfiledBudget(ratios=[0.5, 1.0], context_points=2).setup(probe, selected_blocks=16, max_blocks=64)
    assert info["profile_rounds"] == [3.0, 1.2] and info["profile_kept_round"] == 1 and info["profile_spread"] == 1.2
    select = info["profile_measurements"][0]["select_timing"]
    assert select["min_s"] == select["q1_s"] == select["median_s"] == 16 and select["q3_s"] == pytest.approx(16 * 1.2)
    assert json.loads(open(info["profile_cache"]).read())["rounds"] == [3.0, 1.2]  # the table keeps it too

    # Never steady: at most max_rounds rounds, the steadiest kept, used but not cached (warned).
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path / "noisy"))
    probe = FakeProbe(spreads=[3.0, 2.2, 2.5, 1.0])
    info = ProfiledBudget(ratios=[0.5, 1.0], context_points=2, max_rounds=3).setup(probe, selected_blocks=16, max_blocks=64)
    assert info["profile_rounds"] == [3.0, 2.2, 2.5] and info["profile_kept_round"] == 1
    assert info["profile_cache"] is None and not (tmp_path / "noisy").exists()
    assert any("spread 2.20x" in r.getMessage() and "not cached" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)


@pytest.mark.parametrize("damage", ["{not json", '{"table": [[16, 8]]}', '[1, 2]'])
def test_profiled_names_an_unreadable_cache_file_and_measures_again(tmp_path, monkeypatch, caplog, damage):
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    path = ProfiledBudget(ratios=[0.5, 1.0], context_points=2).setup(FakeProbe(), 16, 64)["profile_cache"]
    with open(path, "w") as f:
        f.write(damage)
    probe = FakeProbe()
    info = ProfiledBudget(ratios=[0.5, 1.0], context_points=2).setup(probe, 16, 64)
    assert probe.calls > 0 and info["profile_source"] == "measured" and path in info["profile_cache_problem"]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert path in warning and "measuring again" in warning
    assert json.loads(open(path).read())["table"] == [[16, 8], [64, 16]]  # rewritten, usable again


@pytest.mark.parametrize("slowdown,warned", [(3.0, True), (0.2, True), (1.3, False)])
def test_profiled_warns_once_when_the_run_contradicts_its_selection_timing(tmp_path, monkeypatch, caplog, slowdown,
                                                                           warned):
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    budget = ProfiledBudget(ratios=[0.5, 1.0], context_points=2, use_cache=False)
    info = budget.setup(FakeProbe(select_per_block=1.0), selected_blocks=16, max_blocks=64)  # T_select(c) = c s
    assert budget.expected_select_s(40) == pytest.approx(40)  # between grid points: linear
    for step in range(6):
        for layer in range(2):
            budget.predicted_blocks(layer, 40, 16)
        budget.observe([record(layer, selected=range(8), predicted=range(8), step=step, select=40 * slowdown)
                        for layer in range(2)])
    assert budget.observed_select_ratio == pytest.approx(slowdown)
    # summary.json's budget_setup (this dict, written after decoding) holds the check too
    assert info["observed_select_ratio"] == pytest.approx(slowdown)
    assert ("profile_contradiction" in info) == warned
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == int(warned) and (not warned or f"{slowdown:.2f}x the profiled time" in warnings[0])


# --- adaptive -------------------------------------------------------------------------------

def record(layer, selected, predicted, ranked=None, step=0, speculate=0.0, select=1.0):
    """A LayerStepRecord over 1 row, 1 KV head, 32 blocks from block-id lists."""
    import torch

    from prr.step_record import LayerStepRecord

    def mask(ids):
        m = torch.zeros(1, 1, 32, dtype=torch.bool)
        m[0, 0, list(ids)] = True
        return m
    return LayerStepRecord(step=step, layer=layer, context_tokens=512, selected=mask(selected),
                           predicted=mask(predicted), previous=None,
                           ranked_at_k=mask(ranked if ranked is not None else selected), budget_blocks=len(predicted),
                           timings={"speculate": speculate, "select": select}, block_mass=None,
                           output_relerr=None, serial_relerr=None)


def adaptive(**kwargs):
    from prr.budget.adaptive import AdaptiveBudget

    return AdaptiveBudget(**{"smoothing": 0.0, **kwargs})


def test_adaptive_measures_both_then_runs_the_faster_and_reprobes_the_other():
    budget = adaptive(probe_every=4)
    ran = []
    for _ in range(12):
        variant = budget.variant
        ran.append(variant)
        budget.end_window(variant, {"serial": 2.0, "prr": 1.0}[variant], 0.9 if variant == "prr" else None)
    assert ran[:2] == ["serial", "prr"]  # each measured once first
    assert ran[2:] == ["prr", "prr", "serial", "prr", "prr", "prr", "serial", "prr", "prr", "prr"]  # probe at 4, 8
    assert [w["choice_after"] for w in budget.windows][1:] == ["prr"] * 11
    assert budget.info["windows_prr"] == 9 and budget.info["windows_serial"] == 3


def test_adaptive_does_not_choose_a_weak_predictor_however_fast():
    budget = adaptive(min_hit=0.5, probe_every=3)
    budget.end_window("serial", 2.0)
    budget.end_window("prr", 1.0, hit_rate=0.4)
    assert budget.best() == "serial" and budget.variant == "serial"
    assert budget.end_window("serial", 2.0) == "prr"  # window 3: re-measure PRR
    budget.end_window("prr", 1.0, hit_rate=0.6)  # the predictor recovered
    assert budget.best() == "prr"


def test_adaptive_smooths_times_per_variant_and_follows_a_change_of_regime():
    budget = adaptive(smoothing=0.5, probe_every=2)
    budget.end_window("serial", 1.0)
    budget.end_window("prr", 2.0, hit_rate=1.0)
    assert budget.best() == "serial"
    budget.end_window("prr", 0.2, hit_rate=1.0)  # running mean 1.1: still slower
    assert budget.seconds["prr"] == pytest.approx(1.1) and budget.best() == "serial"
    budget.end_window("prr", 0.2, hit_rate=1.0)  # 0.65: now faster
    assert budget.best() == "prr"


def test_adaptive_in_the_eager_runtime_sizes_p_per_window_and_ends_windows_from_its_records():
    """The eager runtime's side of the same rule: |P| = 0 in serial windows, ratio x |A| in PRR
    windows; a window of window_steps steps ends with the median of the steps' summed stage
    times and, for PRR, the pooled hit rate of its records."""
    budget = adaptive(ratio=1.5, window_steps=2)
    assert budget.variant == "serial" and budget.predicted_blocks(0, 32, 8) == 0
    budget.observe([record(0, selected=range(8), predicted=[], select=3.0), record(1, range(8), [], select=1.0)])
    assert budget.windows == []  # one step of two
    budget.observe([record(0, selected=range(8), predicted=[], select=5.0)])
    assert budget.windows[0] == {"variant": "serial", "median_ms": pytest.approx(4500.0), "hit_rate": None,
                                 "choice_after": "serial"}
    assert budget.variant == "prr" and budget.predicted_blocks(0, 32, 8) == 12 and budget.predicted_blocks(0, 10, 8) == 10
    budget.observe([record(0, selected=range(8), predicted=range(6), speculate=1.0, select=1.0)])
    budget.observe([record(0, selected=range(8), predicted=range(4, 16), speculate=1.0, select=1.0)])
    assert budget.windows[1]["hit_rate"] == pytest.approx((6 + 4) / 16)
    assert budget.windows[1]["median_ms"] == pytest.approx(2000.0) and budget.best() == "prr"


@pytest.mark.parametrize("kwargs,match", [(dict(ratio=0.0), "ratio"), (dict(min_hit=2), "min_hit"),
                                          (dict(smoothing=1.0), "smoothing"), (dict(probe_every=1), "probe_every"),
                                          (dict(window_steps=0), "window_steps")])
def test_adaptive_rejects_bad_settings(kwargs, match):
    from prr.budget.adaptive import AdaptiveBudget

    with pytest.raises(ValueError, match=match):
        AdaptiveBudget(**kwargs)
    with pytest.raises(ValueError, match="variant"):
        AdaptiveBudget().end_window("dense", 1.0)


def test_the_eager_probes_given_prediction_ranks_p_first_and_proposes_exactly_p():
    import torch

    from prr.blocks import BlockSet
    from prr.runtime.probe import GivenPrediction

    p = BlockSet(torch.tensor([[[7, 2, 9, 0]]]), torch.tensor([[3]]))  # P = 7, 2, 9 (the 0 is padding)
    given = GivenPrediction(p, max_blocks=12)
    ranking = given.rank(None, 0, 12)
    assert ranking.shape == (1, 1, 12)
    assert ranking[0, 0].argsort(descending=True)[:3].tolist() == [7, 2, 9]
    assert torch.isinf(ranking[0, 0, [0, 1, 3, 11]]).all()  # the padding entry's block 0 is not in P
    assert given.propose(None, 0, 12, 3) is p


def test_the_graph_engine_takes_the_budgets_own_decision_whatever_its_kind():
    """The engine asks every budget the same questions (no kind flags): a budget of its own that
    decides serial DSA before the decode gets a serial plan, the fixed budget keeps the planned
    |P| (every block for a selector that selects them all) without building a probe, and the
    adaptive one captures both variants and chooses per window."""
    from types import SimpleNamespace

    from prr.budget.base import SpeculationBudget
    from prr.runtime.graph_run import resolved_plan
    from prr.runtime.static_plan import StaticPlan

    class SerialAfterAll(SpeculationBudget):
        def static_blocks(self, selected_blocks):
            return selected_blocks

        def predicted_blocks(self, layer, context_blocks, selected_blocks):
            return 0

        def resolve_engine_blocks(self, make_probe, planned, selected_blocks, max_blocks, context_blocks):
            return 0, {"why": "measured nothing worth speculating"}

    def no_probe():
        raise AssertionError("a budget that does not measure built a probe")

    selector, predictor = SimpleNamespace(topk_blocks=4), SimpleNamespace(uses_budget=True)
    plan = StaticPlan(variant="prr", predicted_blocks=4, block_size=16)
    args = (None, 1, 64 * 16, selector, "torch", 10)  # decoder, batch, capacity, selector, backend, context
    serial, info = resolved_plan(plan, SerialAfterAll(), predictor, *args)
    assert (serial.variant, serial.predicted_blocks, info["choice"]) == ("serial", 0, "serial")
    every = StaticPlan(variant="prr", predicted_blocks=64, block_size=16)  # selector=dense: |P| = every block
    fixed = FixedBudget(ratio=0.5)
    fixed.resolve_engine_blocks = lambda make, *rest: FixedBudget.resolve_engine_blocks(fixed, no_probe, *rest)
    assert resolved_plan(every, fixed, predictor, *args) == (every, {})
    assert fixed.engine_blocks(4, 64) == 2 and fixed.engine_variants("prr") == ("prr",)
    budget = adaptive(window_steps=3)
    assert budget.engine_variants("prr") == ("serial", "prr") and budget.window_steps_or(16) == 3
    assert budget.window_variant("prr") == "serial"  # its first window measures serial DSA
    assert budget.end_window("serial", 1.0) == "prr" == budget.window_variant("prr")
