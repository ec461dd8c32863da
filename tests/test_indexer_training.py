"""The lightning indexer's weights and distillation: the prefill scores are DeepSeek-V3.2's formula
and causal, the capture reproduces the model's forward, the KL falls as it trains, a trained
indexer's top-k recalls more attention mass than random selection and than before training, the
file round-trips and a changed file, config or model shape is refused."""

import math

import pytest
import torch

from prr.model.dense import DenseAttention
from prr.model.loading import load_model
from prr.model.rope import rope_inv_freq
from prr.selectors.indexer_training import (
    capture,
    capture_targets,
    evaluate,
    head_mean_attention,
    kl_per_query,
    quest_recall,
    train,
)
from prr.selectors.indexer_weights import IndexerConfig, IndexerWeights, indexer_weights_file, load_indexer
from prr.selectors.less_training import text_windows

CONFIG = IndexerConfig(index_heads=3, index_dim=10, rope_dim=4, dense_layers=())


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def peaked_tiny():
    """tiny-random re-drawn at std 0.2: its std-0.02 attention is near uniform (the oracle's top-8 of
    96 keys recalls 0.156 of the mass, 8 random keys 0.152), with nothing for an indexer to find."""
    loaded = load_model("tiny-random")
    loaded.decoder.init_random_(seed=0, std=0.2)
    return loaded, capture(loaded, text_windows(loaded, 10, 96, seed=0), list(range(loaded.config.num_layers)))


@torch.no_grad()
def reference_scores(layer, x, inv_freq, rope_dim):
    """The score as an explicit loop over query i, key j and head h (DeepSeek-V3.2's formula)."""
    t_len = x.shape[0]
    h_i, d_i = layer.ww.shape[0], layer.wk.shape[0]

    def rope(v, pos):  # rotate-half RoPE on the first rope_dim dims
        angles = pos * inv_freq  # [rope_dim / 2]
        half = rope_dim // 2
        a, b = v[:half], v[half:rope_dim]
        return torch.cat((a * angles.cos() - b * angles.sin(), b * angles.cos() + a * angles.sin(), v[rope_dim:]))

    out = torch.full((t_len, t_len), float("-inf"), dtype=torch.float64)
    for i in range(t_len):
        q = (layer.wq.double() @ x[i]).view(h_i, d_i)
        w = layer.ww.double() @ x[i]
        for j in range(i + 1):
            k = layer.wk.double() @ x[j]
            k = (k - k.mean()) / torch.sqrt(k.var(unbiased=False) + 1e-6) * layer.key_norm_weight.double() \
                + layer.key_norm_bias.double()
            k = rope(k, j)
            out[i, j] = sum(w[h] * max(0.0, float(rope(q[h], i) @ k)) for h in range(h_i))
    return out


def test_scores_are_the_formula_and_causal():
    torch.manual_seed(0)
    mc = load_model("tiny-random").config
    indexer = IndexerWeights.for_model(mc, CONFIG, seed=3)
    layer = indexer.layer(1)
    with torch.no_grad():
        layer.key_norm_weight.add_(0.3 * torch.randn_like(layer.key_norm_weight))
        layer.key_norm_bias.add_(0.3 * torch.randn_like(layer.key_norm_bias))
    x = torch.randn(2, 13, mc.hidden_size)
    scores = indexer.scores(1, x)
    assert scores.shape == (2, 13, 13)
    inv_freq = rope_inv_freq(CONFIG.rope_dim, mc.rope_theta, mc.rope_scaling)
    want = reference_scores(layer, x[1].double(), inv_freq.double(), CONFIG.rope_dim)
    torch.testing.assert_close(scores[1].double(), want, rtol=1e-4, atol=1e-5)
    # Causal: changing a later token changes no earlier query's scores.
    x2 = x.clone()
    x2[:, 9:] += torch.randn_like(x2[:, 9:])
    torch.testing.assert_close(indexer.scores(1, x2)[:, :9, :9], scores[:, :9, :9])
    # Some query positions only: the same rows.
    pos = torch.tensor([0, 4, 12])
    torch.testing.assert_close(indexer.scores(1, x, pos), scores[:, pos])


