"""The static (CUDA-graph-capturable) decode engine, prr.runtime.graph_decode, on a small
random Llama with head_dim 64 (what the Triton kernels take). CPU: kernels under
TRITON_INTERPRET=1, one stream. GPU (-m gpu, TRITON_INTERPRET=0): two streams and graphs."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from prr.model.config import ModelConfig
from prr.model.decoder import Decoder
from prr.model.dense import DenseAttention
from prr.runtime.graph_decode import GraphDecoder, StaticPlan
from prr.runtime.predictor_schedule import state_tensors
from tests.helpers import graph_predictor, graph_selector

GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"  # CPU: the kernels run in the interpreter
# fp32 logits of two fused-projection paths: compiled on a GPU the paired (permuted) q|k|v tiles
# sum in another order (up to 1.4e-6 apart on the H200, gpu_tests_cuda_unmarked_78f359e.txt).
SAME_LOGITS = 1e-6 if DEVICE == "cpu" else 1e-5
CONFIG = ModelConfig(arch="llama", vocab_size=97, hidden_size=128, intermediate_size=160, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=64, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-5,
                     tie_word_embeddings=False, max_position_embeddings=4096)


def make(plan: StaticPlan, selector: str, topk_blocks: int, predictor: str = "fixed", context: int = 203,
         device: str = DEVICE, dtype=torch.float32, batch: int = 2, config: ModelConfig = CONFIG) -> GraphDecoder:
    """An engine of `plan` over a random model and context, with graph_selector(selector, topk_blocks)
    and graph_predictor(predictor) (fixed: none, P set from outside)."""
    model = Decoder(config, dtype, device).init_random_(seed=3, std=0.05)
    engine = GraphDecoder(model, plan, batch=batch, max_tokens=context + 40,
                          selector=graph_selector(selector, topk_blocks), predictor=graph_predictor(predictor))
    engine.fill_random_context(context, seed=5)
    return engine


def decode(engine: GraphDecoder, steps: int) -> list[torch.Tensor]:
    return [engine.step(advance=True).float().cpu() for _ in range(steps)]


def test_dense_variant_equals_sdpa_over_the_cache():
    model = Decoder(CONFIG, torch.float32, DEVICE).init_random_(seed=3, std=0.05)
    engine = GraphDecoder(model, StaticPlan(variant="dense"), batch=2, max_tokens=243,
                          selector=graph_selector("quest", 128, dense_layers=()), predictor=None)
    engine.fill_random_context(203, seed=5)
    pos = int(engine.pos[0])
    # The model's own forward over the engine's cache, with exact SDPA attention.
    want = engine.model(engine.token.clone(), pos, DenseAttention.over(engine.keys, engine.values, pos))[:, 0]
    got = engine.step(advance=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert int(engine.pos[0]) == pos + 1 and torch.equal(engine.token[:, 0], got.argmax(-1))


def test_serial_with_every_block_selected_equals_dense():
    dense = make(StaticPlan(variant="dense"), "quest", 128)
    serial = make(StaticPlan(variant="serial"), "quest", 16)  # 203..207 tokens: at most 13 blocks
    for a, b in zip(decode(dense, 3), decode(serial, 3), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("selector,predictor,predicted", [
    ("quest", "ema_membership", 8), pytest.param("infllm", "last_step", 6, marks=pytest.mark.slow),
    pytest.param("quest", "last_step", 6, marks=pytest.mark.slow), pytest.param("infllm", "ema_membership", 5, marks=pytest.mark.slow),
])
def test_exact_prr_equals_serial_dsa(selector, predictor, predicted):
    serial = decode(make(StaticPlan(variant="serial"), selector, 6), 4)
    prr_engine = make(StaticPlan(variant="prr", predicted_blocks=predicted, count_hits=True), selector, 6, predictor)
    for step, (a, b) in enumerate(zip(serial, decode(prr_engine, 4), strict=True)):
        torch.testing.assert_close(b, a, rtol=2e-5, atol=2e-5, msg=f"step {step}")
    counts = prr_engine.counters()
    hits, selected = sum(counts["hits"][1:]), sum(counts["selected"][1:])
    assert selected > 0 and 0 < hits <= selected  # the predictor hit something


# make test runs the default (one_wave); every split fused is in make test-full and on the GPU.
@pytest.mark.parametrize("variant,fuse_merge", [pytest.param("serial", True, marks=pytest.mark.slow),
                                                pytest.param("dense", True, marks=pytest.mark.slow),
                                                ("serial", "one_wave")])
def test_fused_merge_decodes_like_the_merge_launch(variant, fuse_merge):
    """plan.fuse_merge (splits merged inside the split kernel) decodes what the merge launch does."""
    reference = make(StaticPlan(variant=variant, fuse_merge=False), "quest", 12)  # 12 blocks of 16: two splits of 128 tokens
    assert not reference.attn.attention.fuses_merge(torch.zeros(2, 2, 12, dtype=torch.int32))
    want = decode(reference, 3)
    engine = make(StaticPlan(variant=variant, fuse_merge=fuse_merge), "quest", 12)
    sparse_idx = torch.zeros(2, 2, 12, dtype=torch.int32)
    assert engine.attn.attention.fuses_merge(sparse_idx)  # 2 rows x 2 splits: one wave, so "one_wave" fuses here too
    for a, b in zip(want, decode(engine, 3), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert int(engine.attn.attention.merge_arrivals.abs().sum()) == 0  # re-armed


# (the fused repair against the three launches, kernel by kernel: test_kernels_prr_repair.py in make test)
@pytest.mark.parametrize("selector,predictor", [pytest.param("quest", "ema_membership", marks=pytest.mark.slow),
                                                pytest.param("infllm", "last_step", marks=pytest.mark.slow)])
def test_fused_repair_decodes_like_the_three_launches(selector, predictor):
    """plan.fused_repair (repair plan, repair and merge in one launch): the same logits as the
    three launches and as serial DSA (exact PRR), the same hits."""
    kwargs = dict(variant="prr", predicted_blocks=6 if predictor == "last_step" else 8)
    serial = decode(make(StaticPlan(variant="serial"), selector, 6), 3)
    engines = [make(StaticPlan(fused_repair=fused, count_hits=True, **kwargs), selector, 6, predictor)
               for fused in (False, True)]
    three, fused = (decode(e, 3) for e in engines)
    for step, (a, b, c) in enumerate(zip(serial, three, fused, strict=True)):
        torch.testing.assert_close(c, b, rtol=2e-5, atol=2e-5, msg=f"step {step}")
        torch.testing.assert_close(c, a, rtol=2e-5, atol=2e-5, msg=f"step {step}")
    hits = [engine.counters()["hits"] for engine in engines]
    assert hits[0] == hits[1] and sum(hits[1]) > 0
    assert int(engines[1].attn.attention.merge_arrivals.abs().sum()) == 0
    auto = make(StaticPlan(**kwargs), selector, 6, predictor)  # the default, "auto": one launch at these small shapes
    idx, pred = torch.zeros(2, 2, 6, dtype=torch.int32), auto.pred_idx[-1]  # layer 2: sparse
    assert auto.plan.fused_repair == "auto" and auto.attn.fuses_repair(idx, pred)
    assert not make(StaticPlan(repair_mode="superset", **kwargs), selector, 6, predictor).attn.fuses_repair(idx, pred)
    assert "fused_repair=True needs repair_mode='exact'" in StaticPlan(fused_repair=True,
                                                                     repair_mode="superset").problems()[0]


@pytest.mark.slow  # a GPU launch-shape option (make test-full)
def test_speculation_in_fewer_programs_decodes_like_the_default():
    """plan.speculation_tokens_per_program (fewer, longer speculation programs) changes only the
    grid: exact PRR still decodes serial DSA's logits; a value that is not whole blocks is refused."""
    want = decode(make(StaticPlan(variant="serial"), "quest", 6), 3)
    engine = make(StaticPlan(variant="prr", predicted_blocks=6, speculation_tokens_per_program=64), "quest", 6,
                  "last_step")  # 4 blocks of 16 per program
    calls = []
    sparse_decode = engine.attn.ops.sparse_decode

    def spy(*args, **kw):
        if kw.get("per_block"):
            calls.append(kw.get("tokens_per_split"))
        return sparse_decode(*args, **kw)
    engine.attn.ops.sparse_decode = spy
    for step, (a, b) in enumerate(zip(want, decode(engine, 3), strict=True)):
        torch.testing.assert_close(b, a, rtol=2e-5, atol=2e-5, msg=f"step {step}")
    assert calls and set(calls) == {64}
    assert "speculation_tokens_per_program=24" in StaticPlan(speculation_tokens_per_program=24).problems()[0]
    assert "speculation_tokens_per_program=0" in StaticPlan(speculation_tokens_per_program=0).problems()[0]


