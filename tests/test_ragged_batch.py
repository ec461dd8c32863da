"""Ragged batches in the graph engine (CPU, backend="torch", fp32): rows of different context
lengths decode, token for token and selection for selection, what each row decodes alone."""

from __future__ import annotations

import os

import pytest
import torch
from torch import Tensor

from prr.cache import PagedKVCache
from prr.model.config import ModelConfig
from prr.model.decoder import Decoder
from prr.runtime.graph_decode import GraphDecoder, StaticPlan
from prr.selectors import LessSelector, QuestSelector
from tests.helpers import graph_predictor, graph_selector

CONFIG = ModelConfig(arch="llama", vocab_size=61, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=16, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-5,
                     tie_word_embeddings=False, max_position_embeddings=512)
LENGTHS = [37, 90, 61]  # blocks of 8: each row crosses block boundaries at its own steps
STEPS = 13
MAX_TOKENS = 128


def context(seed: int = 7, config: ModelConfig = CONFIG):
    """Random K/V [3, Hkv, T, D] per layer (zero past each row's length), first tokens [3],
    InfLLM catch-up queries [3, Hkv, G, D]."""
    gen = torch.Generator().manual_seed(seed)
    shape = (len(LENGTHS), config.num_kv_heads, MAX_TOKENS, config.head_dim)
    keys, values = [], []
    for _ in range(config.num_layers):
        k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        for b, n in enumerate(LENGTHS):
            k[b, :, n:], v[b, :, n:] = 0, 0
        keys.append(k)
        values.append(v)
    tokens = torch.randint(0, config.vocab_size, (len(LENGTHS),), generator=gen)
    group = config.num_heads // config.num_kv_heads
    query = torch.randn(len(LENGTHS), config.num_kv_heads, group, config.head_dim, generator=gen)
    return keys, values, tokens, query


def decode(plan: StaticPlan, rows: list[int], selector_of, predictor: str = "fixed", backend: str = "torch",
           config: ModelConfig = CONFIG):
    """Greedy decode of the rows `rows` of `context()` in one batch, by an engine with the
    selector selector_of() and graph_predictor(predictor) -> (tokens [B, STEPS],
    [metadata after start_at, per step and sparse layer (A indices [B, Hkv, K], counts [B, Hkv],
    next P's indices [B, Hkv, |P|], counts [B, Hkv] or None, None)..., metadata at the end])."""
    model = Decoder(config, torch.float32, "cpu").init_random_(seed=3, std=0.3)
    engine = GraphDecoder(model, plan, batch=len(rows), max_tokens=MAX_TOKENS, backend=backend, selector=selector_of(),
                          predictor=graph_predictor(predictor))
    keys, values, tokens, query = context(config=config)
    lengths = [LENGTHS[b] for b in rows]
    engine.fill_from_cache([k[rows] for k in keys], [v[rows] for v in values], lengths if len(rows) > 1 else lengths[0],
                           tokens[rows])
    engine.start_at(lengths, tokens[rows], query=query[rows])  # InfLLM's catch-up with each row's own query
    out, selections = [], [metadata(engine)]
    for _ in range(STEPS):
        engine.step(advance=True)
        out.append(engine.token[:, 0].clone())
        selections.append([(*(t.clone() for t in engine.last_selection[layer]),
                            *((None, None) if engine.pred_cnt[layer] is None else
                              (engine.pred_idx[layer].clone(), engine.pred_cnt[layer].clone())))
                           for layer in range(engine.num_layers) if engine.sparse[layer]])
    assert engine.pos.tolist() == [n + STEPS for n in lengths]
    return torch.stack(out, 1), selections + [metadata(engine)]


def metadata(engine: GraphDecoder) -> list[tuple[Tensor, ...]]:
    """Every per-row metadata slot of the sparse layers, [B, ...] copies (Quest's key max / min,
    InfLLM's representatives and finalised counts)."""
    cache = engine.cache
    return [tuple(cache.metadata[layer][name].clone() for name in sorted(cache.per_row_slots[layer]))
            for layer in range(engine.num_layers) if engine.sparse[layer]]


