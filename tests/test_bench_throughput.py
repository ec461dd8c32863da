"""The CPU-testable parts of experiments/bench_throughput.py: its cells and byte floors (the
timings themselves need a GPU: without one the script stops with one line)."""

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

from prr.benchmarking import decode_step_bytes
from prr.model.decoder import Decoder
from prr.model.zoo import ZOO

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_throughput", ROOT / "experiments" / "bench_throughput.py")
bt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bt)


def tiny_8b_shape() -> Decoder:
    """The 8B shape's heads and head_dim with 3 layers and a small vocab and hidden size."""
    config = dataclasses.replace(ZOO["llama-3.1-8b-shape"].config, num_layers=3, vocab_size=97, hidden_size=64,
                                 intermediate_size=32)
    return Decoder(config, torch.bfloat16, "cpu")


def test_cells_cover_the_issue_grid():
    got = {(kind, len(tokens), tuple(sorted(set(tokens)))) for kind, tokens in bt.cells(quick=False)}
    assert {("uniform", b, (32768,)) for b in (1, 8, 32, 64)} <= got
    assert ("uniform", 1, (131072,)) in got and ("mixed", 8, (8192, 65536)) in got
    mixed = [tokens for kind, tokens in bt.cells(quick=False) if kind == "mixed"]
    assert all(tokens.count(8192) == tokens.count(65536) for tokens in mixed)


def test_step_floor_counts_weights_once_and_each_rows_own_bytes():
    model = tiny_8b_shape()
    c = model.config
    per_token = 2 * c.num_kv_heads * c.head_dim * 2  # K and V, bf16, one layer
    one, two = decode_step_bytes(c, [4000], False), decode_step_bytes(c, [4000, 100], False)
    emb_row = c.hidden_size * 2
    assert two - one == c.num_layers * 101 * per_token + emb_row  # the second row's KV in every layer
    # The weights the formula counts are the model's parameters, less the embedding rows not read.
    params = sum(p.numel() for p in model.parameters()) * 2
    assert one - c.num_layers * 4001 * per_token == params - (c.vocab_size - 1) * c.hidden_size * 2
    # Sparse: the dense layers read the whole KV, the others metadata (Quest: max and min per block)
    # and at most K tokens of KV.
    sparse = decode_step_bytes(c, [4000], True)
    weights = one - c.num_layers * 4001 * per_token
    meta = c.num_kv_heads * (4000 // 16 + 1) * 2 * c.head_dim * 2
    assert sparse == weights + 2 * 4001 * per_token + (c.num_layers - 2) * (meta + 2048 * per_token)
    assert decode_step_bytes(c, [40000], True) < decode_step_bytes(c, [40000], False)


def test_without_a_gpu_it_stops_with_one_line():
    if torch.cuda.is_available():
        return
    done = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_throughput.py"), "--quick"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "needs a CUDA GPU" in done.stderr and done.stderr.count("\n") == 1