def test_one_wave_fuses_the_merge_only_where_every_split_has_an_sm():
    """fuse_merge="one_wave" at the Llama-3.1-8B shape on 132 SMs (the H200's; the CPU plan uses
    it too): batch 1 with 2K-token budgets fuses; 8K budgets, batch 8 and the dense layers'
    whole-context lists (more programs than SMs, where fusing measured slower) keep the launch."""
    from prr.kernels.sparse_decode import sparse_decode_num_splits, sparse_decode_one_wave

    def one_wave(batch, entries, block):
        return sparse_decode_one_wave(entries, batch, 8, block, "cpu", head_dim=128, cache_dtype=torch.bfloat16)
    assert one_wave(1, 2048 // 64, 64) and one_wave(1, 2048 // 16, 16)
    assert not one_wave(1, 8192 // 64, 64) and not one_wave(1, 8192 // 16, 16)
    assert not one_wave(8, 2048 // 64, 64) and not one_wave(1, 131072 // 64, 64)
    assert not one_wave(1, 1, 64)  # one split: nothing to merge
    for batch, entries, block in ((1, 32, 64), (1, 128, 16), (1, 128, 64), (8, 32, 64)):
        splits = sparse_decode_num_splits(entries, batch, 8, block, "cpu", head_dim=128, cache_dtype=torch.bfloat16)
        assert one_wave(batch, entries, block) == (1 < splits and 8 * batch * splits <= 132)
    assert "fuse_merge='always'" in StaticPlan(fuse_merge="always").problems()[0]


def test_fixed_predictions_set_from_the_true_selection_hit_everything():
    engine = make(StaticPlan(variant="prr", predicted_blocks=5, count_hits=True), "quest", 5, "fixed")
    pos = engine.pos.clone()
    engine.step(advance=False)  # learn A at this position (P empty: everything repaired)
    assert sum(engine.counters()["hits"]) == 0
    for layer, sel in enumerate(engine.last_selection):
        if sel is not None:
            engine.set_predictions(layer, *sel)
    engine.attn.observers.counting.counts.zero_()
    first = engine.step(advance=False)
    assert torch.equal(engine.pos, pos)
    counts = engine.counters()
    assert sum(counts["hits"]) == sum(counts["selected"]) == sum(counts["predicted"]) > 0
    assert sum(counts["overlap"]) == sum(counts["selected"])  # the same position selects the same A again
    torch.testing.assert_close(engine.step(advance=False), first)  # a repeated step is the same step


def test_superset_repair_keeps_false_positives_and_differs_from_exact():
    kwargs = dict(variant="prr", predicted_blocks=9)
    exact = decode(make(StaticPlan(repair_mode="exact", **kwargs), "quest", 4, "ema_membership", batch=1), 3)
    superset = decode(make(StaticPlan(repair_mode="superset", **kwargs), "quest", 4, "ema_membership", batch=1), 3)
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(exact, superset, strict=True))


@pytest.mark.parametrize("kwargs,match", [
    (dict(variant="sparse"), "variant='sparse'"),
    (dict(mode="dense"), "mode='dense'"),
    (dict(variant="prr", predicted_blocks=0), "predicted_blocks=0"),
])
def test_bad_plans_are_refused_before_any_allocation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(StaticPlan(**kwargs), "quest", 6)


def test_an_engine_without_a_selector_object_is_refused_naming_the_fix():
    """The plan names no selector or predictor: the engine is given the run's objects, and
    refuses to start without a selector (no default one built behind the caller's back)."""
    model = Decoder(CONFIG, torch.float32, "cpu").init_random_(seed=3, std=0.05)
    with pytest.raises(ValueError, match=r"needs the run's selector object: pass selector="):
        GraphDecoder(model, StaticPlan(variant="serial"), batch=1, max_tokens=64, selector=None, predictor=None)
    with pytest.raises(TypeError, match="selector"):
        GraphDecoder(model, StaticPlan(variant="serial"), batch=1, max_tokens=64)  # a required argument


def test_budgets_larger_than_the_cache_are_refused():
    with pytest.raises(ValueError, match="selector.topk_blocks=400 exceeds"):
        make(StaticPlan(predicted_blocks=4), "quest", 400, "ema_membership")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
@pytest.mark.parametrize("variant,predictor", [("serial", "ema_membership"), ("prr", "ema_membership"), ("prr", "last_step")])
def test_cuda_graph_replay_equals_eager(variant, predictor):
    plan = StaticPlan(variant=variant, predicted_blocks=32)
    eager = make(plan, "quest", 32, predictor, context=3001, device="cuda", dtype=torch.bfloat16)
    want = decode(eager, 8)
    graphed = make(plan, "quest", 32, predictor, context=3001, device="cuda", dtype=torch.bfloat16)
    graph = graphed.capture(lambda: graphed.step(advance=True))
    graphed.fill_random_context(3001, seed=5)  # the warm-up steps advanced it: start over
    got = []
    for _ in range(8):
        graph.replay()
        got.append(graphed.graph_output.float().cpu())
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"step {step}")


def test_fused_projections_share_the_modules_storage():
    engine = make(StaticPlan(variant="dense"), "quest", 128)
    layer, fused = engine.model.model.layers[0], engine.weights.layers[0]
    assert layer.self_attn.k_proj.weight.data_ptr() == fused.wqkv[CONFIG.num_heads * CONFIG.head_dim:].data_ptr()
    assert layer.mlp.up_proj.weight.data_ptr() == fused.w_gate_up[CONFIG.intermediate_size:].data_ptr()


@pytest.mark.slow
def test_compiled_dense_parts_equal_eager():
    plan = StaticPlan(variant="prr", predicted_blocks=8)
    want = decode(make(plan, "quest", 6, "ema_membership"), 2)
    got = decode(compiled_engine(plan), 2)
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def compiled_engine(plan: StaticPlan) -> GraphDecoder:
    model = Decoder(CONFIG, torch.float32, DEVICE).init_random_(seed=3, std=0.05)
    engine = GraphDecoder(model, plan, batch=2, max_tokens=243, compile=True, selector=graph_selector("quest", 6),
                          predictor=graph_predictor("ema_membership"))
    engine.fill_random_context(203, seed=5)
    return engine


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
def test_compiled_graph_equals_eager_on_the_gpu():
    # fp32: in bf16 a rounding difference can flip a greedy token, and the runs part ways.
    plan = StaticPlan(variant="prr", predicted_blocks=40)
    model = Decoder(CONFIG, torch.float32, "cuda").init_random_(seed=3, std=0.05)
    eager = GraphDecoder(model, plan, batch=2, max_tokens=3100, selector=graph_selector("quest", 32),
                         predictor=graph_predictor("ema_membership"))
    eager.fill_random_context(3001, seed=5)
    want = decode(eager, 6)
    compiled = GraphDecoder(model, plan, batch=2, max_tokens=3100, compile=True, selector=graph_selector("quest", 32),
                            predictor=graph_predictor("ema_membership"))
    graph = compiled.capture(lambda: compiled.step(advance=True))
    compiled.fill_random_context(3001, seed=5)
    for step, a in enumerate(want):
        graph.replay()
        torch.testing.assert_close(compiled.graph_output.float().cpu(), a, rtol=1e-3, atol=1e-3, msg=f"step {step}")


def fused_projection_engine(plan: StaticPlan, selector: str, topk_blocks: int, predictor: str = "fixed",
                            device: str = DEVICE, context: int = 203, batch: int = 2) -> GraphDecoder:
    """make's engine with projections="fused"."""
    model = Decoder(CONFIG, torch.float32, device).init_random_(seed=3, std=0.05)
    engine = GraphDecoder(model, dataclasses.replace(plan, projections="fused"), batch=batch, max_tokens=context + 40,
                          selector=graph_selector(selector, topk_blocks), predictor=graph_predictor(predictor))
    engine.fill_random_context(context, seed=5)
    return engine


# The fused (Triton GEMV) projections: make test checks them through the batch-1 fused append
# below; the GPU tests capture both; make test-full runs these too.
@pytest.mark.parametrize("variant", [pytest.param("serial", marks=pytest.mark.slow),
                                     pytest.param("prr", marks=pytest.mark.slow)])
def test_fused_projections_decode_like_torch_projections(variant):
    """projections="fused" (Triton GEMVs with the norms, SwiGLU and residual adds inside) gives
    the logits of the F.linear path, step after step (fp32: only summation order differs);."""
    plan, objects = StaticPlan(variant=variant, predicted_blocks=8), ("quest", 6, "ema_membership")
    want = decode(make(plan, *objects), 3)
    got = decode(fused_projection_engine(plan, *objects), 3)
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def _no_append_launch(*args, **kwargs):
    """Stands in for the ops' append_token: the one-launch projection + append must not need it."""
    raise AssertionError("append_token launched: the q|k|v projection should have appended")


# (make test: the fused append through test_fused_append_follows_in_place_edits_of_the_model_weights and,
# kernel by kernel, test_kernels_qkv_append.py)
@pytest.mark.parametrize("variant,selector", [pytest.param("serial", "quest", marks=pytest.mark.slow),
                                              pytest.param("prr", "quest", marks=pytest.mark.slow),
                                              pytest.param("dense", "infllm", marks=pytest.mark.slow)])
def test_fused_append_at_batch_one_decodes_like_the_two_launches(variant, selector):
    """Batch 1, projections="fused": the q|k|v GEMV also rotates q and k and appends K/V and the
    Quest metadata (prr.kernels.qkv_append; append_token never launches). It decodes the logits
    of the F.linear path, and leaves the caches and metadata of the two-launch fused path."""
    plan, objects = StaticPlan(variant=variant, predicted_blocks=8), (selector, 6, "ema_membership")
    want = decode(make(plan, *objects, batch=1), 3)
    two = fused_projection_engine(dataclasses.replace(plan, fuse_append=False), *objects, batch=1)  # dense_gemv, then append_token(rope=...)
    two_launches = decode(two, 3)
    one = make(plan, *objects, batch=1).with_plan(projections="fused")  # a view: its paired weights built with it
    assert one.weights.paired is not None  # not inside a first (captured) step
    one.attn.ops.append_token = _no_append_launch
    got = decode(one, 3)
    for a, b, c in zip(want, two_launches, got, strict=True):
        torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(c, b, rtol=SAME_LOGITS, atol=SAME_LOGITS)
    assert torch.equal(one.pos, two.pos)
    for layer in range(CONFIG.num_layers):
        torch.testing.assert_close(one.keys[layer], two.keys[layer], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(one.values[layer], two.values[layer], rtol=1e-6, atol=1e-6)
        if selector == "quest" and one.sparse[layer]:
            torch.testing.assert_close(one.selector.metadata(one.cache, layer)[0], two.selector.metadata(two.cache, layer)[0], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(one.selector.metadata(one.cache, layer)[1], two.selector.metadata(two.cache, layer)[1], rtol=1e-6, atol=1e-6)


def test_fused_append_follows_in_place_edits_of_the_model_weights():
    """The paired q|k|v copy is refreshed when the model's q|k|v weights change in place (a
    reload), so the one-launch path keeps decoding what the two-launch path decodes."""
    plan = StaticPlan(variant="serial")
    one = fused_projection_engine(plan, "quest", 6, batch=1)
    two = fused_projection_engine(dataclasses.replace(plan, fuse_append=False), "quest", 6, batch=1)
    paired = one.paired_qkv_weights()[0][0]
    with torch.no_grad():
        one.model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)  # a view into the fused q|k|v weight
        two.model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
    for a, b in zip(decode(one, 2), decode(two, 2), strict=True):
        torch.testing.assert_close(a, b, rtol=SAME_LOGITS, atol=SAME_LOGITS)
    assert one.paired_qkv_weights()[0][0] is paired  # refreshed where it is (captured graphs keep pointers)


def test_paired_weights_make_their_row_order_only_when_they_rebuild():
    """A step reads the paired q|k|v copy through FusedWeights.paired_qkv; its row order (a host
    tensor copied to the device) is made only when the copy is (re)built, never in a step that
    finds it current: a copy from the host inside a CUDA graph capture is an error on the GPU."""
    one = fused_projection_engine(StaticPlan(variant="serial"), "quest", 6, batch=1)
    made = []

    def order():
        made.append(1)
        return one.attn.ops.rope_pair_permutation(one.hq, one.hkv, one.d)
    first = one.weights.paired_qkv(order, one.device)  # built with the engine: current
    decode(one, 2)
    assert one.weights.paired_qkv(order, one.device) is first and made == []
    with torch.no_grad():
        one.model.model.layers[0].self_attn.q_proj.weight.add_(0.5)
    one.weights.paired_qkv(order, one.device)
    assert made == [1]  # rebuilt once, in place, after the edit


def test_a_prefills_state_taken_over_after_views_reaches_every_view():
    """EngineState.take_over adopts the prefill's warmed predictor state into the engine and every
    view made before it (scored requests build their step view first, then take each request
    over): the views' steps learn from that state, a checkpoint covers it, and the step decodes
    what an engine that took the state over before its view decodes."""
    plan = StaticPlan(variant="prr", predicted_blocks=6)
    source = make(plan, "quest", 6, "ema_membership")
    decode(source, 3)  # a state that has learned from three steps
    first = source.token[:, 0].clone()
    masks = [None] * CONFIG.num_layers

    def warmed():
        return [t.clone() for t in state_tensors(source.predictor_state)]

    early = make(plan, "quest", 6, "ema_membership")
    view = early.with_plan(count_hits=True)  # made before the take-over
    early.take_over(int(early.pos[0]), first, source.attn.schedule.predictor.init_state(
        CONFIG.num_layers, 2, CONFIG.num_kv_heads, early.max_blocks, DEVICE), masks)
    for mine, theirs in zip(state_tensors(early.predictor_state), warmed(), strict=True):
        mine.copy_(theirs)  # (the warmed values, in the adopted tensors)
    assert view.predictor_state is early.predictor_state
    assert all(any(t is m for m in early.attn.mutable_tensors()) for t in state_tensors(view.predictor_state))
    late = make(plan, "quest", 6, "ema_membership")
    late.take_over(int(late.pos[0]), first, source.attn.schedule.predictor.init_state(
        CONFIG.num_layers, 2, CONFIG.num_kv_heads, late.max_blocks, DEVICE), masks)
    for mine, theirs in zip(state_tensors(late.predictor_state), warmed(), strict=True):
        mine.copy_(theirs)
    late.prime_predictions(int(late.pos[0]))
    early.prime_predictions(int(early.pos[0]))
    late_view = late.with_plan(count_hits=True)
    for a, b in zip(decode(view, 3), decode(late_view, 3), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(view.attn.schedule.pred_all, late_view.attn.schedule.pred_all)
    with pytest.raises(ValueError, match="needs the predictor state the prefill warmed"):
        early.take_over(int(early.pos[0]), first, None, masks)


def test_unknown_projections_are_refused():
    model = Decoder(CONFIG, torch.float32, "cpu").init_random_(seed=3, std=0.05)
    with pytest.raises(ValueError, match="projections='cublas' is not one of"):
        GraphDecoder(model, StaticPlan(variant="serial", projections="cublas"), batch=1, max_tokens=64,
                     selector=graph_selector("quest", 6), predictor=None)


def test_a_view_runs_another_plan_over_the_same_buffers_and_changes_neither_plan():
    """with_plan: serial DSA as a view of a PRR engine decodes what a serial engine decodes,
    advancing the shared position and cache; the engine's own plan is untouched; what sizes the
    buffers cannot change in a view, and a serial engine has no P for a PRR view."""
    want = decode(make(StaticPlan(variant="serial", predicted_blocks=6), "quest", 6), 2)
    engine = make(StaticPlan(variant="prr", predicted_blocks=6), "quest", 6, "last_step")
    view = engine.with_plan(variant="serial", count_hits=True)
    for a, b in zip(want, decode(view, 2), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    assert engine.plan.variant == "prr" and not engine.plan.count_hits and view.plan.variant == "serial"
    assert int(engine.pos[0]) == 205 and sum(engine.counters()["selected"]) > 0  # shared state and counters
    with pytest.raises(ValueError, match=r"\['predicted_blocks'\] size the engine's buffers"):
        engine.with_plan(predicted_blocks=8)
    with pytest.raises(ValueError, match="needs an engine built with variant='prr'"):
        make(StaticPlan(variant="serial"), "quest", 6).with_plan(variant="prr")
    with pytest.raises(ValueError, match="variant='fast' is not one of"):
        engine.with_plan(variant="fast")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
def test_fused_projections_graph_equals_torch_projections_on_the_gpu():
    plan, objects = StaticPlan(variant="prr", predicted_blocks=40), ("quest", 32, "ema_membership")
    want = decode(make(plan, *objects, context=3001, device="cuda"), 6)
    fused = fused_projection_engine(plan, *objects, device="cuda", context=3001)
    graph = fused.capture(lambda: fused.step(advance=True))
    fused.fill_random_context(3001, seed=5)
    for step, a in enumerate(want):
        graph.replay()
        torch.testing.assert_close(fused.graph_output.float().cpu(), a, rtol=1e-4, atol=1e-4, msg=f"step {step}")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
def test_fused_append_graph_at_batch_one_equals_torch_projections_on_the_gpu():
    """Batch 1, fused projections with the append in the q|k|v projection, captured in a graph."""
    plan, objects = StaticPlan(variant="prr", predicted_blocks=40), ("quest", 32, "ema_membership")
    want = decode(make(plan, *objects, context=3001, device="cuda", batch=1), 6)
    fused = fused_projection_engine(plan, *objects, device="cuda", context=3001, batch=1)
    fused.attn.ops.append_token = _no_append_launch
    graph = fused.capture(lambda: fused.step(advance=True))
    fused.fill_random_context(3001, seed=5)
    for step, a in enumerate(want):
        graph.replay()
        torch.testing.assert_close(fused.graph_output.float().cpu(), a, rtol=1e-4, atol=1e-4, msg=f"step {step}")


def test_weights_fused_by_a_first_forward_in_inference_mode_are_ordinary_tensors():
    """The eager prefill runs the model's first forward under torch.inference_mode, which fuses
    the projections (Decoder.layers): the fused weights and the parameters viewing them must
    not become inference tensors (the engine's paired copy reads their version counters)."""
    model = Decoder(CONFIG, torch.float32, "cpu").init_random_(seed=3, std=0.05)
    with torch.inference_mode():
        model(torch.zeros(1, 5, dtype=torch.long), 0, DenseAttention(CONFIG.num_layers))
    layer = model.fused_layers[0]
    assert not layer.wqkv.is_inference() and not model.model.layers[0].self_attn.q_proj.weight.is_inference()
    engine = GraphDecoder(model, StaticPlan(variant="serial", projections="fused"), batch=1, max_tokens=160,
                          selector=graph_selector("quest", 6), predictor=None)  # builds the paired q|k|v copy now
    assert engine.paired_qkv_weights()[0][0].shape == layer.wqkv.shape


@pytest.mark.parametrize("variant", ["serial", "prr"])
def test_every_selection_takes_the_steps_block_counts(variant, monkeypatch):
    """Each layer's selection gets the step's int32 block counts (step_positions), so the Triton
    path derives nothing per layer: the counts of 203 tokens + this one in blocks of 16."""
    engine = make(StaticPlan(variant=variant, predicted_blocks=3), "quest", 4, "last_step", batch=1)
    seen, select = [], engine.selector.select

    def recording(q, cache, layer, length=None, num_blocks=None):
        seen.append(num_blocks)
        return select(q, cache, layer, length, num_blocks=num_blocks)
    monkeypatch.setattr(engine.selector, "select", recording)
    engine.step(advance=True)
    assert len(seen) == sum(engine.sparse) and all(nb is not None for nb in seen)
    assert all(nb.dtype == torch.int32 and nb.tolist() == [-(-204 // 16)] for nb in seen)


@pytest.mark.slow  # 15 s under the interpreter: make test-full
def test_head_dim_256_runs_the_triton_engine_like_the_torch_ops():
    """The kernels' SUPPORTED_HEAD_DIMS (the one list backend=triton checks) holds 256: the whole
    PRR step (Quest selection, speculation, fused repair, predictor, counters) and the fused
    projections at head_dim 256 decode what the torch ops decode."""
    config = dataclasses.replace(CONFIG, head_dim=256)
    logits, hits = {}, {}
    for backend in ("torch", "triton"):
        model = Decoder(config, torch.float32, DEVICE).init_random_(seed=3, std=0.05)
        plan = StaticPlan(variant="prr", predicted_blocks=6, count_hits=True,
                          projections="fused" if backend == "triton" else "torch")
        engine = GraphDecoder(model, plan, batch=1, max_tokens=240, backend=backend, selector=graph_selector("quest", 6),
                              predictor=graph_predictor("last_step"))
        engine.fill_random_context(150, seed=5)
        logits[backend] = decode(engine, 3)
        hits[backend] = engine.counters()["hits"]
    assert hits["torch"] == hits["triton"] and sum(hits["torch"]) > 0
    for a, b in zip(logits["torch"], logits["triton"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def ema_engines(learn_at_once: bool, device: str = DEVICE, dtype=torch.float32, context: int = 99,
                predictor=None, room: int = 40, **plan_changes):
    """A PRR engine of 3 sparse layers (1..3) on the kernels, with room for `room` - 1 decode
    steps (a replaying predictor records that many first); predictor: default ema."""
    from prr.predictors import EmaPredictor

    config = dataclasses.replace(CONFIG, num_layers=4)
    plan = StaticPlan(variant="prr", predicted_blocks=5, learn_layers_at_once=learn_at_once, **plan_changes)
    model = Decoder(config, dtype, device).init_random_(seed=3, std=0.05)
    engine = GraphDecoder(model, plan, batch=2, max_tokens=context + room,
                          predictor=predictor if predictor is not None else EmaPredictor(calibrate=False, recent_blocks=1),
                          selector=graph_selector("quest", 4, dense_layers=(0,)))
    engine.fill_random_context(context, seed=5)
    engine.prime_predictions(context)
    return engine


def test_ema_learning_every_layer_at_once_equals_learning_after_each_layer(monkeypatch):
    """plan.learn_layers_at_once (the default): ema learns from every sparse layer's A in one update
    and one propose after the last sparse layer; the logits, every layer's P and the counters
    equal learning after each layer, step by step. (Also PRR's plan.count_at_step_end: `once`
    counts every layer in one launch before that update, which learns from the count's copy of
    A; `each`, whose P changes after each layer, counts per layer.)"""
    import prr.kernels.predict as kp
    import prr.kernels.step_counters as ks

    calls, learned, counted = [], [], []
    at_once, count_layers = kp.ema_update_layers, ks.step_counters_layers
    monkeypatch.setattr(kp, "ema_update_layers",
                        lambda *a, **k: calls.append(a[3].numel()) or learned.append(a[1]) or at_once(*a, **k))
    monkeypatch.setattr(ks, "step_counters_layers", lambda *a, **k: counted.append(a[0]) or count_layers(*a, **k))
    each, once = ema_engines(False), ema_engines(True, count_at_step_end=True)
    assert once.attn.schedule.predictor.backend == "triton" and once.attn.observers.counting.learn_range == (1, 3)
    for step in range(2):
        a = each.with_plan(count_hits=True).step(advance=True)
        b = once.with_plan(count_hits=True).step(advance=True)
        assert torch.equal(a, b), step
        assert torch.equal(each.attn.schedule.pred_all, once.attn.schedule.pred_all), step
        assert torch.equal(each.attn.schedule.pred_cnt_all, once.attn.schedule.pred_cnt_all), step
        assert torch.equal(each.attn.observers.counting.counts, once.attn.observers.counting.counts), step
        assert torch.equal(each.attn.observers.counting.prev_all, once.attn.observers.counting.prev_all), step
        assert torch.equal(each.attn.observers.counting.prev_cnt_all, once.attn.observers.counting.prev_cnt_all), step
    assert calls == [3] * 2  # one launch per step over the 3 sparse layers; none in the other engine
    assert [a.shape[0] for a in counted] == [3] * 2 and all(x is y for x, y in zip(learned, counted, strict=True))
    assert each.counters() == once.counters()
    assert int(sum(once.counters()["hits"])) > 0


def replaying(hit_rate: float):
    """bench_hit_rate as run.py builds it (calibrate() opens its run record before the engine records)."""
    from prr.predictors.bench_hit_rate import BenchHitRatePredictor

    predictor = BenchHitRatePredictor(hit_rate=hit_rate, seed=1)
    predictor.calibrate([])
    return predictor


# (make test-full: ema_membership shares last_step's StateRankPredictor path; spin's layer-range
# launches are checked bit for bit against its per-layer ones in test_kernels_predict.py;
# bench_hit_rate's at-once path runs in make test through test_bench_hit_rate.py's graph-engine
# runs, whose hit rates and tokens are exact)
@pytest.mark.parametrize("name", [pytest.param("last_step", marks=pytest.mark.slow),
                                  pytest.param("ema_membership", marks=pytest.mark.slow),
                                  pytest.param("spin", marks=pytest.mark.slow),
                                  pytest.param("bench_hit_rate", marks=pytest.mark.slow), "query_similarity"])
def test_predictors_learning_every_layer_at_once_equal_learning_after_each_layer(name, monkeypatch):
    """last_step, ema_membership and spin (with exploration: 2 of 5 blocks drawn) on the kernels learn
    like ema (plan.learn_layers_at_once): every sparse layer's update as L·B rows of one launch and
    the next step's P of every layer in one propose after the last sparse layer; the logits and
    every layer's P equal learning after each layer, step by step, and the at-once engine calls no
    per-layer update while decoding. bench_hit_rate (a benchmark tool) likewise: one counter add
    and one gather from its script for the range. query_similarity, which proposes in the step
    (its update writes no P), updates every layer at once and proposes nothing after it."""
    from prr.predictors import (
        EmaMembershipPredictor,
        LastStepPredictor,
        QuerySimilarityPredictor,
        SpinPredictor,
    )

    make = {"last_step": LastStepPredictor, "ema_membership": lambda: EmaMembershipPredictor(alpha=0.6),
            "spin": lambda: SpinPredictor(explore=0.4, seed=11), "bench_hit_rate": lambda: replaying(0.6),
            "query_similarity": lambda: QuerySimilarityPredictor(cache_size=3, neighbours=2)}[name]
    room = 5 if name == "bench_hit_rate" else 40  # (it records a serial pass of room - 1 steps first)
    each, once = ema_engines(False, predictor=make(), room=room), ema_engines(True, predictor=make(), room=room)
    assert once.attn.schedule.predictor.learns_layers_at_once() and once.attn.observers.counting.learn_range == (1, 3)
    calls = {"update": 0, "update_layers": 0}
    for method in calls:
        real = getattr(once.attn.schedule.predictor, method)
        monkeypatch.setattr(once.attn.schedule.predictor, method,
                            lambda *a, real=real, method=method, **k: calls.__setitem__(method, calls[method] + 1)
                            or real(*a, **k))
    for step in range(3):
        a = each.step(advance=True)
        b = once.step(advance=True)
        assert torch.equal(a, b), step
        assert torch.equal(each.attn.schedule.pred_all, once.attn.schedule.pred_all), step
        assert torch.equal(each.attn.schedule.pred_cnt_all, once.attn.schedule.pred_cnt_all), step
        assert all(torch.equal(x, y) for x, y in zip(state_tensors(each.attn.schedule.state),
                                                      state_tensors(once.attn.schedule.state), strict=True)), step
    assert calls == {"update": 0, "update_layers": 3}
    assert int(once.attn.schedule.pred_cnt_all[1:].sum()) > 0


def counting_engines(variant: str, at_end: bool, device: str = DEVICE, dtype=torch.float32, context: int = 99):
    """An engine of 3 sparse layers (1..3) with count_hits and plan.count_at_step_end=at_end:
    serial (no predictor), PRR with ema learning every layer at once, or PRR with query_similarity
    (qsim: it proposes in the step and its update writes no P)."""
    if variant in ("prr", "qsim"):
        from prr.predictors import QuerySimilarityPredictor

        predictor = QuerySimilarityPredictor(cache_size=3, neighbours=2) if variant == "qsim" else None
        return ema_engines(True, device, dtype, context, predictor=predictor, count_hits=True, count_at_step_end=at_end)
    model = Decoder(dataclasses.replace(CONFIG, num_layers=4), dtype, device).init_random_(seed=3, std=0.05)
    engine = GraphDecoder(model, StaticPlan(variant="serial", count_hits=True, count_at_step_end=at_end), batch=2,
                          max_tokens=context + 40, predictor=None,
                          selector=graph_selector("quest", 4, dense_layers=(0,)))
    engine.fill_random_context(context, seed=5)
    return engine


# (make test covers the count at the step's end through the ema at-once test's `once` engine)
@pytest.mark.parametrize("variant", [pytest.param("serial", marks=pytest.mark.slow),
                                     pytest.param("prr", marks=pytest.mark.slow),
                                     pytest.param("qsim", marks=pytest.mark.slow)])
def test_counters_at_step_end_equal_counting_after_each_layer(monkeypatch, variant):
    """plan.count_at_step_end (on by default): the counters of every sparse layer in one launch after
    the last one (serial; PRR with ema learning at once, whose update reuses the count's stacked
    A; PRR with query_similarity, learning after each layer) equal one launch per layer after its
    selection: logits, counters and A_{t-1}, step by step."""
    import prr.kernels.predict as kp
    import prr.kernels.step_counters as ks

    counted, learned = [], []
    count_layers, update_layers = ks.step_counters_layers, kp.ema_update_layers
    monkeypatch.setattr(ks, "step_counters_layers", lambda *a, **k: counted.append(a[0]) or count_layers(*a, **k))
    monkeypatch.setattr(kp, "ema_update_layers", lambda *a, **k: learned.append(a[1]) or update_layers(*a, **k))
    each, end = counting_engines(variant, False), counting_engines(variant, True)
    for step in range(2):
        a, b = each.step(advance=True), end.step(advance=True)
        assert torch.equal(a, b), step
        assert variant == "serial" or torch.equal(each.attn.schedule.pred_all, end.attn.schedule.pred_all), step
        assert torch.equal(each.attn.observers.counting.counts, end.attn.observers.counting.counts), step
        assert torch.equal(each.attn.observers.counting.prev_all, end.attn.observers.counting.prev_all) and torch.equal(each.attn.observers.counting.prev_cnt_all,
                                                                                 end.attn.observers.counting.prev_cnt_all), step
    assert [a.shape[0] for a in counted] == [3, 3]  # one launch per step over the 3 sparse layers, in `end` only
    if variant == "prr":  # ema learned from the count's copy of A in `end` (each step's second update)
        assert len(learned) == 4 and learned[1] is counted[0] and learned[3] is counted[1]
    counts = end.counters()
    assert sum(counts["overlap"]) > 0 and (variant == "serial" or sum(counts["hits"]) > 0)


def test_checkpoint_holds_every_buffer_a_step_writes_qsim():
    """A checkpoint taken before the first step restores after it (the GPU tests capture in
    between): query_similarity's id lists are sized when the engine is built, not at the first
    update (a replaced buffer would not match its checkpoint, and a captured graph would keep the old one)."""
    engine = counting_engines("qsim", True)
    start = engine.checkpoint()
    before = [t.data_ptr() for t in engine._mutable()]
    first = engine.step(advance=True)
    assert [t.data_ptr() for t in engine._mutable()] == before
    engine.restore(start)
    assert torch.equal(engine.step(advance=True), first)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
@pytest.mark.parametrize("variant", ["serial", "prr", "qsim"])
def test_gpu_counters_at_step_end_captured_equal_counting_after_each_layer(variant):
    """count_at_step_end in captured graphs (the count on the side stream, joined at the step's
    end): logits, counters and A_{t-1} equal per-layer counting on the main stream, replay by replay."""
    outs = []
    for at_end in (False, True):
        engine = counting_engines(variant, at_end, "cuda", torch.bfloat16, context=3001)
        start = engine.checkpoint()
        graph = engine.capture(lambda engine=engine: engine.step(advance=True))
        engine.restore(start)
        steps = []
        for _ in range(6):
            graph.replay()
            steps.append([engine.graph_output.float().cpu(), engine.attn.observers.counting.counts.cpu().clone(),
                          engine.attn.observers.counting.prev_all.cpu().clone(), engine.attn.observers.counting.prev_cnt_all.cpu().clone()])
        outs.append(steps)
    for step, (a, b) in enumerate(zip(*outs, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), step
    assert int(outs[1][-1][1][:, 3].sum()) > 0  # A_t overlapped A_{t-1} somewhere


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
@pytest.mark.parametrize("name", ["ema", "last_step", "ema_membership", "spin", "query_similarity"])
def test_gpu_learning_at_once_captured_equals_after_each_layer(name):
    from prr.predictors import (
        EmaMembershipPredictor,
        LastStepPredictor,
        QuerySimilarityPredictor,
        SpinPredictor,
    )

    make = {"ema": lambda: None, "last_step": LastStepPredictor, "ema_membership": EmaMembershipPredictor,
            "spin": lambda: SpinPredictor(explore=0.4, seed=11),
            "query_similarity": lambda: QuerySimilarityPredictor(cache_size=3, neighbours=2)}[name]
    engines = [ema_engines(flag, "cuda", torch.bfloat16, context=3001, predictor=make()) for flag in (False, True)]
    outs = []
    for engine in engines:
        start = engine.checkpoint()
        graph = engine.capture(lambda engine=engine: engine.step(advance=True))
        engine.restore(start)
        steps = []
        for _ in range(6):
            graph.replay()
            steps.append((engine.graph_output.float().cpu(), engine.attn.schedule.pred_all.cpu().clone()))
        outs.append(steps)
    for step, ((a, pa), (b, pb)) in enumerate(zip(*outs, strict=True)):
        assert torch.equal(a, b) and torch.equal(pa, pb), step


def _indexer_engine(projections: str, batch: int) -> GraphDecoder:
    """A serial engine at token granularity with a small lightning indexer (bf16 index keys)."""
    from prr.selectors.indexer import IndexerSelector

    selector = IndexerSelector(topk_tokens=24, sink_tokens=2, local_tokens=5, dense_layers=[0], index_heads=4,
                               index_dim=16, rope_dim=8, index_dtype="bf16")
    selector.bind_model(CONFIG)
    model = Decoder(CONFIG, torch.float32, DEVICE).init_random_(seed=3, std=0.05)
    plan = StaticPlan(variant="serial", block_size=1, projections=projections)
    engine = GraphDecoder(model, plan, batch=batch, max_tokens=120, selector=selector, predictor=None)
    engine.fill_random_context(90, seed=5)
    return engine


@pytest.mark.parametrize("batch", [1, pytest.param(2, marks=pytest.mark.slow)])  # (batch 1 also fuses the append)
def test_the_indexer_on_fused_projections_decodes_like_torch_projections(batch):
    """projections="fused": the indexer's stacked projection is one dense_gemv with the layer's RMSNorm
    inside, written into its slot (Selector.hidden_projection), instead of take_hidden(RMSNorm(x)); the
    logits follow the F.linear path's and each sparse layer's slot holds the same projection."""
    torch_path, fused = _indexer_engine("torch", batch), _indexer_engine("fused", batch)

    def no_decode_hidden(cache, layer, x, prefill):  # the fused path hands the indexer no hidden state
        raise AssertionError(f"take_hidden called at decode (layer {layer}): the fused GEMV should have projected")
    fused.attn.selector.take_hidden = no_decode_hidden
    for step, (a, b) in enumerate(zip(decode(torch_path, 3), decode(fused, 3), strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=f"step {step}")
    for layer in (1, 2):
        want = torch_path.cache.metadata[layer]["indexer_projection"]
        torch.testing.assert_close(fused.cache.metadata[layer]["indexer_projection"], want, rtol=1e-5, atol=1e-5)