def test_random_init_is_seeded_and_shaped_by_the_model():
    mc = load_model("tiny-random").config
    a = IndexerWeights.for_model(mc, IndexerConfig(index_heads=4, index_dim=8, rope_dim=2, dense_layers=(0,)), seed=5)
    b = IndexerWeights.for_model(mc, IndexerConfig(index_heads=4, index_dim=8, rope_dim=2, dense_layers=(0,)), seed=5)
    assert a.sparse_layers == [1] and list(a.layers) == ["1"]
    layer = a.layer(1)
    assert layer.wq.shape == (32, mc.hidden_size) and layer.ww.shape == (4, mc.hidden_size)
    assert layer.wk.shape == (8, mc.hidden_size) and layer.key_norm_bias.shape == (8,)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    # DeepSeek's H_I^-1/2 d_I^-1/2 is folded into W_w: its scale is that of W_q times it.
    ratio = layer.ww.std() / layer.wq.std()
    assert abs(ratio.item() * math.sqrt(4 * 8) - 1) < 0.3
    with pytest.raises(KeyError, match=r"layer 0 has no indexer: the sparse layers are \[1\]"):
        a.layer(0)
    with pytest.raises(ValueError, match="rope_dim=3 must be even"):
        IndexerConfig(rope_dim=3)
    # The 8B shape for latency studies (shapes only here): 30 sparse layers of DeepSeek's 64 x 128.
    from prr.model.zoo import LLAMA31_8B_SHAPE

    big = IndexerWeights.for_model(LLAMA31_8B_SHAPE.config, IndexerConfig(), seed=0, dtype=torch.bfloat16, device="meta")
    assert big.sparse_layers == list(range(2, 32))
    assert big.layer(2).wq.shape == (64 * 128, 4096) and big.layer(2).wq.dtype == torch.bfloat16


