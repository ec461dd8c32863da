"""The CPU-testable parts of experiments/bench_tensor_parallel.py (its timings need GPUs and
torchrun): arguments, and the per-GPU byte floor it takes from prr.benchmarking."""

import importlib.util
from pathlib import Path

import pytest

from prr.benchmarking import decode_step_bytes
from prr.model.zoo import ZOO

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_tensor_parallel", ROOT / "experiments" / "bench_tensor_parallel.py")
btp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(btp)


def test_arguments_are_checked():
    assert btp.parse_args([]).contexts == [32768, 131072]
    for argv in (["--contexts", "1000"], ["--contexts", "256"], ["--repeats", "2"]):
        with pytest.raises(SystemExit):
            btp.parse_args(argv)


def test_floor_per_gpu_splits_layers_and_kv_but_not_the_head():
    c = ZOO["llama-3.1-8b-shape"].config
    one, two = (decode_step_bytes(c, [32512], False, world) for world in (1, 2))
    replicated = (c.vocab_size * c.hidden_size + c.hidden_size * (2 * c.num_layers + 2)) * 2  # head, embedding row, norms
    assert one - replicated == pytest.approx(2 * (two - replicated), rel=1e-6)
    assert 15.5e9 < one < 16.5e9 + 32 * 2 * 8 * 32513 * 128 * 2  # 8B in bf16 plus its 32K KV
    assert decode_step_bytes(c, [32512], True, 2) < two
