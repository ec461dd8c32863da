"""`indexer` against its definition (prr/selectors/indexer.py): A = the sink tokens ∪ the newest
tokens ∪ the best tokens by the lightning indexer's score Σ_h w_h ReLU(q_h · k), `topk_tokens` in
all, written here from the indexer's own prefill scores (IndexerWeights.scores, fp32) and the index
keys rounded as the cache keeps them; at token granularity (runtime.block_size=1) through both
runtimes, with exact-mode PRR equal to serial DSA token for token."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from prr.kernels.reference_indexer import quantize_index_keys_reference

from prr.cache import PagedKVCache
from prr.config_check import ConfigError, compose_config, problems_before_torch
from prr.model.config import ModelConfig
from prr.selectors.indexer import IndexerSelector
from prr.selectors.indexer_weights import index_scores
from tests.test_end_to_end import ROOT, TINY

HIDDEN, LAYERS, HKV, GROUP, HEAD_DIM = 24, 2, 3, 2, 8
MODEL = ModelConfig(arch="llama", vocab_size=50, hidden_size=HIDDEN, intermediate_size=48, num_layers=LAYERS,
                    num_heads=HKV * GROUP, num_kv_heads=HKV, head_dim=HEAD_DIM, rope_theta=10000.0, rope_scaling=None,
                    rms_norm_eps=1e-5, tie_word_embeddings=False)
# the tiny model through run.py: 64 of its ~316 tokens, 3 sinks + the newest 8 forced
TOKEN_LEVEL = ["runtime.block_size=1", "selector=indexer", "selector.topk_tokens=64", "selector.sink_tokens=3",
               "selector.local_tokens=7", "selector.index_heads=4", "selector.index_dim=16", "selector.rope_dim=8"]


def run_tokens(tmp_path, *overrides: str, name: str) -> dict:
    """The tiny model through the runner at token granularity (TINY's block sizes left out)."""
    from hydra import compose, initialize_config_dir

    from prr.runner import run

    base = [o for o in TINY if not o.startswith(("selector.topk_blocks", "runtime.block_size"))]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*base, *TOKEN_LEVEL, *overrides])
    return run(cfg, tmp_path / name)


def indexer(index_dtype: str = "fp32", **options) -> IndexerSelector:
    sel = IndexerSelector(**{"topk_tokens": 13, "sink_tokens": 2, "local_tokens": 3, "dense_layers": [0],
                             "index_heads": 5, "index_dim": 16, "rope_dim": 6, "index_dtype": index_dtype, **options})
    sel.bind_model(MODEL)
    return sel


def as_stored(k: torch.Tensor, index_dtype: str) -> torch.Tensor:
    """Index keys [..., d_I] fp32 -> what the cache's keys score as (rounded to bf16, or fp8 × scale)."""
    if index_dtype == "bf16":
        return k.bfloat16().float()
    if index_dtype == "fp8":
        fp8, scale = quantize_index_keys_reference(k)
        return fp8.float() * scale.unsqueeze(-1)
    return k


def definition(sel: IndexerSelector, x: torch.Tensor, position: int, index_dtype: str) -> list[set[int]]:
    """A of each row at `position` (tokens <= position), from the definition: x [B, T, hidden]."""
    layer = sel.indexer.layer(1)
    pos = torch.arange(x.shape[1])
    keys = as_stored(layer.keys(x, pos, sel.indexer.inv_freq), index_dtype)  # [B, T, d_I]
    q = layer.queries(x[:, position : position + 1], pos[position : position + 1], sel.indexer.inv_freq)
    scores = index_scores(q, layer.head_weights(x[:, position : position + 1]), keys[:, : position + 1])[:, 0]
    n, out = position + 1, []
    forced = set(range(min(sel.sink_blocks, n))) | set(range(max(0, n - sel.local_blocks - 1), n))
    for row in scores:  # [n]
        rest = sorted((t for t in range(n) if t not in forced), key=lambda t: (-row[t].item(), t))
        out.append(forced | set(rest[: max(0, sel.topk_blocks - len(forced))]))
    return out