def check_rows(batch: tuple, alone: list[tuple]) -> None:
    """Row b of the batch's `decode` equals alone[b]'s: tokens, selections and next P exactly,
    metadata exactly after start_at and closely after decoding."""
    batch_tokens, batch_sel = batch
    for b, (alone_tokens, alone_sel) in enumerate(alone):
        assert torch.equal(batch_tokens[b], alone_tokens[0]), f"row {b}"
        for step, (in_batch, single) in enumerate(zip(batch_sel, alone_sel, strict=True)):
            for layer, (mine, one) in enumerate(zip(in_batch, single, strict=True)):
                assert len(mine) == len(one) > 0
                for i, (x, y) in enumerate(zip(mine, one, strict=True)):
                    where = f"row {b}, entry {step}, sparse layer {layer}, tensor {i}"
                    if x is None:
                        continue
                    if step == len(batch_sel) - 1:  # decoded keys: batched projections round differently
                        assert torch.equal(torch.isfinite(x[b]), torch.isfinite(y[0])), where
                        torch.testing.assert_close(x[b], y[0], rtol=1e-4, atol=1e-4, msg=where)
                    else:
                        assert torch.equal(x[b], y[0]), where


PLANS = [
    ("quest", "serial", None), ("quest", "prr", "ema_membership"), ("quest", "prr", "last_step"),
    ("infllm", "serial", None), ("infllm", "prr", "last_step"),
]


def less() -> LessSelector:
    """LESS over Quest scores with its compensation: per-row running totals and centres."""
    return LessSelector(topk_blocks=4, sink_blocks=1, dense_layers=(0,), num_features=16)


@pytest.mark.parametrize("selector,variant,predictor", PLANS + [("less", "serial", None),
                                                                ("less", "prr", "ema_membership")])
def test_ragged_batch_decodes_what_each_row_decodes_alone(selector, variant, predictor):
    plan = StaticPlan(variant=variant, predicted_blocks=3, block_size=8, count_hits=True)
    chosen = less if selector == "less" else lambda: graph_selector(selector, 4, dense_layers=(0,))
    predictor = predictor or "fixed"  # (serial: no predictor)
    check_rows(decode(plan, [0, 1, 2], chosen, predictor),
               [decode(plan, [b], chosen, predictor) for b in range(len(LENGTHS))])


CONFIG64 = ModelConfig(arch="llama", vocab_size=61, hidden_size=128, intermediate_size=96, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=64, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, max_position_embeddings=512)


@pytest.mark.slow  # the kernels under TRITON_INTERPRET=1 (~1 min)
@pytest.mark.parametrize("variant", ["serial", "prr"])
def test_ragged_batch_on_the_triton_backend(variant):
    """The Triton kernels (Quest scoring, top-K, append, attention) take per-row lengths too."""
    plan = StaticPlan(variant=variant, predicted_blocks=2, block_size=16, count_hits=True)
    objects = (lambda: graph_selector("quest", 3, dense_layers=(0,)), "ema_membership")
    check_rows(decode(plan, [0, 1, 2], *objects, backend="triton", config=CONFIG64),
               [decode(plan, [b], *objects, backend="triton", config=CONFIG64) for b in range(len(LENGTHS))])


def test_row_lengths_are_checked_and_the_int_form_still_works():
    plan = StaticPlan(variant="serial", block_size=8)
    model = Decoder(CONFIG, torch.float32, "cpu").init_random_(seed=3, std=0.3)
    engine = GraphDecoder(model, plan, batch=3, max_tokens=MAX_TOKENS, backend="torch",
                          selector=graph_selector("quest", 4, dense_layers=(0,)), predictor=None)
    keys, values, tokens, _ = context()
    with pytest.raises(ValueError, match="one context length per row"):
        engine.fill_from_cache(keys, values, [37, 90], tokens)
    with pytest.raises(ValueError, match="must be in"):
        engine.fill_from_cache(keys, values, [37, 90, MAX_TOKENS], tokens)
    engine.fill_from_cache(keys, values, 37, tokens)
    assert engine.pos.tolist() == [37, 37, 37]
    engine.fill_from_cache(keys, values, torch.tensor(LENGTHS), tokens)
    assert engine.pos.tolist() == LENGTHS


class RowBlindQuest(QuestSelector):
    per_row_metadata = False


def test_a_selector_without_per_row_metadata_refuses_ragged_rows():
    plan = StaticPlan(variant="serial", block_size=8)
    model = Decoder(CONFIG, torch.float32, "cpu").init_random_(seed=3, std=0.3)
    selector = RowBlindQuest(topk_blocks=4, dense_layers=(0,))
    engine = GraphDecoder(model, plan, batch=3, max_tokens=MAX_TOKENS, backend="torch", selector=selector,
                          predictor=None)
    keys, values, tokens, _ = context()
    with pytest.raises(ValueError, match="RowBlindQuest.*per-row metadata"):
        engine.fill_from_cache(keys, values, LENGTHS, tokens)
    engine.fill_from_cache(keys, values, 61, tokens)  # equal lengths need no per-row rebuild


