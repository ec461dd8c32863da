"""experiments/topk_filter_simulation.py: the candidate filter's fallback rate, from the kernel's own shape."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("topk_filter_simulation", ROOT / "experiments" / "topk_filter_simulation.py")
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)


def test_filter_shape_and_fallback_bounds():
    from prr.kernels.topk import candidate_filter_shape

    off = sim.fallback_rate(512, 32, rows=10)  # rows shorter than 1024 blocks: no filter
    assert off["groups"] == 0 and off["fallback"] is None
    cell = sim.fallback_rate(8192, 512, rows=40)
    assert (cell["groups"], cell["cap"]) == candidate_filter_shape(8192, 512) == (512, 1024)
    # the bound is a group max, so at least `groups` keys pass it; with 16-block groups far more
    # than N/8 do: every row falls back
    assert cell["mean_candidates"] >= cell["groups"] and cell["fallback"] == 1.0
    assert cell["launch_fallback_64_rows"] == 1.0
    small = sim.fallback_rate(8192, 32, rows=40)
    assert small["fallback"] == 0.0 and small["groups"] <= small["mean_candidates"] <= small["cap"]


def test_command_writes_json(tmp_path, monkeypatch, capsys):
    out = tmp_path / "sim"
    monkeypatch.setattr(sys, "argv", [str(ROOT / "experiments" / "topk_filter_simulation.py"), "--rows", "8"])
    sim.main(["--rows", "8", "--out", str(out)])
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["command"].startswith("python experiments/topk_filter_simulation.py --rows 8")
    assert len(record["cells"]) == len(sim.CELLS) and len(capsys.readouterr().out.splitlines()) == len(sim.CELLS)
    with pytest.raises(SystemExit) as exit_:
        sim.main(["--rows", "0"])
    assert exit_.value.code == 2 and capsys.readouterr().err.count("\n") == 1
