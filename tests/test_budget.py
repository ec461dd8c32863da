"""Speculation budgets: fixed arithmetic, and profiled picks the largest |P| whose
speculation hides inside selection (0 where none does), cached per device and shape."""

import pytest

from prr.budget.fixed import FixedBudget
from prr.budget.profiled import ProfiledBudget


class FakeProbe:
    device_name = "fake"
    shape_key = "shape"

    def __init__(self, select_per_block=1.0, spec_per_block=2.0):
        self.a, self.b, self.calls = select_per_block, spec_per_block, 0

    def time_select(self, context_blocks):
        self.calls += 1
        return self.a * context_blocks

    def time_speculate(self, predicted_blocks, context_blocks):
        self.calls += 1
        return self.b * predicted_blocks


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
