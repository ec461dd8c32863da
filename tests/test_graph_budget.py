"""The graph engine's profiled speculation choice (prr.runtime.graph_budget): controlled
predictions hit exactly the asked share of A, the profile's lookup, and its input checks.
The timing itself needs CUDA (-m gpu, TRITON_INTERPRET=0)."""

from __future__ import annotations

import os

import pytest
import torch

from prr.runtime.graph_budget import SpeculationProfile, controlled_predictions, profile_speculation
from prr.runtime.graph_decode import GraphDecoder, StaticPlan

GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()


@pytest.mark.parametrize("hit_rate", [1.0, 0.9, 0.68, 0.0])
def test_controlled_predictions_hit_exactly_the_asked_share(hit_rate):
    gen = torch.Generator().manual_seed(0)
    num_blocks, k = 97, 20
    idx = torch.stack([torch.randperm(num_blocks, generator=gen)[:k].sort().values for _ in range(6)]).view(2, 3, k)
    cnt = torch.tensor([[20, 13, 0], [7, 20, 1]], dtype=torch.int32)
    pred, pcnt = controlled_predictions((idx.int(), cnt), hit_rate, num_blocks, torch.Generator().manual_seed(1))
    for b in range(2):
        for h in range(3):
            a = set(idx[b, h, : int(cnt[b, h])].tolist())
            p = pred[b, h, : int(pcnt[b, h])].tolist()
            assert len(p) == len(a) == len(set(p))  # |P| = |A|, distinct
            assert p == sorted(p) and all(0 <= x < num_blocks for x in p)
            assert len(a & set(p)) == round(hit_rate * len(a))


def test_profile_lookup_takes_the_largest_profiled_context_not_above():
    profile = SpeculationProfile(rows=({"context": 1000, "choice": "serial"}, {"context": 4000, "choice": "prr"},
                                       {"context": 16000, "choice": "serial"}), key="k")
    assert [profile.choice(c) for c in (10, 1000, 3999, 4000, 15999, 10**6)] == \
        ["serial", "serial", "serial", "prr", "prr", "serial"]


def test_profile_speculation_checks_its_engine_and_inputs():
    from prr.model.config import ModelConfig
    from prr.model.decoder import Decoder

    config = ModelConfig(arch="llama", vocab_size=97, hidden_size=128, intermediate_size=160, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=10000.0, rope_scaling=None,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=4096)
    model = Decoder(config, torch.float32, "cpu").init_random_(seed=0)
    serial = GraphDecoder(model, StaticPlan(variant="serial", topk_blocks=4), batch=1, max_tokens=256)
    with pytest.raises(ValueError, match="variant='prr', predictor='fixed'"):
        profile_speculation(serial, [100])
    fixed = GraphDecoder(model, StaticPlan(variant="prr", predictor="fixed", topk_blocks=4, predicted_blocks=4),
                         batch=1, max_tokens=256)
    with pytest.raises(ValueError, match="contexts="):
        profile_speculation(fixed, [300])


def test_profile_speculation_on_the_cpu_times_both_by_the_host_clock_and_caches(tmp_path, monkeypatch):
    """No CUDA graphs on the CPU: both variants are timed eagerly by the host clock (under the
    interpreter: a test of the machinery, each row says which timer), the choice follows the
    margin rule, and a second call reads the cached table."""
    from prr.model.config import ModelConfig
    from prr.model.decoder import Decoder

    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    config = ModelConfig(arch="llama", vocab_size=97, hidden_size=128, intermediate_size=160, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=10000.0, rope_scaling=None,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=4096)
    model = Decoder(config, torch.float32, "cpu").init_random_(seed=0)
    engine = GraphDecoder(model, StaticPlan(variant="prr", predictor="fixed", topk_blocks=4, predicted_blocks=4,
                                            dense_layers=(0,)), batch=1, max_tokens=160)
    profile = profile_speculation(engine, [70, 130], margin=0.05)
    assert [r["context"] for r in profile.rows] == [70, 130]
    for row in profile.rows:
        assert row["timer"] == "cpu_wall_clock" and row["serial_us"] > 0 and row["prr_us"] > 0
        assert row["choice"] == ("prr" if row["prr_us"] < 0.95 * row["serial_us"] else "serial")
    assert profile.choice(100) == profile.rows[0]["choice"] and profile.choice(10) == profile.rows[0]["choice"]
    assert engine.plan.variant == "prr"  # the engine's plan is left as it was built
    assert len(list((tmp_path / "budget").glob("graph-*.json"))) == 1
    assert profile_speculation(engine, [70, 130], margin=0.05).rows == profile.rows  # read back, not re-timed


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
def test_profile_speculation_on_the_gpu_times_both_and_caches(tmp_path, monkeypatch):
    from prr.model.config import ModelConfig
    from prr.model.decoder import Decoder

    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    config = ModelConfig(arch="llama", vocab_size=97, hidden_size=256, intermediate_size=320, num_layers=3,
                         num_heads=8, num_kv_heads=2, head_dim=128, rope_theta=10000.0, rope_scaling=None,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=65536)
    model = Decoder(config, torch.bfloat16, "cuda").init_random_(seed=0)
    engine = GraphDecoder(model, StaticPlan(variant="prr", predictor="fixed", topk_blocks=64, predicted_blocks=64),
                          batch=1, max_tokens=32768)
    profile = profile_speculation(engine, [4000, 30000])
    assert [r["context"] for r in profile.rows] == [4000, 30000]
    assert all(r["serial_us"] > 0 and r["prr_us"] > 0 and r["choice"] in ("prr", "serial") for r in profile.rows)
    again = profile_speculation(engine, [30000, 4000])  # same key: read from the cache, nothing timed
    assert again.rows == profile.rows
