"""budget=profiled's engine probe (prr.runtime.graph_budget.GraphProbe): controlled
predictions hit exactly the asked share of A, and the probe times selection, speculation and
the whole stage on the engine itself (the host clock on the CPU, under the interpreter: a
test of the machinery), rebuilding its engine for another |P|, so ProfiledBudget's one rule
runs over it. The device timing needs CUDA (-m gpu, TRITON_INTERPRET=0)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from prr.blocks import controlled_predictions
from prr.budget.profiled import ProfiledBudget
from prr.runtime.graph_budget import GraphProbe
from prr.runtime.graph_decode import GraphDecoder, StaticPlan
from tests.helpers import graph_selector

GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()


@pytest.mark.parametrize("hit_rate", [1.0, 0.9, 0.68, 0.0])
@pytest.mark.parametrize("size", [None, 9, 30])
def test_controlled_predictions_hit_exactly_the_asked_share(hit_rate, size):
    gen = torch.Generator().manual_seed(0)
    num_blocks, k = 97, 20
    idx = torch.stack([torch.randperm(num_blocks, generator=gen)[:k].sort().values for _ in range(6)]).view(2, 3, k)
    cnt = torch.tensor([[20, 13, 0], [7, 20, 1]], dtype=torch.int32)
    pred, pcnt = controlled_predictions((idx.int(), cnt), hit_rate, num_blocks, torch.Generator().manual_seed(1),
                                        size=size)
    assert pred.shape[-1] == max(k, size or 0)
    for b in range(2):
        for h in range(3):
            a = set(idx[b, h, : int(cnt[b, h])].tolist())
            p = pred[b, h, : int(pcnt[b, h])].tolist()
            n = len(a) if size is None else size
            assert len(p) == n == len(set(p))  # |P| as asked, distinct
            assert p == sorted(p) and all(0 <= x < num_blocks for x in p)
            assert len(a & set(p)) == round(hit_rate * min(len(a), n))


def tiny_model(device: str = "cpu", dtype=torch.float32, head_dim: int = 64, layers: int = 2):
    from prr.model.config import ModelConfig
    from prr.model.decoder import Decoder

    config = ModelConfig(arch="llama", vocab_size=97, hidden_size=128, intermediate_size=160, num_layers=layers,
                         num_heads=4, num_kv_heads=2, head_dim=head_dim, rope_theta=10000.0, rope_scaling=None,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=65536)
    return Decoder(config, dtype, device).init_random_(seed=0)


def test_graph_probe_times_the_engine_and_profiled_runs_over_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    model = tiny_model()
    plan = StaticPlan(variant="prr", predicted_blocks=4)
    built = []

    def build(n):
        built.append(n)
        return GraphDecoder(model, dataclasses.replace(plan, predicted_blocks=n), batch=1, max_tokens=160,
                            backend="torch", selector=graph_selector("quest", 4, dense_layers=(0,)), predictor=None)
    probe = GraphProbe(build, first_size=4, repeats=3)
    assert json.loads(probe.shape_key)["timer"] == "cpu_wall_clock"
    for timing in (probe.time_select(6), probe.time_speculate(3, 6), probe.time_stage(6, 0, 0.9)):
        assert timing.median_s > 0
    assert built == [4]
    assert probe.time_stage(6, 5, 0.9).median_s > 0 and built == [4, 5]  # another |P|: another engine
    engine = probe.engine(5)
    assert engine.plan.predicted_blocks == 5 and int(engine.pred_cnt[1].max()) == 5
    assert probe.time_stage(6, 2, 0.9).median_s > 0 and built == [4, 5, 2]  # |P| below |A|

    # (any spread is "steady" here: sub-millisecond CPU timings on a busy machine spread more than 2x,
    # and this test is of the machinery, not of the timings)
    budget = ProfiledBudget(ratios=[0.5, 1.0], use_cache=True, max_spread=1e9)
    info = budget.setup(probe, selected_blocks=4, max_blocks=10, contexts=[6])
    assert info["profile_source"] == "measured" and set(info["profile_choice"]) == {"6"}
    row = info["profile_measurements"][0]
    assert set(row["t_speculate_s"]) == {2, 4} and row["hidden_blocks"] in (0, 2, 4)
    faster = row["stage_prr_s"] < 0.98 * row["stage_serial_s"]  # the stage check ran at every |P| and decided
    assert info["profile_choice"]["6"] == (row["stage_best_blocks"] if faster else 0)
    again = ProfiledBudget(ratios=[0.5, 1.0], use_cache=True, max_spread=1e9)
    assert again.setup(probe, selected_blocks=4, max_blocks=10, contexts=[6])["profile_source"] == "cache"
    probe.release()


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
def test_graph_probe_on_the_gpu_times_graph_replays_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    model = tiny_model("cuda", torch.bfloat16, head_dim=128, layers=3)
    plan = StaticPlan(variant="prr", predicted_blocks=64)
    probe = GraphProbe(lambda n: GraphDecoder(model, dataclasses.replace(plan, predicted_blocks=n), batch=1,
                                              max_tokens=32768, selector=graph_selector("quest", 64), predictor=None),
                       first_size=64)
    assert json.loads(probe.shape_key)["timer"] == "cuda_graph_replay"
    budget = ProfiledBudget()
    info = budget.setup(probe, selected_blocks=64, max_blocks=2048, contexts=[250, 1875])
    assert [r["context_blocks"] for r in info["profile_measurements"]] == [250, 1875]
    assert all(r["t_select_s"] > 0 for r in info["profile_measurements"])
    again = ProfiledBudget().setup(probe, selected_blocks=64, max_blocks=2048, contexts=[1875, 250])
    assert again["profile_source"] == "cache" and again["profile_choice"] == info["profile_choice"]
