"""The graph engine's budget=adaptive policy: serial DSA or PRR per window, by measured time
and PRR's hit rate (prr/runtime/graph_adaptive.py)."""

from __future__ import annotations

import pytest

from prr.runtime.graph_adaptive import WindowChoice


def test_measures_both_then_runs_the_faster_and_reprobes_the_other():
    choice = WindowChoice(min_hit=0.3, smoothing=0.0, probe_every=4)
    ran = []
    for _ in range(12):
        variant = choice.next_variant()
        ran.append(variant)
        choice.observe(variant, {"serial": 2.0, "prr": 1.0}[variant], 0.9 if variant == "prr" else None)
    assert ran[:2] == ["serial", "prr"]  # each measured once first
    assert ran[2:] == ["prr", "prr", "serial", "prr", "prr", "prr", "serial", "prr", "prr", "prr"]  # probe at 4, 8
    assert [w["choice_after"] for w in choice.windows][1:] == ["prr"] * 11


def test_a_weak_predictor_is_not_chosen_however_fast():
    choice = WindowChoice(min_hit=0.5, smoothing=0.0, probe_every=3)
    choice.observe("serial", 2.0)
    choice.observe("prr", 1.0, hit_rate=0.4)
    assert choice.best() == "serial" and choice.next_variant() == "serial"
    choice.observe("serial", 2.0)
    assert choice.next_variant() == "prr"  # window 3: re-measure PRR
    choice.observe("prr", 1.0, hit_rate=0.6)  # the predictor recovered
    assert choice.best() == "prr"


def test_times_are_smoothed_per_variant_and_regimes_change():
    choice = WindowChoice(smoothing=0.5, probe_every=2)
    choice.observe("serial", 1.0)
    choice.observe("prr", 2.0, hit_rate=1.0)
    assert choice.best() == "serial"
    choice.observe("prr", 0.2, hit_rate=1.0)  # running mean 1.1: still slower
    assert choice.seconds["prr"] == pytest.approx(1.1) and choice.best() == "serial"
    choice.observe("prr", 0.2, hit_rate=1.0)  # 0.65: now faster
    assert choice.best() == "prr"


@pytest.mark.parametrize("kwargs,match", [({"min_hit": 1.5}, "min_hit"), ({"smoothing": 1.0}, "smoothing"),
                                          ({"probe_every": 1}, "probe_every")])
def test_bad_parameters_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WindowChoice(**kwargs)
    with pytest.raises(ValueError, match="variant"):
        WindowChoice().observe("dense", 1.0)