def test_capture_is_the_model_forward_and_the_target_a_distribution():
    loaded = load_model("tiny-random")
    ids = text_windows(loaded, 1, 37, seed=1)[0]
    window, hidden = capture_targets(loaded, ids, [1])
    logits = loaded.decoder(ids[None], 0, DenseAttention(loaded.config.num_layers))
    torch.testing.assert_close(loaded.decoder.lm_head(hidden), logits)
    x, target = window[1].x, window[1].target
    assert window[1].q.shape == (6, 37, 16) and window[1].k.shape == (2, 37, 16)  # post-RoPE, for Quest
    assert list(window) == [1] and x.shape == (37, loaded.config.hidden_size) and target.shape == (37, 37)
    torch.testing.assert_close(target.sum(-1), torch.ones(37))
    assert torch.all(target.triu(1) == 0)
    q, k = torch.randn(4, 5, 8), torch.randn(2, 5, 8)
    per_head = [torch.softmax((q[h] @ k[h // 2].T / math.sqrt(8)).masked_fill(torch.ones(5, 5).triu(1).bool(),
                                                                                float("-inf")), -1) for h in range(4)]
    torch.testing.assert_close(head_mean_attention(q, k), sum(per_head) / 4)


def test_kl_is_zero_at_the_target_and_positive_elsewhere():
    scores = torch.tensor([[0.3, float("-inf")], [1.0, -2.0]])
    target = torch.softmax(scores, -1)
    torch.testing.assert_close(kl_per_query(target, scores), torch.zeros(2))
    assert torch.all(kl_per_query(target, torch.zeros(2, 2).masked_fill(torch.isinf(scores), float("-inf")))[1:] > 0)


def test_distillation_lowers_the_kl_and_beats_random_selection(peaked_tiny):
    loaded, data = peaked_tiny
    indexer = IndexerWeights.for_model(loaded.config, IndexerConfig(index_heads=4, index_dim=16, rope_dim=8,
                                                                    dense_layers=()), seed=0)
    before = evaluate(indexer, data[8:], [8], queries=32, block_size=8)  # two held-out windows
    history = train(indexer, data[:8], 40, queries=16, lr=3e-3, progress=False)
    after = evaluate(indexer, data[8:], [8], queries=32, block_size=8)
    assert sum(history[-10:]) < 0.9 * sum(history[:10]), history
    assert sum(after["kl"]) < sum(before["kl"]), (before["kl"], after["kl"])
    recall = {name: sum(v) / len(v) for name, v in after["recall"][8].items()}
    recall_before = sum(before["recall"][8]["indexer"]) / 2
    # The defining property: the trained indexer's top-k holds more of the layer's attention mass
    # than k random keys and than its top-k before training (held-out windows).
    assert recall["indexer"] > recall["random"] + 0.03 and recall["indexer"] > recall_before + 0.02, (recall,
                                                                                                      recall_before)
    assert recall["indexer"] <= recall["oracle"] + 1e-6


def test_weights_round_trip_and_changes_are_refused(cache_root):
    mc = load_model("tiny-random").config
    indexer = IndexerWeights.for_model(mc, CONFIG, seed=1)
    path = indexer_weights_file("tiny-random", CONFIG)
    assert path.parent == cache_root / "indexer" and path.suffix == ".safetensors"
    with pytest.raises(FileNotFoundError, match="make train-indexer MODEL=tiny-random ARGS='--index-heads 3"):
        load_indexer("tiny-random", mc, CONFIG)
    digest = indexer.save(path, {"model": "tiny-random"})
    assert not list(path.parent.glob("*.tmp")) and len(digest) == 64
    loaded = load_indexer("tiny-random", mc, CONFIG)
    x = torch.randn(1, 11, mc.hidden_size)
    for layer in indexer.sparse_layers:
        torch.testing.assert_close(loaded.scores(layer, x), indexer.scores(layer, x).detach())
    assert loaded.meta == {"model": "tiny-random"}
    # Another config is another file; another model shape under this name is refused.
    assert indexer_weights_file("tiny-random", IndexerConfig(index_heads=4, index_dim=10, rope_dim=4,
                                                             dense_layers=())) != path
    with pytest.raises(ValueError, match="made for .* not model 'tiny-random'"):
        load_indexer("tiny-random", load_model("tiny-random-d64").config, CONFIG)
    # One flipped byte in the tensors: refused in one line naming the file and the fix.
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"sha256 .* is not the .* its header records \(changed or corrupt\); "
                                         r"delete it and rerun `make train-indexer MODEL=tiny-random") as err:
        load_indexer("tiny-random", mc, CONFIG)
    assert "\n" not in str(err.value)


def test_quest_recall_is_the_mass_on_its_blocks(peaked_tiny):
    """Quest's baseline: the group-mean mass on the sink block, the query's own block and the rest
    of its K blocks; more blocks recall more, and K covering every block before the query's own
    block but one leaves exactly one block's mass out."""
    _, data = peaked_tiny
    capture = data[0][1]
    pos = torch.tensor([47, 80, 95])  # own blocks 5, 10, 11 of 8 tokens
    recalls = [quest_recall(capture, pos, 8 * budget, 8) for budget in (1, 2, 3, 5)]
    assert all(torch.all(a <= b + 1e-6) for a, b in zip(recalls, recalls[1:], strict=False))
    assert torch.all(recalls[-1] <= 1 + 1e-6) and torch.all(recalls[0] > 0)
    with pytest.raises(ValueError, match="k = 12 is not a multiple of block_size 8"):
        quest_recall(capture, pos, 12, 8)


