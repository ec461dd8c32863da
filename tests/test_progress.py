"""Progress of the long work (issue 23, item 6), on stderr so that stdout keeps the summary:
the prefill ticks a bar per layer, budget=profiled's profiling one per timing point, the GGUF
conversion says what it converts, where, and how long it took. And a run refused by the
config check leaves no empty run dir behind (and never removes a dir holding anything)."""

import logging
import os
import time

from prr.budget.profiled import ProfiledBudget
from prr.model import loading
from prr.model.zoo import ZOO
from prr.paths import remove_empty_run_dir
from tests.test_budget import FakeProbe
from tests.test_end_to_end import run_tiny


def bar_lines(err: str, prefix: str) -> list[str]:
    """The states a tqdm bar printed (carriage returns separate them) that start with prefix."""
    return [s.strip() for s in err.replace("\r", "\n").split("\n") if s.strip().startswith(prefix)]


def test_the_prefill_shows_a_bar_of_layers_on_stderr(tmp_path, capsys):
    summary = run_tiny(tmp_path, "task.max_new_tokens=2")
    out, err = capsys.readouterr()
    states = bar_lines(err, f"prefill ({summary['prompt_tokens']} tokens)")
    assert states, err[-2000:]
    layers = ZOO["tiny-random"].config.num_layers
    assert f"{layers}/{layers} [" in states[-1] and "layer" in states[-1], states
    assert "calibrating the predictor" in states[-1], states
    assert "prefill (" not in out  # the summary on stdout stays clean


def test_profiling_shows_which_point_of_how_many(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    ProfiledBudget(ratios=[0.5, 1.0, 2.0], context_points=3, max_rounds=2).setup(
        FakeProbe(spreads=(3.0, 1.0)), selected_blocks=16, max_blocks=256)
    out, err = capsys.readouterr()
    # 3 contexts x (1 selection + 3 speculation sizes + the stage check's serial and PRR at each of the 3 sizes
    # that hide) = 24 points a round;
    # the noisy first round is measured again
    first = bar_lines(err, "budget=profiled: timing, round 1 (of at most 2)")
    second = bar_lines(err, "budget=profiled: timing, round 2 (of at most 2)")
    assert first and "24/24" in first[-1] and "point" in first[-1], err
    assert second and "24/24" in second[-1], err
    assert "budget=profiled: timing" not in out


def test_a_gguf_conversion_says_what_it_converts_and_how_long_it_took(tmp_path, monkeypatch, caplog):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"\0" * 3_000_000)

    def fake_convert(path, out_dir, provenance=None):
        (out_dir / loading._DONE_MARKER).write_text("{}")

    monkeypatch.setattr(loading, "convert_gguf", fake_convert)
    caplog.set_level(logging.INFO, logger="prr")
    target = tmp_path / "cache" / "converted"
    assert loading.ensure_gguf_converted(gguf, target) == target
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"converting {gguf} (3 MB)" in line and str(target) in line and "once" in line for line in lines), lines
    assert any(line.startswith("converted model.gguf in ") for line in lines), lines
    caplog.clear()
    loading.ensure_gguf_converted(gguf, target)  # already converted: nothing to say
    assert not caplog.records


def test_an_empty_run_dir_of_this_process_is_removed_and_nothing_else(tmp_path):
    before = time.time() - 1
    old_empty = tmp_path / "old"
    old_empty.mkdir()
    os.utime(old_empty, (before - 60, before - 60))  # was there before the process started
    assert not remove_empty_run_dir(old_empty, before) and old_empty.is_dir()
    holding = tmp_path / "holding"
    holding.mkdir()
    (holding / "notes.txt").write_text("someone's")
    assert not remove_empty_run_dir(holding, before) and (holding / "notes.txt").read_text() == "someone's"
    ours = tmp_path / "ours"
    ours.mkdir()
    assert remove_empty_run_dir(ours, before) and not ours.exists()
    assert not remove_empty_run_dir(tmp_path / "missing", before)
