"""prr.bench_args' shared benchmark steps that the scripts reach only on a GPU (record_cell, the
recorded command) or through one script's arguments: each against what the scripts wrote before."""

import argparse
import json
import sys

from prr.bench_args import (
    bench_command,
    fill_grid_defaults,
    guarded,
    host_time_us,
    record_cell,
    timing_count_problems,
    topk_rows_problems,
)


def test_record_cell_keeps_a_failed_cell_with_its_error_and_writes_after_each(tmp_path, capsys):
    record = {"command": "c", "rows": []}
    written = []

    def write_outputs(rec, out):
        written.append((out, len(rec["rows"])))
        return ""

    def measure(n, k):
        if k > n:
            raise ValueError(f"k={k} > n={n}")
        return {"n": n, "k": k, "us": 1.5}

    ok = record_cell(record, tmp_path / "o", write_outputs, {"n": 8, "k": 2}, measure, 8, k=2)
    bad = record_cell(record, tmp_path / "o", write_outputs, {"n": 8, "k": 9}, measure, 8, k=9)
    assert ok == {"n": 8, "k": 2, "us": 1.5}
    assert bad == {"n": 8, "k": 9, "error": "ValueError: k=9 > n=8"} and list(bad) == ["n", "k", "error"]
    assert record["rows"] == [ok, bad] and written == [(tmp_path / "o", 1), (tmp_path / "o", 2)]
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [ok, bad]


def test_guarded_records_the_error_beside_the_row():
    row = {}
    guarded(row, "a_us", lambda: 2.0)
    guarded(row, "b_us", lambda: 1 / 0)
    assert row == {"a_us": 2.0, "b_us_error": "ZeroDivisionError: division by zero"}


def test_bench_command_is_the_process_argv_or_the_script_with_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["experiments/bench_x.py", "--quick"])
    assert bench_command("experiments/bench_x.py", None) == "python experiments/bench_x.py --quick"
    assert bench_command("experiments/bench_x.py", ["--k", "3"]) == "python experiments/bench_x.py --k 3"
    assert bench_command("experiments/bench_x.py", []) == "python experiments/bench_x.py "


def test_grid_defaults_fill_only_what_the_command_line_left_out():
    grid = {"k": [1, 2], "rows": [8]}
    args = argparse.Namespace(k=None, rows=[64])
    fill_grid_defaults(args, grid)
    assert args.k == [1, 2] and args.rows == [64]
    args.k.append(3)
    assert grid["k"] == [1, 2]  # a copy: the grid stays as declared


def test_grid_checks_name_each_bad_value():
    assert topk_rows_problems([1, 8, 12, 64, 70]) == [
        f"--rows: {r} is neither < 8 nor a multiple of 8 (rows are batch x 8 KV heads)" for r in (12, 70)]
    assert timing_count_problems(argparse.Namespace(sets=0, repeats=3)) == ["--sets=0 must be >= 1"]
    assert timing_count_problems(argparse.Namespace(sets=1, repeats=1)) == []


def test_host_time_us_times_every_set_each_round():
    calls = []
    us = host_time_us(lambda i: (lambda: calls.append(i)), sets=3, repeats=2)
    assert calls == [0, 1, 2, 0, 1, 2] and us >= 0.0