def test_fill_random_context_takes_one_length_per_row():
    plan = StaticPlan(variant="serial", block_size=8)
    model = Decoder(CONFIG, torch.float32, "cpu").init_random_(seed=3, std=0.3)
    engine = GraphDecoder(model, plan, batch=3, max_tokens=MAX_TOKENS, backend="torch",
                          selector=graph_selector("quest", 4, dense_layers=(0,)), predictor=None)
    engine.fill_random_context(LENGTHS, seed=1)
    assert engine.pos.tolist() == LENGTHS and engine.cache.length(1) == max(LENGTHS)
    for b, n in enumerate(LENGTHS):
        assert bool((engine.keys[1][b, :, :n] != 0).all()) and not engine.keys[1][b, :, n:].any()
    engine.step(advance=True)
    assert engine.pos.tolist() == [n + 1 for n in LENGTHS]


def test_a_row_view_shares_the_cache_and_its_per_row_slots():
    cache = PagedKVCache(1, 3, 2, 4, 8, 32)
    row = cache.row(1)
    slot = row.metadata_slot(0, "m", (4,), torch.float32, fill=-1.0)  # allocated for every row of the cache
    assert slot.shape == (1, 2, 4, 4) and cache.metadata[0]["m"].shape == (3, 2, 4, 4)
    slot.fill_(5.0)
    row.keys[0].fill_(2.0)
    assert cache.metadata[0]["m"][1].eq(5).all() and cache.metadata[0]["m"][[0, 2]].eq(-1).all()
    assert cache.keys[0][1].eq(2).all() and not cache.keys[0][[0, 2]].any()
    row.metadata[0]["shared"] = torch.ones(2)  # a constant (no batch dim): shared by every row
    assert torch.equal(cache.metadata[0]["shared"], torch.ones(2))
    row.set_length(0, 5)
    assert row.length(0) == 5 and cache.length(0) == 0
    row.reset_metadata(0)
    assert cache.metadata[0]["m"][1].eq(-1).all()
    with pytest.raises(ValueError, match="lead with the batch dim"):
        row.state_slot(0, "total", (2, 4), torch.float32)
    with pytest.raises(ValueError, match="outside the cache's batch"):
        cache.row(3)


GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()


def decode_captured(plan: StaticPlan, rows: list[int]) -> tuple[Tensor, list[Tensor]]:
    """As `decode`, on CUDA with the Triton kernels, the step captured in one CUDA graph and
    replayed -> (tokens [B, STEPS], per step the A indices of every sparse layer [B, Hkv, K]);
    Quest at top-K 3 (layer 0 dense), ema_membership."""
    model = Decoder(CONFIG64, torch.float32, "cuda").init_random_(seed=3, std=0.3)
    engine = GraphDecoder(model, plan, batch=len(rows), max_tokens=MAX_TOKENS, backend="triton",
                          selector=graph_selector("quest", 3, dense_layers=(0,)),
                          predictor=graph_predictor("ema_membership"))
    keys, values, tokens, query = context(config=CONFIG64)
    lengths = [LENGTHS[b] for b in rows]

    def start() -> None:
        engine.fill_from_cache([k[rows].cuda() for k in keys], [v[rows].cuda() for v in values], lengths,
                               tokens[rows].cuda())
        engine.start_at(lengths, tokens[rows].cuda(), query=query[rows].cuda())
    start()
    graph = engine.capture(lambda: engine.step(advance=True))
    start()  # the capture's warm-up steps advanced it: start over
    out, selections = [], []
    for _ in range(STEPS):
        graph.replay()
        out.append(engine.token[:, 0].clone())
        selections.append([engine.last_selection[layer][0].clone() for layer in range(engine.num_layers)
                           if engine.sparse[layer]])
    assert engine.pos.tolist() == [n + STEPS for n in lengths]
    return torch.stack(out, 1).cpu(), selections


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
@pytest.mark.parametrize("variant", ["serial", "prr"])
def test_ragged_batch_replayed_in_a_cuda_graph_decodes_each_row_as_alone(variant):
    plan = StaticPlan(variant=variant, predicted_blocks=2, block_size=16)
    batch_tokens, batch_sel = decode_captured(plan, [0, 1, 2])
    for b in range(len(LENGTHS)):
        alone_tokens, alone_sel = decode_captured(plan, [b])
        assert torch.equal(batch_tokens[b], alone_tokens[0]), f"row {b}"
        for step, (mine, one) in enumerate(zip(batch_sel, alone_sel, strict=True)):
            for layer, (x, y) in enumerate(zip(mine, one, strict=True)):
                assert torch.equal(x[b], y[0]), f"row {b}, step {step}, sparse layer {layer}"