def chosen(selection, row: int) -> set[int]:
    blocks = selection.blocks
    sets = {tuple(blocks.indices[row, h, : blocks.count[row, h]].tolist()) for h in range(blocks.indices.shape[1])}
    assert len(sets) == 1  # one selection a row, shared by every KV head
    return set(sets.pop())


@pytest.mark.parametrize("index_dtype", ["fp32", "bf16", "fp8"])
def test_selection_is_the_top_tokens_of_the_index_score_and_the_forced_ones(index_dtype):
    """The prefill tail's selections and a decode step's (index key appended, query from the hidden
    state at its device position) are each the definition's A, per row of a batch."""
    batch, prompt, tail = 2, 41, 5
    sel = indexer(index_dtype)
    x = torch.randn(batch, prompt + 1, HIDDEN, generator=torch.Generator().manual_seed(3))
    cache = PagedKVCache(LAYERS, batch, HKV, HEAD_DIM, 1, prompt + 1)
    kv = torch.randn(batch, HKV, prompt, HEAD_DIM)
    cache.append(1, kv, kv)
    sel.take_hidden(cache, 1, x[:, :prompt], prefill=True)
    sel.update_metadata(cache, 1, 0, prompt - tail)
    selections = sel.select_tail(torch.zeros(batch, HKV, GROUP, tail, HEAD_DIM), cache, 1, prompt - tail)
    for i, selection in enumerate(selections):
        want = definition(sel, x, prompt - tail + i, index_dtype)
        assert [chosen(selection, b) for b in range(batch)] == want
        assert (selection.blocks.count == sel.topk_blocks).all()
    # one decode step
    cache.append(1, kv[:, :, :1], kv[:, :, :1])
    sel.take_hidden(cache, 1, x[:, prompt:], prefill=False)
    sel.append_metadata(cache, 1, torch.full((batch,), prompt))
    decoded = sel.select(torch.zeros(batch, HKV, GROUP, HEAD_DIM), cache, 1)
    assert [chosen(decoded, b) for b in range(batch)] == definition(sel, x, prompt, index_dtype)


def test_a_short_context_selects_all_of_it_and_nothing_past_it():
    sel = indexer()
    x = torch.randn(1, 9, HIDDEN)
    cache = PagedKVCache(LAYERS, 1, HKV, HEAD_DIM, 1, 32)
    cache.append(1, torch.randn(1, HKV, 9, HEAD_DIM), torch.randn(1, HKV, 9, HEAD_DIM))
    sel.take_hidden(cache, 1, x, prefill=True)
    sel.update_metadata(cache, 1, 0, 8)
    (selection,) = sel.select_tail(torch.zeros(1, HKV, GROUP, 1, HEAD_DIM), cache, 1, 8)
    assert chosen(selection, 0) == set(range(9))


def test_the_options_are_checked_with_the_fix_named(tmp_path, monkeypatch):
    base = ["model=tiny-random", "selector=indexer", "task.prompt_tokens=1024", "selector.topk_tokens=256", "runtime=cpu"]
    cfg = compose_config([*base, "runtime.block_size=16"], check=False)
    assert any("add runtime.block_size=1" in p for p in problems_before_torch(cfg))  # before torch
    with pytest.raises(ConfigError, match="selector=indexer selects tokens .* add runtime.block_size=1"):
        compose_config([*base, "runtime.block_size=16"])
    compose_config([*base, "runtime.block_size=1"])  # accepted
    with pytest.raises(ValueError, match="add runtime.block_size=1"):  # and outside run.py, on first use
        indexer().index_cache(PagedKVCache(LAYERS, 1, 1, 8, 16, 64), 1)
    for bad, message in ((dict(index_dtype="fp16"), "index_dtype='fp16' is not one of"),
                         (dict(rope_dim=5), "rope_dim=5 must be even"),
                         (dict(hinted_topk=True), "hinted_topk=true is not built for selector=indexer"),
                         (dict(weights="trained"), "set selector.model")):
        with pytest.raises(ValueError, match=message):
            IndexerSelector(**bad)
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="make train-indexer MODEL=tiny"):
        IndexerSelector(weights="trained", model="tiny", dense_layers=[0]).bind_model(MODEL)


