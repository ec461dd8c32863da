"""The CPU-testable parts of experiments/bench_hinted_topk.py: arguments, grid, floors, tables, and one
cell measured end to end on the CPU (its kernels under TRITON_INTERPRET=1: the checks, not the times)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_hinted_topk", ROOT / "experiments" / "bench_hinted_topk.py")
bh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bh)


def test_defaults_are_the_issue_grid():
    args = bh.parse_args([])
    assert args.candidates == [2048, 8192, 32768, 131072] and args.k == [32, 256, 2048]
    assert args.rows == [1, 8, 64] and args.hit_rates == [0.6, 0.7, 0.8] and args.device == "cuda"
    grid = bh.cells(args)
    assert len(grid) == 3 * 11 * 3  # k < candidates: (2048, 2048) is the one pair left out
    assert all(k < n for _, n, k, _ in grid)
    quick = bh.parse_args(["--quick", "--rows", "3"])
    assert quick.candidates == [2048] and quick.k == [32] and quick.rows == [3] and quick.hit_rates == [0.7]


@pytest.mark.parametrize("argv, needle", [
    (["--rows", "12"], "neither < 8 nor a multiple of 8"),
    (["--k", "4096", "--candidates", "2048"], "no cell has k < candidates"),
    (["--hit-rates", "0.5,1.5"], "must be in [0, 1]"),
    (["--hit-rates", "x"], "comma-separated list of numbers"),
    (["--candidates", "0"], "must be > 0"),
    (["--sets", "0"], "--sets=0 must be >= 1"),
    (["--device", "tpu"], "invalid choice"),
])
def test_bad_arguments_exit_2_with_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        bh.parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_shapes_sets_and_floor():
    assert bh.row_shape(1) == (1, 1) and bh.row_shape(8) == (1, 8) and bh.row_shape(64) == (8, 8)
    assert bh.topk_bytes(8, 2048, 32) == 8 * 2048 * 4 + 8 * 32 * 4
    assert bh.timing_sets(64, 131072, 4) == 4  # 32 MiB of scores a set: 4 sets pass 128 MiB
    assert bh.timing_sets(1, 2048, 4) == bh.MAX_SETS  # small cells: capped
    assert bh.timing_sets(8, 8192, 4) == 64 and bh.timing_sets(64, 32768, 4) == 16  # 8 MiB a set


def test_table_marks_flashinfer_absent_and_failed_checks():
    row = dict(rows=8, candidates=2048, k=32, hit_rate=0.7, measured_overlap=0.69, fit_fraction=1.0,
               hinted_us=4.0, hinted_oracle_us=3.5, hinted_pmin_us=6.0, prr_us=8.0, torch_topk_us=20.0, flashinfer=bh.NOT_INSTALLED,
               floor_us=0.02, sets_equal=False)
    text = bh.table([row, dict(rows=1, candidates=2048, k=32, hit_rate=0.6, error="RuntimeError: boom")])
    line = text.splitlines()[2]
    assert "| 0.5 |" in line and line.count(bh.NOT_INSTALLED) == 2 and line.endswith("| NO |")
    assert "RuntimeError: boom" in text.splitlines()[3]
    with_fi = dict(row, flashinfer="0.6.14", flashinfer_us=5.0, sets_equal=True)
    assert "| 5 | 0.8 |" in bh.table([with_fi])


def test_one_cell_runs_on_the_cpu(tmp_path):
    """--device cpu's cell: every check passes (hinted = topk_select on every set, prr = torch.topk,
    the next hint = the current k-th score), the hint fits, the times are recorded."""
    row = bh.cell_row(3, 300, 9, 0.7, sets=2, repeats=1, device="cpu", bandwidth=None, seed=5)
    assert row["sets_equal"] and row["hinted_equals_prr"] and row["prr_equals_torch"]
    assert row["flashinfer"] == bh.NOT_INSTALLED and row["fit_fraction"] == 1.0
    assert abs(row["measured_overlap"] - 0.7) < 0.2
    assert all(row[key] > 0 for key in ("hinted_us", "hinted_oracle_us", "hinted_pmin_us", "prr_us", "torch_topk_us"))
    assert 0.0 <= row["pmin_fit_fraction"] <= 1.0
    record = {"command": "python experiments/bench_hinted_topk.py --device cpu", "environment": {}, "rows": [row]}
    text = bh.write_outputs(record, tmp_path / "bench")
    assert (tmp_path / "bench.json").exists() and (tmp_path / "bench.csv").read_text().startswith("command,rows,")
    assert "| 3 | 300 | 9 |" in text
