"""The CPU-testable parts of experiments/bench_topk_long.py: arguments, grid, floors, tables, and its
one-line refusal (exit 2) where there is no CUDA GPU to time on."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_topk_long", ROOT / "experiments" / "bench_topk_long.py")
bl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bl)


def test_defaults_are_the_issue_grid():
    args = bl.parse_args([])
    assert args.candidates == [8192, 16384, 32768, 131072, 1 << 20] and args.k == [32, 256, 2048]
    assert args.rows == [1, 8, 64] and args.chunk is None and args.cap is None and not args.finish
    assert bl.parse_args(["--finish"]).finish
    assert len(bl.cells(args)) == 3 * 5 * 3
    assert bl.row_shape(1) == (1, 1) and bl.row_shape(64) == (8, 8)


@pytest.mark.parametrize("argv, needle", [
    (["--rows", "12"], "neither < 8 nor a multiple of 8"),
    (["--k", "4096", "--candidates", "2048"], "no cell has k < candidates"),
    (["--chunk", "1000"], "--chunk=1000 must be a power of two"),
    (["--cap", "8"], "--cap=8 must be a power of two"),
    (["--sets", "0"], "--sets=0 must be >= 1"),
])
def test_bad_arguments_are_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bl.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_refuses_without_a_gpu_in_one_line(capsys):
    """Here (the interpreter, no CUDA) main() refuses before measuring anything."""
    with pytest.raises(SystemExit) as exit_info:
        bl.main(["--rows", "1", "--candidates", "32768", "--k", "32"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench_topk_long: ") and "\n" not in err


def test_floor_sets_and_table(tmp_path):
    assert bl.topk_bytes(1, 131072, 2048) == 131072 * 4 + 2048 * 4  # a row of 128K fp32 is 512 KB
    assert bl.timing_sets(1, 131072, 4) == 64  # 512 KB a set: capped at MAX_SETS
    assert bl.timing_sets(64, 1 << 20, 4) == 4  # 256 MB a set: the asked minimum
    assert bl.describe_paths({3: 60, 2: 4}) == "level 3: 60, level 2: 4"
    rows = [dict(rows=1, candidates=32768, k=32, auto_path="multi-program", one_program_us=205.0,
                 multi_program_us=20.0, torch_topk_us=48.0, multi_over_torch=20 / 48, multi_over_one=20 / 205,
                 floor_us=0.05, threshold_found_at="level 3: 1", sets_equal=True),
            dict(rows=1, candidates=131072, k=2048, auto_path="multi-program", one_program_us=1050.0,
                 multi_program_us=28.6, torch_topk_us=60.0, multi_over_torch=28.6 / 60, multi_over_one=28.6 / 1050,
                 floor_us=0.2, finish_us=14.3, finish_over_multi=0.5, threshold_found_at="level 3: 1",
                 sets_equal=True),
            dict(rows=8, candidates=32768, k=32, error="RuntimeError: boom")]
    record = {"command": "python experiments/bench_topk_long.py", "environment": {"gpu": "H100"},
              "timer": "cuda_graph_replay", "bandwidth_GBps": 3000.0, "rows": rows}
    text = bl.write_outputs(record, tmp_path / "out")
    assert "| 1 | 32768 | 32 | multi-program | 205 | 20 | 48 | 0.417 |" in text and "RuntimeError: boom" in text
    assert "| 0.2 | 143 | 14.3 | 0.5 | level 3: 1 | yes |" in text  # the finish columns, where timed
    assert "| 400 | - | - | level 3: 1 | yes |" in text  # '-' where not
    assert (tmp_path / "out.csv").read_text().count("\n") == 4 and (tmp_path / "out.json").exists()