def test_a_prefill_without_hidden_states_is_refused_by_name():
    sel = indexer()
    with pytest.raises(RuntimeError, match="needs layer 1's normed hidden states of the prefill"):
        sel.update_metadata(PagedKVCache(LAYERS, 1, HKV, HEAD_DIM, 1, 16), 1, 0, 8)


@pytest.mark.parametrize("predictor", ["ema", "last_step"])
def test_exact_prr_over_token_sets_is_serial_dsa_token_for_token(tmp_path, predictor):
    """fp32, runtime.block_size=1: PRR's A, P, repair A \\ P and merge over token ids give serial DSA's
    output (check_serial) and its tokens."""
    serial = run_tokens(tmp_path, "predictor=none", name="serial")
    prr = run_tokens(tmp_path, f"predictor={predictor}", "runtime.check_serial=true", name=predictor)
    assert prr["max_serial_relerr"] <= 1e-5
    assert prr["generated_token_ids"] == serial["generated_token_ids"]
    assert 0 < prr["hit_rate"] < 1 and prr["mean_predicted_blocks"] == 64
    assert prr["topk_blocks"] == 64 and prr["block_size"] == 1


@pytest.mark.slow
def test_every_budget_decodes_serial_dsas_tokens_with_the_indexer_in_the_graph_engine(tmp_path, monkeypatch):
    """fixed, profiled (its probe fills random contexts: random hidden states make their index keys)
    and adaptive over token sets, last_step's P, exact repair: serial DSA's tokens."""
    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path / "cache"))
    serial = run_tokens(tmp_path, "predictor=none", name="serial")
    for budget, extra in (("fixed", []), ("profiled", ["budget.ratios=[1.0]", "budget.max_rounds=1"]),
                          ("adaptive", [])):
        graph = run_tokens(tmp_path, "predictor=last_step", f"budget={budget}", *extra, "runtime.engine=graph",
                           name=budget)
        assert graph["generated_token_ids"] == serial["generated_token_ids"], budget
        if budget == "profiled":  # its timed choice (on the CPU by the host clock: the machinery, not a speed claim)
            assert graph["budget_setup"]["profile_source"] in ("measured", "cache")
            assert (graph["predicted_blocks"] > 0) == (graph["variant"] == "prr")
        else:
            assert graph["variant"] == {"fixed": "prr", "adaptive": "adaptive"}[budget]


@pytest.mark.slow
def test_a_ragged_batch_decodes_each_row_as_alone(tmp_path):
    """The index-key cache, query and hidden-state slots are per row: rows of the prompt's last 300 and
    170 tokens decode in one graph-engine batch what each decodes alone."""
    common = ["predictor=ema", "runtime.engine=graph", "runtime.calibration_tokens=24"]
    both = run_tokens(tmp_path, *common, "runtime.batch_size=2", "runtime.row_tokens=[300,170]", name="both")
    alone = [run_tokens(tmp_path, *common, f"runtime.row_tokens=[{n}]", name=f"alone{n}") for n in (300, 170)]
    assert both["generated_token_ids"] == [a["generated_token_ids"][0] for a in alone]
    assert both["generated_token_ids"][0] != both["generated_token_ids"][1]  # the rows' contexts differ


def prefill_then_decode(sel: IndexerSelector, x: torch.Tensor, dtype: torch.dtype = torch.float32):
    """x [B, T + 1, hidden]: T prefilled, the last decoded at position T -> (cache, T)."""
    batch, prompt = x.shape[0], x.shape[1] - 1
    cache = PagedKVCache(LAYERS, batch, HKV, HEAD_DIM, 1, prompt + 1, dtype=dtype)
    sel.take_hidden(cache, 1, x[:, :prompt], prefill=True)
    sel.update_metadata(cache, 1, 0, prompt)
    sel.take_hidden(cache, 1, x[:, prompt:], prefill=False)
    sel.append_metadata(cache, 1, torch.full((batch,), prompt))
    return cache, prompt