def test_the_cli_trains_stores_and_evaluates_the_stored_indexer(cache_root, capsys):
    """`make train-indexer`'s command end to end on tiny-random: progress, the recall table, a file
    whose header holds the run; --evaluate-only loads that file and scores the same held-out window."""
    from prr.selectors.indexer_training import main

    args = ["--model", "tiny-random", "--index-heads", "2", "--index-dim", "8", "--rope-dim", "4", "--dense-layers",
            "1", "--windows", "3", "--held-out", "1", "--window-tokens", "64", "--steps", "4", "--queries", "4",
            "--eval-k", "16", "--block-size", "8", "--device", "cpu"]
    path = main(args)
    out = capsys.readouterr().out
    assert "step 4/4  KL" in out and "top-16 tokens: indexer before training" in out and "wrote " in out
    stored = load_indexer("tiny-random", load_model("tiny-random").config,
                          IndexerConfig(index_heads=2, index_dim=8, rope_dim=4, dense_layers=(1,)))
    assert stored.sparse_layers == [0] and stored.meta["args"]["steps"] == 4
    assert path == indexer_weights_file("tiny-random", stored.config)
    main([*args, "--evaluate-only"])
    after = stored.meta["held_out"]["recall"]["16"]["indexer"]
    assert f"top-16 tokens: indexer {after:.3f}" in capsys.readouterr().out
    # --resume trains the stored weights further: its "before" is the stored indexer's recall, the steps add up
    main([*args, "--resume"])
    assert f"indexer before training {after:.3f}" in capsys.readouterr().out
    resumed = load_indexer("tiny-random", load_model("tiny-random").config, stored.config)
    assert resumed.meta["steps_total"] == 8 and resumed.meta["earlier"]["args"]["steps"] == 4
    assert not torch.equal(resumed.layer(0).wq, stored.layer(0).wq)
    with pytest.raises(SystemExit):
        main([*args, "--resume", "--evaluate-only"])


def test_a_decode_step_scores_as_the_prefill_row():
    """What the decode kernels compute: the step's q_I and w at its position, one key per token
    appended at its own position, index_scores over them = the prefill's row for that query."""
    from prr.selectors.indexer_weights import index_scores

    mc = load_model("tiny-random").config
    indexer = IndexerWeights.for_model(mc, CONFIG, seed=2)
    layer, inv_freq = indexer.layer(0), indexer.inv_freq
    x = torch.randn(1, 19, mc.hidden_size)
    prefill = indexer.scores(0, x)
    cache = torch.cat([layer.keys(x[:, j : j + 1], torch.tensor([j]), inv_freq) for j in range(19)], dim=1)  # [1, 19, d_I]
    for t in (0, 7, 18):
        step = x[:, t : t + 1]
        got = index_scores(layer.queries(step, torch.tensor([t]), inv_freq), layer.head_weights(step), cache[:, : t + 1])
        torch.testing.assert_close(got[0, 0], prefill[0, t, : t + 1].detach())


def test_dead_relus_are_measured_and_warned_about(peaked_tiny, capsys):
    """A random indexer passes about half its (query, key, head) pairs through the ReLU; one whose
    queries point away from every key (W_q = 0: q·k = 0 everywhere) passes none, and the report
    says so with the fix (a lower --lr), as Qwen2.5-Coder-0.5B's at lr 3e-3 did."""
    from types import SimpleNamespace

    from prr.selectors.indexer_training import active_fraction, report

    loaded, data = peaked_tiny
    indexer = IndexerWeights.for_model(loaded.config, IndexerConfig(index_heads=4, index_dim=16, rope_dim=8,
                                                                    dense_layers=()), seed=0)
    pos = torch.tensor([20, 50, 95])
    alive = active_fraction(indexer, 0, data[8][0].x, pos)
    assert 0.3 < alive < 0.7, alive
    args = SimpleNamespace(window_tokens=96, block_size=8, lr=3e-3)
    report(None, evaluate(indexer, data[8:], [8], queries=16, block_size=8), [8], args)
    assert "WARNING" not in capsys.readouterr().out
    with torch.no_grad():
        for layer in indexer.layers.values():
            layer.wq.zero_()
    assert active_fraction(indexer, 0, data[8][0].x, pos) == 0.0
    dead = evaluate(indexer, data[8:], [8], queries=16, block_size=8)
    report(None, dead, [8], args)
    out = capsys.readouterr().out
    assert "(ReLU passing): 0.0%" in out and "WARNING: the indexer's ReLUs are dead" in out and "lower --lr" in out
