"""What the benchmark scripts in experiments/ share besides timing: a parser whose errors are one
line, the type of a comma-separated list of positive integers (grid axes), the grid's defaults and
the checks every grid makes, how many input sets a timing graph rotates through, ratios of optional
times, the top-k cells' shape and bytes, their markdown tables, the command a results file records,
a measurement whose failure is recorded instead of raised, a host wall-clock timer (the CPU path), and their three output files (rewritten
after every cell)."""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from prr.paths import strict_json_dumps

L2_ROTATION_BYTES = 128 << 20  # bytes a timing graph reads over its input sets: 2.5x an H100's / H200's 50 MB L2
TOPK_KV_HEADS = 8  # top-k benchmark rows are batch x 8 KV heads (the 8B shape) from 8 rows up


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr, exit code 2 (no usage block)."""

    def error(self, message: str):  # noqa: D102
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def int_list(text: str) -> list[int]:
    """'1,8,64' -> [1, 8, 64]; anything but positive integers is an argparse error naming the text."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be > 0")
    return values


def fmt(x, digits: int = 3) -> str:
    """A table cell: None or NaN -> "-", booleans yes / NO, floats to `digits` significant digits
    (whole numbers from 10^4), anything else as str."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:.0f}"
    return str(x)


def markdown(header: list[str], body: list[list]) -> str:
    """A markdown table of `header` and the rows of `body` (cells through `fmt`)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in body]
    return "\n".join(lines)


def write_bench_outputs(record: dict, out: Path, report: Callable[[dict], str]) -> str:
    """OUT.json (strict JSON), OUT.csv (one row per cell of record["rows"], the command in each) and
    OUT.md (report(record)), its folder made -> the markdown. Rewritten whole after every cell, so
    a cut run keeps the cells it finished."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(strict_json_dumps(record, indent=1) + "\n")
    rows = record.get("rows", [])
    if rows:
        keys = list(dict.fromkeys(key for r in rows for key in r))
        with out.with_suffix(".csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["command", *keys])
            writer.writeheader()
            for r in rows:
                writer.writerow({"command": record["command"], **r})
    text = report(record)
    out.with_suffix(".md").write_text(text + "\n")
    return text


def rotation_sets(set_bytes: int, at_least: int, most: int = 64) -> int:
    """Input sets a timing graph rotates through: at least `at_least`, and enough (up to `most`)
    that the graph reads L2_ROTATION_BYTES, so its reads miss L2 as a decode step's would."""
    return min(most, max(at_least, math.ceil(L2_ROTATION_BYTES / max(set_bytes, 1))))


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b of two measured times; None where either is missing (None, an error string) or b <= 0."""
    if a is None or b is None or not (isinstance(a, (int, float)) and isinstance(b, (int, float))) or b <= 0:
        return None
    return a / b


def topk_row_shape(rows: int) -> tuple[int, int]:
    """Top-k rows -> (batch, KV heads) of the scores [B, Hkv, N]: fewer than 8 rows are batch 1."""
    return (1, rows) if rows <= TOPK_KV_HEADS else (rows // TOPK_KV_HEADS, TOPK_KV_HEADS)


def topk_bytes(rows: int, n: int, k: int) -> int:
    """A top-k's bytes: fp32 scores read once + int32 indices written."""
    return rows * n * 4 + rows * k * 4


def fill_grid_defaults(args: argparse.Namespace, grid: dict[str, list]) -> None:
    """Each axis of `grid` (an argument name -> its default values) left None on the command line
    takes the grid's values (a copy), so --quick and the full grid share one parser."""
    for key, values in grid.items():
        if getattr(args, key) is None:
            setattr(args, key, list(values))


def topk_rows_problems(rows: list[int]) -> list[str]:
    """The --rows values that are not a top-k benchmark's batch x TOPK_KV_HEADS (see topk_row_shape),
    one problem each."""
    return [f"--rows: {r} is neither < {TOPK_KV_HEADS} nor a multiple of {TOPK_KV_HEADS} "
            f"(rows are batch x {TOPK_KV_HEADS} KV heads)" for r in rows if r > TOPK_KV_HEADS and r % TOPK_KV_HEADS]


def timing_count_problems(args: argparse.Namespace) -> list[str]:
    """--sets and --repeats below 1, one problem each."""
    return [f"--{name}={getattr(args, name)} must be >= 1" for name in ("sets", "repeats") if getattr(args, name) < 1]


def bench_command(script: str, argv: list[str] | None) -> str:
    """The command a results file records: this process's own argv when run from the shell
    (argv None), else `python <script> <argv>` (a test or a caller passing argv to main)."""
    if argv is None:
        return "python " + " ".join([sys.argv[0], *sys.argv[1:]])
    return f"python {script} " + " ".join(argv)


def guarded(row: dict, name: str, fn: Callable[[], object]) -> None:
    """row[name] = fn(); an exception is recorded in row[name + '_error'] instead (its type and
    message, 300 characters at most), so one measurement's failure does not lose the cell."""
    try:
        row[name] = fn()
    except Exception as err:  # noqa: BLE001 - recorded in the row
        row[f"{name}_error"] = f"{type(err).__name__}: {err}"[:300]


def record_cell(record: dict, out: Path, write_outputs: Callable[[dict, Path], str], cell: dict,
                measure: Callable[..., dict], *args, **kwargs) -> dict:
    """One cell of a benchmark's grid: row = measure(*args, **kwargs), or `cell` (the grid's values
    naming it) with an `error` (400 characters at most) where it raises; appended to record["rows"],
    printed as one JSON line and the outputs rewritten (write_outputs(record, out)) -> the row."""
    try:
        row = measure(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - recorded in the results
        row = {**cell, "error": f"{type(err).__name__}: {err}"[:400]}
    record["rows"].append(row)
    print(json.dumps(row), flush=True)
    write_outputs(record, out)
    return row


def host_time_us(make_call: Callable[[int], Callable[[], object]], sets: int, repeats: int) -> float:
    """Median host wall-clock µs per call of `sets` calls (make_call(i) -> a zero-argument call),
    over `repeats` rounds: the CPU stand-in for a CUDA-graph timer (no graph, no synchronisation;
    under TRITON_INTERPRET=1 it times the interpreter)."""
    calls = [make_call(i) for i in range(sets)]
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for call in calls:
            call()
        samples.append((time.perf_counter() - start) * 1e6 / sets)
    return statistics.median(samples)
