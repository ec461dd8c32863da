"""PRR's speculation inside exact selection's q·K launch (StaticPlan.speculate_in_selection):
the fused launch writes the same per-block states over P as sparse_decode(per_block=True) and
the same block lse as the q·K pass alone, bit for bit; the engine decodes the same logits with
it as without it and as serial DSA (exact mode). CPU: kernels under TRITON_INTERPRET=1."""

from __future__ import annotations

import math
import os

import pytest
import torch
from prr.kernels.exact import exact_block_lse
from prr.kernels.sparse_decode import sparse_decode

from prr.runtime.graph_decode import GraphDecoder, StaticPlan
from prr.selectors.exact import ExactSelector
from tests.helpers import graph_predictor
from tests.test_graph_decode import CONFIG, decode

GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def random_case(seed: int, dtype: torch.dtype, batch: int = 2, kv_heads: int = 3, group: int = 3, dim: int = 64,
                block: int = 16, blocks: int = 13, capacity: int = 5):
    """Fresh random q [B, Hq, D], K/V [B, Hkv, T, D], ragged lengths, P with padding and an empty row."""
    g = torch.Generator().manual_seed(seed)
    tokens = block * blocks
    q, k, v = (torch.randn(shape, generator=g).to(dtype).to(DEVICE) for shape in
               ((batch, kv_heads * group, dim), (batch, kv_heads, tokens, dim), (batch, kv_heads, tokens, dim)))
    lengths = torch.tensor([tokens - 5] + [int(torch.randint(capacity * block + 1, tokens, (1,), generator=g))] * (batch - 1),
                           dtype=torch.int32, device=DEVICE)
    num_blocks = ((lengths + block - 1) // block).int()
    ids = torch.stack([torch.stack([torch.randperm(int(num_blocks[b]), generator=g)[:capacity] for _ in range(kv_heads)])
                       for b in range(batch)]).int().to(DEVICE)
    counts = torch.randint(0, capacity + 1, (batch, kv_heads), generator=g).int().to(DEVICE)
    counts[0, 0] = 0  # an empty P
    counts[-1, -1] = capacity
    return q, k, v, lengths, num_blocks, ids, counts, block, 1.0 / math.sqrt(dim)


@pytest.mark.parametrize("dtype,seed,tokens_per_program", [(torch.float32, 0, None), (torch.float16, 1, 32),
                                                           (torch.float32, 2, 16)])
def test_the_fused_launch_writes_what_the_two_launches_write(dtype, seed, tokens_per_program):
    q, k, v, lengths, num_blocks, ids, counts, block, scale = random_case(seed, dtype)
    want_lse, want_parts = exact_block_lse(q, k, lengths, num_blocks, block, scale)
    want_out, want_spec_lse = sparse_decode(q, k, v, ids, counts, lengths, block, scale, per_block=True,
                                            tokens_per_split=tokens_per_program)
    launch = sparse_decode(q, k, v, ids, counts, lengths, block, scale, per_block=True,
                           tokens_per_split=tokens_per_program, plan_only=True)
    got_lse, got_parts = exact_block_lse(q, k, lengths, num_blocks, block, scale, speculation=launch)
    assert torch.equal(launch.out, want_out) and torch.equal(launch.lse, want_spec_lse)
    assert torch.isinf(launch.lse[0, :3]).all()  # row 0, KV head 0: P empty
    for b in range(q.shape[0]):  # the q·K pass writes blocks < num_blocks and runs that start there
        n = int(num_blocks[b])
        assert torch.equal(got_lse[b, ..., :n], want_lse[b, ..., :n])
        assert torch.equal(got_parts[b, ..., :1], want_parts[b, ..., :1])


def test_a_speculation_planned_over_other_inputs_is_refused():
    q, k, v, lengths, num_blocks, ids, counts, block, scale = random_case(3, torch.float32)
    launch = sparse_decode(q.clone(), k, v, ids, counts, lengths, block, scale, per_block=True, plan_only=True)
    with pytest.raises(ValueError, match="same q, keys and lengths"):
        exact_block_lse(q, k, lengths, num_blocks, block, scale, speculation=launch)
    launch = sparse_decode(q, k, v, ids, counts, lengths, block, 0.5 * scale, per_block=True, plan_only=True)
    with pytest.raises(ValueError, match="scale"):
        exact_block_lse(q, k, lengths, num_blocks, block, scale, speculation=launch)
    with pytest.raises(ValueError, match="plan_only=True describes the per-block launch"):
        sparse_decode(q, k, v, ids, counts, lengths, block, scale, plan_only=True)


def exact_engine(plan: StaticPlan, predictor: str = "fixed", context: int = 203, dtype=torch.float32,
                 layers: int = 3) -> GraphDecoder:
    """An engine of `plan` with exact top-6 over a random model; predictor: graph_predictor's names
    or "cross_layer" (this step's P of a layer written by the layer below's learning)."""
    import dataclasses

    from prr.model.decoder import Decoder
    from prr.predictors.cross_layer import CrossLayerPredictor

    model = Decoder(dataclasses.replace(CONFIG, num_layers=layers), dtype, DEVICE).init_random_(seed=3, std=0.05)
    selector = ExactSelector(topk_blocks=6, sink_blocks=1, local_blocks=0, force_newest=True, dense_layers=(0, 1),
                             gqa_reduce="max")
    chosen = CrossLayerPredictor(temporal_weight=0.5) if predictor == "cross_layer" else graph_predictor(predictor)
    engine = GraphDecoder(model, plan, batch=2, max_tokens=context + 40, selector=selector, predictor=chosen)
    engine.fill_random_context(context, seed=5)
    return engine


def test_exact_prr_speculating_in_selection_decodes_serial_dsa_and_the_side_streams_logits(monkeypatch):
    """The defining property: P's states from the selection's launch change nothing but where they
    are computed. Exact PRR with them equals serial DSA and PRR with the separate speculation
    kernel, step for step, with the same hits; the per-block sparse_decode kernel never runs."""
    serial = decode(exact_engine(StaticPlan(variant="serial")), 4)
    plans = {inside: StaticPlan(variant="prr", predicted_blocks=6, count_hits=True, speculate_in_selection=inside)
             for inside in (False, True)}
    engines = {inside: exact_engine(plan, "last_step") for inside, plan in plans.items()}
    assert engines[True].attn.speculates_in_selection() and not engines[False].attn.speculates_in_selection()
    per_block_calls = []
    sparse_decode = engines[True].attn.ops.sparse_decode

    def spy(*args, **kw):
        per_block_calls.append(kw.get("per_block", False))
        return sparse_decode(*args, **kw)

    engines[True].attn.ops.sparse_decode = spy
    side, inside = (decode(engines[x], 4) for x in (False, True))
    for step, (a, b, c) in enumerate(zip(serial, side, inside, strict=True)):
        torch.testing.assert_close(c, b, rtol=2e-5, atol=2e-5, msg=f"step {step}")
        torch.testing.assert_close(c, a, rtol=2e-5, atol=2e-5, msg=f"step {step}")
    assert per_block_calls and not any(per_block_calls)  # the engine's attend never speculated on its own
    hits = [engines[x].counters()["hits"] for x in (False, True)]
    assert hits[0] == hits[1] and sum(hits[1]) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
@pytest.mark.parametrize("block,capacity", [(16, 32), (64, 32)])
def test_gpu_the_fused_launch_at_the_8b_shape_writes_what_the_two_launches_write(block, capacity):
    q, k, v, lengths, num_blocks, ids, counts, block, scale = random_case(
        7, torch.bfloat16, batch=1, kv_heads=8, group=4, dim=128, block=block, blocks=4099 // block, capacity=capacity)
    want_lse, _ = exact_block_lse(q, k, lengths, num_blocks, block, scale)
    want = sparse_decode(q, k, v, ids, counts, lengths, block, scale, per_block=True)
    launch = sparse_decode(q, k, v, ids, counts, lengths, block, scale, per_block=True, plan_only=True)
    got_lse, _ = exact_block_lse(q, k, lengths, num_blocks, block, scale, speculation=launch)
    n = int(num_blocks[0])
    assert torch.equal(launch.out, want[0]) and torch.equal(launch.lse, want[1])
    assert torch.equal(got_lse[..., :n], want_lse[..., :n])


@pytest.mark.slow  # (20 s; make test keeps the defining property above, the GPU test captures cross_layer's)
def test_cross_layer_p_written_this_step_is_speculated_inside_selection_like_beside_it():
    """cross_layer writes a layer's P during the same step (the layer below's learning, on the side
    stream on a GPU): the fused path waits for it and decodes what the side-stream path decodes."""
    plans = {inside: StaticPlan(variant="prr", predicted_blocks=6, count_hits=True, speculate_in_selection=inside)
             for inside in (False, True)}
    engines = {inside: exact_engine(plan, "cross_layer", layers=4) for inside, plan in plans.items()}
    assert engines[True].attn.speculates_in_selection()
    fused_layers = []
    selector = engines[True].attn.selector
    original = selector.select_speculating

    def counted(q, cache, layer, *args, **kwargs):
        fused_layers.append(layer)
        return original(q, cache, layer, *args, **kwargs)

    selector.select_speculating = counted
    side, inside = (decode(engines[x], 3) for x in (False, True))
    assert 3 in fused_layers  # layer 3's P came from layer 2's learning this step, read inside its selection
    for step, (a, b) in enumerate(zip(side, inside, strict=True)):
        torch.testing.assert_close(b, a, rtol=2e-5, atol=2e-5, msg=f"step {step}")
    assert engines[False].counters()["hits"] == engines[True].counters()["hits"]


def test_empty_inputs_give_empty_states_and_other_launch_settings_are_refused():
    q, k, v, lengths, num_blocks, ids, counts, block, scale = random_case(4, torch.float32)
    none = sparse_decode(q[:0], k[:0], v[:0], ids[:0], counts[:0], lengths[:0], block, scale, per_block=True,
                         plan_only=True)
    assert none.chunks == 0 and none.out.shape == (0, q.shape[1], ids.shape[-1], q.shape[-1])
    no_keys = k[:, :, :0]  # T_max = 0: nothing to attend, every state empty
    launch = sparse_decode(q, no_keys, v[:, :, :0], ids, counts, lengths.clamp(max=0), block, scale,
                           per_block=True, plan_only=True)
    launch.lse.fill_(123.0)
    exact_block_lse(q, no_keys, lengths.clamp(max=0), num_blocks.clamp(max=0), block, scale, speculation=launch)
    assert torch.isinf(launch.lse).all() and not launch.out.any()
    with pytest.raises(ValueError, match="num_warps"):
        sparse_decode(q, k, v, ids, counts, lengths, block, scale, per_block=True, plan_only=True, num_warps=8)
    launch = sparse_decode(q, k, v, ids, counts, lengths, block, scale, per_block=True, plan_only=True)
    with pytest.raises(ValueError, match="num_warps"):
        exact_block_lse(q, k, lengths, num_blocks, block, scale, speculation=launch, num_warps=8)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
@pytest.mark.parametrize("predictor", ["cross_layer", "last_step"])
def test_gpu_captured_exact_prr_speculating_in_selection_equals_beside_it(predictor):
    """On two streams, captured: the fused path (P read on the main stream, after the side stream's
    writes where cross_layer makes them this step) decodes what the side-stream path decodes."""
    got = {}
    for inside in (False, True):
        plan = StaticPlan(variant="prr", predicted_blocks=6, count_hits=True, speculate_in_selection=inside)
        engine = exact_engine(plan, predictor, context=1501, dtype=torch.bfloat16, layers=6)
        graph = engine.capture(lambda engine=engine: engine.step(advance=True))
        engine.fill_random_context(1501, seed=5)  # the warm-up steps advanced it: start over
        got[inside] = []
        for _ in range(6):
            graph.replay()
            got[inside].append(engine.graph_output.float().cpu())
    for step, (a, b) in enumerate(zip(got[False], got[True], strict=True)):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"step {step}")


def test_exact_override_equals_the_base_definition_of_select_speculating():
    """Selector.select_speculating (selection, then sparse_decode's per-block states: two launches)
    is the definition; exact's one-launch override gives the same A, scores and states bit for bit."""
    from prr.selectors.base import Selector

    engine = exact_engine(StaticPlan(variant="prr", predicted_blocks=6), "last_step")
    decode(engine, 2)
    attn, layer = engine.attn, 2
    lengths, num_blocks = engine.step_positions()
    g = torch.Generator().manual_seed(11)
    q = torch.randn(engine.batch, engine.hkv, engine.group, engine.d, generator=g).to(DEVICE)
    args = (q, attn.cache, layer, lengths, num_blocks, engine.pred_idx[layer], engine.pred_cnt[layer], engine.scale, None)
    want_a, want_states = Selector.select_speculating(attn.selector, *args)
    got_a, got_states = attn.selector.select_speculating(*args)
    assert torch.equal(got_a.blocks.indices, want_a.blocks.indices) and torch.equal(got_a.blocks.count, want_a.blocks.count)
    assert torch.equal(got_a.scores, want_a.scores)
    assert all(torch.equal(a, b) for a, b in zip(got_states, want_states, strict=True))
    assert int(engine.pred_cnt[layer].sum()) > 0  # P was not empty
