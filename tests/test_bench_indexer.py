"""The CPU-testable parts of experiments/bench_indexer.py: arguments, grid, byte floors, tables and
outputs, and its one-line refusal without CUDA (the timings need a GPU)."""

import importlib.util
from pathlib import Path

import pytest

from prr.bench_args import host_time_us

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_indexer", ROOT / "experiments" / "bench_indexer.py")
bi = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bi)


def test_defaults_are_the_issue_grid():
    args = bi.parse_args([])
    assert args.contexts == [8192, 32768, 131072] and args.batch == [1, 8] and args.index_dtypes == ["bf16", "fp8"]
    assert args.heads == 64 and args.dim == 128 and args.q_dtype == "bf16"
    assert len(bi.cells(args)) == 3 * 2 * 2
    quick = bi.parse_args(["--quick", "--index-dtypes", "fp8"])
    assert quick.contexts == [8192] and quick.batch == [1] and quick.index_dtypes == ["fp8"]


@pytest.mark.parametrize("argv, needle", [
    (["--dim", "96"], "--dim=96 must be a power of two"),
    (["--heads", "0"], "--heads=0 must be in [1, 128]"),
    (["--index-dtypes", "fp4"], "not in ['bf16', 'fp8']"),
    (["--contexts", "1"], "every context must be >= 2"),
    (["--batch", "0"], "must be > 0"),
    (["--sets", "0"], "--sets=0 must be >= 1"),
    (["--q-dtype", "fp16"], "invalid choice"),
])
def test_bad_arguments_exit_2_with_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        bi.parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_refuses_without_cuda_in_one_line(monkeypatch, capsys, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        bi.main(["--quick", "--out", str(tmp_path / "bench")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "no CUDA GPU" in err and len(err.splitlines()) == 1
    assert not list(tmp_path.iterdir())  # nothing written


def test_byte_floors():
    assert bi.key_bytes_per_token(128, "fp8") == 132 and bi.key_bytes_per_token(128, "bf16") == 256
    # 128K tokens, batch 1, 64 heads: keys (+ scales) read, fp32 scores written, bf16 q and fp32 w read
    assert bi.score_bytes(1, 131072, 64, 128, "fp8", 2) == 131072 * 136 + 64 * (256 + 4)
    assert bi.score_bytes(8, 8192, 64, 128, "bf16", 4) == 8 * 8192 * 260 + 8 * 64 * (512 + 4)
    assert bi.append_bytes(8, 128, "fp8") == 8 * (256 + 132)
    assert bi.timing_sets(32 << 20, 4) == 4 and bi.timing_sets(1 << 20, 4) == bi.MAX_SETS
    assert bi.timing_sets(8 << 20, 4) == 16


def test_table_and_outputs(tmp_path):
    row = dict(context=8192, batch=1, index_dtype="fp8", score_us=4.0, score_floor_us=2.0, torch_fp32_us=80.0,
               torch_bf16_us=40.0, score_rel_err=1e-7, append_us=2.5, append_torch_us=9.0, append_floor_us=0.001,
               checks_pass=False)
    text = bi.table([row, dict(context=131072, batch=8, index_dtype="bf16", error="OutOfMemoryError: boom")])
    line = text.splitlines()[2]
    assert line.startswith("| 8192 | 1 | fp8 | 4 | 2 | 2 | 80 | 40 | 0.1 |") and line.endswith("| NO | - | - |")
    assert "OutOfMemoryError: boom" in text.splitlines()[3]
    assert bi.table([dict(row, tuned_us=3.0, tuned_best="t64_s3_w4_p2")]).splitlines()[2].endswith(
        "| NO | 3 | t64_s3_w4_p2 |")
    configs = bi.tune_configs(8, 132)
    assert len(configs) == 48 and configs["t128_s2_w8_p4"] == dict(block_t=128, num_stages=2, num_warps=8, splits=66)
    record = {"command": "python experiments/bench_indexer.py --quick", "environment": {"gpu": "H100"},
              "shape": dict(heads=64, dim=128, q_dtype="bf16"), "rows": [row]}
    md = bi.write_outputs(record, tmp_path / "sub" / "bench")
    assert (tmp_path / "sub" / "bench.json").exists() and "H100" in md and "H_I = 64" in md
    assert (tmp_path / "sub" / "bench.csv").read_text().startswith("command,context,batch,index_dtype,")


@pytest.mark.parametrize("index_dtype", ["bf16", "fp8"])
def test_one_cell_runs_on_the_cpu(index_dtype, monkeypatch):
    """cell_row's checks and timings end to end on the CPU (the kernels under TRITON_INTERPRET=1, a host
    timer): the scores match the float64 reference with the -inf tail, the append bytes equal the reference's."""
    monkeypatch.setattr(bi, "TUNE_GRID", dict(block_t=(16, 32), num_stages=(2,), num_warps=(4,), programs_per_sm=(1,)))
    args = bi.parse_args(["--heads", "5", "--dim", "16", "--sets", "2", "--repeats", "1", "--q-dtype", "fp32", "--tune"])
    row = bi.cell_row(70, 2, index_dtype, args, bandwidth=1e12, seed=3, device="cpu", timer=host_time_us)
    assert row["checks_pass"] and row["score_tail_ok"] and row["append_equal"] and row["score_rel_err"] < 1e-5
    assert row["sets"] == 2 and row["score_bytes"] == bi.score_bytes(2, 70, 5, 16, index_dtype, 4)
    for key in ("score_us", "torch_fp32_us", "torch_bf16_us", "append_us", "append_torch_us"):
        assert row[key] > 0, (key, row.get(f"{key}_error"))
    assert row["tune_all_equal_default"] and row["tune_worst_rel_err"] < 1e-5
    assert row["tuned_best"] in ("t16_s2_w4_p1", "t32_s2_w4_p1") and row["tuned_us"] > 0
    assert "| 70 | 2 |" in bi.table([row])
