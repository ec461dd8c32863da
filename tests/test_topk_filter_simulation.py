"""experiments/topk_filter_simulation.py: the candidate filter's fallback rate, from the kernel's own shape."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("topk_filter_simulation", ROOT / "experiments" / "topk_filter_simulation.py")
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)


def test_filter_shape_and_fallback_bounds():
    from prr.kernels.topk import candidate_filter_shape

    off = sim.fallback_rate(512, 32, rows=10)  # rows shorter than 1024 blocks: no filter
    assert off["groups"] == 0 and off["fallback"] is None and off["mean_candidates"] is None
    # k = 512 of 8192: the bound passes far more than a quarter of the row, so the policy runs the full row
    cell = sim.fallback_rate(8192, 512, rows=40)
    assert (cell["groups"], cell["cap"]) == candidate_filter_shape(8192, 512)[:2] == (0, 1)
    assert cell["mean_candidates"] > 8192 / 4 and cell["fallback"] is None
    # k = 128 of 8192: cap 2048 holds every row's candidates (the bound passes at least `groups` keys)
    on = sim.fallback_rate(8192, 128, rows=200, launch_rows=64)
    assert (on["groups"], on["cap"], on["candidate_radix_bits"]) == (128, 2048, 2)
    assert on["groups"] <= on["mean_candidates"] <= on["cap"] and on["launch_fallback"] == on["fallback"] == 0.0
    # rows over the cap (256 for 8 rows at 2048 blocks, k = 32): the launch waits if any row falls back
    tight = sim.fallback_rate(2048, 32, rows=4, launch_rows=8, counts=torch.tensor([100.0, 300.0, 256.0, 600.0]))
    assert tight["cap"] == 256 and tight["fallback"] == 0.5 and tight["launch_fallback"] == pytest.approx(1 - 0.5 ** 8)


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