@pytest.mark.parametrize("backend,index_dtype", [("torch", "fp32"), ("triton", "bf16")])
def test_a_decode_step_stores_what_the_prefill_would_at_its_position(backend, index_dtype):
    """The decode path (one stacked projection, then kernels.indexer_step or its reference) gives the
    prefill's LayerIndexer.keys / queries / head_weights for the same x and position, up to the
    GEMM's fp32 rounding (bf16 keys: up to one bf16 step); the stacked weights are the copy's W_q,
    W_k, W_w (one copy on the device, not two)."""
    sel = indexer(index_dtype)
    sel.backend = backend
    x = torch.randn(2, 10, HIDDEN, generator=torch.Generator().manual_seed(5))
    cache, t = prefill_then_decode(sel, x)
    layer, inv_freq = sel._layer(1, x)
    pos = torch.tensor([t])
    want_key = layer.keys(x[:, t:], pos, inv_freq)[:, 0]  # [B, d_I]
    got_key = sel.index_cache(cache, 1)[0][:, t].float()
    if index_dtype == "bf16":
        assert ((got_key - want_key.bfloat16().float()).abs() <= want_key.abs() * 2**-7).all()
    else:
        torch.testing.assert_close(got_key, want_key, rtol=1e-5, atol=1e-6)
    query, head_weights = sel.step_query(cache, 1)
    torch.testing.assert_close(query, layer.queries(x[:, t:], pos, inv_freq)[:, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head_weights, layer.head_weights(x[:, t]), rtol=1e-5, atol=1e-6)
    stacked = sel._step_weight(1, x)
    assert layer.wq.data_ptr() == stacked.data_ptr() and layer.ww.data_ptr() == stacked[-sel.index_heads :].data_ptr()


def test_bound_to_another_model_the_decode_projects_by_its_weights():
    """bind_model to another model (another hidden size, new weights): the stacked decode weights
    are the new model's, not the first one's."""
    sel = indexer()
    prefill_then_decode(sel, torch.randn(1, 6, HIDDEN))
    other = dataclasses.replace(MODEL, hidden_size=HIDDEN + 8)
    sel.bind_model(other)
    x = torch.randn(1, 6, HIDDEN + 8, generator=torch.Generator().manual_seed(6))
    cache, t = prefill_then_decode(sel, x)
    layer, inv_freq = sel._layer(1, x)
    torch.testing.assert_close(sel.index_cache(cache, 1)[0][:, t], layer.keys(x[:, t:], torch.tensor([t]), inv_freq)[:, 0],
                               rtol=1e-5, atol=1e-6)


def test_the_fused_engine_projection_equals_take_hidden():
    """hidden_projection's (W, slot), written as the graph engine's fused GEMVs write it (dense_gemv with
    the layer's RMSNorm inside, out=slot), holds what take_hidden(RMSNorm(x)) writes there; a dense layer
    asks for none (the engine skips it)."""
    from prr.kernels.dense_gemv import dense_gemv

    from prr.model.layer_math import rms_norm

    sel = indexer()
    cache = PagedKVCache(LAYERS, 2, HKV, HEAD_DIM, 1, 16)
    g = torch.Generator().manual_seed(11)
    x, ln1 = torch.randn(2, HIDDEN, generator=g) * 3, 1 + 0.2 * torch.randn(HIDDEN, generator=g)
    weight, slot = sel.hidden_projection(cache, 1)
    assert weight.shape == (5 * 16 + 16 + 5, HIDDEN) and slot.shape == (2, weight.shape[0])
    dense_gemv(x, weight, norm_weight=ln1, eps=1e-5, out=slot)
    fused = slot.clone()
    sel.take_hidden(cache, 1, rms_norm(x, ln1, 1e-5).unsqueeze(1), prefill=False)
    torch.testing.assert_close(fused, slot, rtol=1e-5, atol=1e-5)
    assert not torch.equal(fused, torch.zeros_like(fused))
    assert sel.hidden_projection(cache, 0) is None
