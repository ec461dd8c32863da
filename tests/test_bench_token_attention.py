"""The CPU-testable parts of experiments/bench_token_attention.py: arguments, grid, byte floor, tables, the
refusal on a CPU, and one small cell's checks run end to end under TRITON_INTERPRET=1 (a stand-in timer:
no speed is measured here)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_token_attention",
                                               ROOT / "experiments" / "bench_token_attention.py")
bt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bt)


def test_defaults_are_the_issue_grid():
    args = bt.parse_args([])
    assert args.tokens == [256, 1024, 2048, 4096] and args.batches == [1, 8, 32]
    assert args.contexts == [32768, 131072] and args.tiles == [64, 128]
    assert len(bt.cells(args)) == 4 * 3 * 2
    quick = bt.parse_args(["--quick", "--batches", "4"])
    assert quick.tokens == [2048] and quick.batches == [4] and quick.contexts == [32768]
    assert bt.cells(bt.parse_args(["--tokens", "256,4096", "--contexts", "1024"])) == [(1024, b, 256) for b in (1, 8, 32)]


@pytest.mark.parametrize("argv, needle", [
    (["--tokens", "100"], "not a multiple of 16"),
    (["--contexts", "1000"], "--contexts: 1000 is not a multiple of 16"),
    (["--tiles", "48"], "--tiles: 48 is not a power of two >= 16"),
    (["--tokens", "4096", "--contexts", "2048"], "no cell lists at most its context"),
    (["--sets", "0"], "--sets=0 must be >= 1"),
    (["--batches", "1,x"], "comma-separated list of integers"),
    (["--no-such-flag"], "unrecognized"),
])
def test_bad_arguments_exit_2_with_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        bt.parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and err.startswith("bench_token_attention: error:")


@pytest.mark.parametrize("interpret, needle", [("0", "needs a CUDA GPU"), ("1", "unset TRITON_INTERPRET")])
def test_refuses_on_a_cpu_in_one_line(interpret, needle):
    if torch.cuda.is_available() and interpret == "0":
        pytest.skip("a GPU is here: the script would run")
    env = {**os.environ, "TRITON_INTERPRET": interpret, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_token_attention.py"), "--quick"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and needle in done.stderr and done.stderr.startswith("error:")


def test_bytes_and_sets():
    # batch 1, 2,048 tokens: K and V rows of 8 heads x 2048 tokens x 128 x bf16, q and out of 32 heads
    assert bt.attention_bytes(1, 2048) == 2 * 8 * 2048 * 128 * 2 + 2 * 32 * 128 * 2
    assert bt.attention_bytes(32, 4096) == 32 * bt.attention_bytes(1, 4096)
    assert bt.timing_sets(32, 4096, 4) == 4  # 268 MB a call: the minimum
    assert bt.timing_sets(1, 2048, 4) == 16  # 8.4 MB a call: 16 pass 128 MiB
    assert bt.timing_sets(1, 256, 4) == 127 and bt.timing_sets(1, 64, 4) == bt.MAX_SETS  # small cells: capped


def test_table_shows_ratios_best_tile_and_failures():
    row = dict(batch=1, context=32768, tokens=2048, splits=16, tile=32, token_us=6.0, token_fused_us=5.0,
               token_shared_us=6.1, token_tile64_us=5.5, token_tile128_us=7.0, block16_us=5.0, gather_sdpa_us=40.0,
               floor_us=3.0, checks=True)
    failed = dict(batch=8, context=32768, tokens=2048, error="RuntimeError: boom")
    lines = bt.table([row, failed]).splitlines()
    assert "| 16 x 32 | 6 | 5 | 6.1 | 64 (5.5) | 5 | 40 | 3 | 2 | 1.67 | 13.3 | 1.2 | yes |" in lines[2]
    assert "RuntimeError: boom" in lines[3]
    assert bt.best_tile(dict(token_tile64_us=None)) == (None, None)


def test_one_cell_checks_pass_under_the_interpreter(tmp_path):
    """cell_row at a tiny size on the CPU (8B heads, 32 tokens of 96): the reference, SDPA, shared-list and
    block-kernel checks pass; every timed column calls its function (the stand-in timer runs set 0 once)."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(1, bt.HKV, 96, bt.D, generator=gen).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(1, bt.HQ, bt.D, generator=gen).to(torch.bfloat16)
    called = []

    def stand_in(make_call, sets, repeats):
        make_call(0)()
        called.append(sets)
        return float(len(called))

    row = bt.cell_row(k_cache, v_cache, q, 32, [16], 2, 1, 1e12, gen, timer=stand_in)
    assert row["checks"] is True, {k: v for k, v in row.items() if "_vs_" in k}
    assert not [k for k in row if k.endswith("_error")]
    assert [row[k] for k in ("token_us", "token_fused_us", "token_shared_us", "token_tile16_us", "block16_us",
                             "gather_sdpa_us")] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert row["floor_us"] == bt.attention_bytes(1, 32) / 1e12 * 1e6 and row["sets"] == bt.MAX_SETS
    record = {"command": "python experiments/bench_token_attention.py --quick", "environment": {"gpu": "none"},
              "rows": [row]}
    text = bt.write_outputs(record, tmp_path / "bench")
    assert "| 1 | 96 | 32 |" in text and (tmp_path / "bench.csv").read_text().startswith("command,batch,")
