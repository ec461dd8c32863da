"""Speculation budgets: fixed arithmetic, and profiled picks the largest |P| whose
speculation hides inside selection (0 where none does), cached per device and shape."""

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

    def __init__(self, select_per_block=1.0, spec_per_block=2.0, spreads=(1.0,)):
        self.a, self.b, self.calls, self.spreads = select_per_block, spec_per_block, 0, list(spreads)
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

    from prr.runtime.records import LayerStepRecord

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

    return AdaptiveBudget(use_profile=False, smoothing=0.0, **kwargs)


def test_adaptive_grows_while_it_misses_and_waste_is_low():
    budget = adaptive()
    assert budget.predicted_blocks(0, 32, 8) == 8
    budget.observe([record(0, selected=range(8), predicted=range(6))])  # 25% missed, no waste
    assert budget.predicted_blocks(0, 32, 8) == 10
    for _ in range(10):
        budget.observe([record(0, selected=range(8), predicted=range(6))])
    assert budget.predicted_blocks(0, 32, 8) == 16  # max_ratio 2.0
    assert budget.predicted_blocks(1, 32, 8) == 8  # per layer


def test_adaptive_shrinks_on_waste_and_when_speculation_stops_hiding():
    budget = adaptive()
    budget.observe([record(0, selected=range(4), predicted=range(12))])  # waste 2/3
    assert budget.predicted_blocks(0, 32, 8) == round(8 / 1.25)
    budget = adaptive()
    budget.observe([record(0, selected=range(8), predicted=range(8), speculate=2.0, select=1.0)])
    assert budget.predicted_blocks(0, 32, 8) == round(8 / 1.25)
    budget = adaptive()  # all hit, no waste, hides: unchanged
    budget.observe([record(0, selected=range(8), predicted=range(8), speculate=0.5, select=1.0)])
    assert budget.predicted_blocks(0, 32, 8) == 8


def test_adaptive_switches_speculation_off_for_a_weak_predictor_and_back_on():
    budget = adaptive(min_hit=0.5)
    budget.observe([record(0, selected=range(8), predicted=range(20, 28), ranked=range(20, 28))])
    assert budget.predicted_blocks(0, 32, 8) == 0
    budget.observe([record(0, selected=range(8), predicted=[], ranked=range(8), step=1)])
    assert budget.predicted_blocks(0, 32, 8) > 0
    assert [h.get("off") for h in budget.history if "off" in h] == [True, False]


def test_adaptive_never_exceeds_the_profiled_ceiling(tmp_path, monkeypatch):
    from prr.budget.adaptive import AdaptiveBudget

    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    budget = AdaptiveBudget(smoothing=0.0, profile_ratios=[0.5, 1.0, 2.0], profile_context_points=3)
    budget.setup(FakeProbe(select_per_block=1.0, spec_per_block=2.0), selected_blocks=16, max_blocks=256)
    for _ in range(10):  # misses push the ratio to 2.0 ...
        budget.observe([record(0, selected=range(8), predicted=range(6))])
    assert budget.predicted_blocks(0, 16, 16) == 8  # ... but speculation of 16 blocks does not hide at 16 blocks


@pytest.mark.parametrize("kwargs,match", [(dict(ratio=3.0), "max_ratio"), (dict(growth=1.0), "growth"),
                                          (dict(min_hit=2), "min_hit"), (dict(smoothing=1.0), "smoothing")])
def test_adaptive_rejects_bad_settings(kwargs, match):
    from prr.budget.adaptive import AdaptiveBudget

    with pytest.raises(ValueError, match=match):
        AdaptiveBudget(**kwargs)
