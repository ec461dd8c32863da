"""The CPU-testable parts of experiments/bench_read_latency.py: arguments, the line fit, the tables.
(The reads and chains themselves need a GPU.)"""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_read_latency", ROOT / "experiments" / "bench_read_latency.py")
rl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rl)


def test_fit_line_recovers_intercept_and_slope():
    a, b = rl.fit_line([1.0, 2.0, 4.0, 8.0], [1.6 + 1.01 * n for n in (1, 2, 4, 8)])
    assert a == pytest.approx(1.6) and b == pytest.approx(1.01)


def test_stage_split_is_metadata_then_the_rest_of_the_stage():
    """The stage rows read bench_flashinfer.py's serial-stage bytes, metadata first: the Quest
    metadata the engine keeps (graph_decode.metadata_bytes_per_block), then K/V of A and the rest."""
    import torch

    from prr.runtime.graph_decode import metadata_bytes_per_block

    bf = rl.flashinfer_bench()
    per_block = metadata_bytes_per_block("quest", torch.bfloat16, bf.D)
    assert (131072, 16, 2048) in rl.STAGE_CELLS and len(rl.STAGE_CELLS) == 8
    for context, block, budget in rl.STAGE_CELLS:
        meta, kv = rl.stage_split(bf, context, block, budget, per_block)
        assert meta + kv == bf.stage_bytes(1, context, budget, block, per_block)
        assert meta == bf.HKV * (context // block) * 2 * bf.D * 2  # key max + min per block and KV head, bf16
        assert kv == 2 * bf.HKV * budget * bf.D * 2 + 2 * bf.HQ * bf.D * 2 + bf.HKV * (budget // block) * 4


def test_report_tables():
    record = {"command": "python experiments/bench_read_latency.py", "bandwidth_GBps": 4292.0,
              "environment": {"gpu": "NVIDIA H200", "driver": "580", "torch": "2.11", "triton": "3.6", "cuda": "13.0",
                              "date": "2026-12-02"},
              "read": [dict(bytes=8388608, us=3.9, GBps=2150.0, over_floor=2.0, kernel="BLOCK 2048")],
              "chain": [dict(n=1, us=1.68), dict(n=2, us=2.57)], "chain_fit_us": (0.61, 1.01),
              "stage": [dict(context=131072, block_size=64, budget_tokens=2048, meta_bytes=8388608, kv_bytes=8406016,
                             floor_us=3.91, fused_us=5.78, two_launch_us=7.76, four_launch_us=10.1,
                             fused_over_floor=1.48, two_over_floor=1.98, four_over_floor=2.59)]}
    text = rl.report(record)
    assert "`python experiments/bench_read_latency.py`" in text and "NVIDIA H200" in text
    assert "| 8388608 | 3.9 | 2.15e+03 | 2 | BLOCK 2048 |" in text
    assert "Fit: 0.61 + 1.01 n µs." in text
    assert "| 131072 | 64 | 2048 | 8388608 | 8406016 | 3.91 | 5.78 | 7.76 | 10.1 | 1.48 | 1.98 | 2.59 |" in text


def test_bad_repeats_exit_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        rl.parse_args(["--repeats", "0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "--repeats=0 must be >= 1" in err
