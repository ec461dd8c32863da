"""LESS's decode-token metadata split (StaticPlan.side_summaries, issue 33): Quest's key max / min in
the cache append kernel, the feature summaries apart (beside selection and attention on a GPU's side
stream, joined before the compensation), against one less_append launch before selection
(side_summaries=False): identical logits, A, P and metadata step by step, serial and PRR (ema).
CPU: the kernels under TRITON_INTERPRET=1, one stream (program order); -m gpu: two streams, graphs."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from prr.model.decoder import Decoder
from prr.runtime.graph_decode import GraphDecoder, StaticPlan
from prr.selectors import LessSelector
from tests.test_graph_decode import CONFIG

GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def less_engine(plan: StaticPlan, predictor: str, device: str = DEVICE, dtype=torch.float32, context: int = 101,
                block_size: int = 16, summary_dtype: str = "float32", num_features: int = 24) -> GraphDecoder:
    """A 2-layer random model (layer 0 dense), 3 query heads of one KV head (the interpreter's time
    is the compensation kernel's programs), 2 rows, LESS top-3 over `context` random tokens."""
    from prr.predictors import EmaPredictor

    config = dataclasses.replace(CONFIG, num_layers=2, num_heads=3, num_kv_heads=1)
    model = Decoder(config, dtype, device).init_random_(seed=3, std=0.05)
    selector = LessSelector(topk_blocks=3, sink_blocks=1, dense_layers=(0,), num_features=num_features,
                            summary_dtype=summary_dtype, seed=1)
    engine = GraphDecoder(model, dataclasses.replace(plan, block_size=block_size), batch=2, max_tokens=context + 40,
                          selector=selector,
                          predictor=EmaPredictor(calibrate=False, recent_blocks=1) if predictor == "ema" else None)
    engine.fill_random_context(context, seed=5)
    if predictor == "ema":
        engine.prime_predictions(context)
    return engine


def state(engine: GraphDecoder) -> dict[str, torch.Tensor]:
    """Every layer's metadata slots, A and P, as CPU tensors."""
    out = {}
    for layer in range(engine.num_layers):
        for name, t in engine.cache.metadata[layer].items():
            out[f"{layer}.{name}"] = t.cpu().clone()
        if engine.attn.last_selection[layer] is not None:
            out[f"{layer}.A"] = torch.cat([t.cpu().reshape(-1) for t in engine.attn.last_selection[layer]])
    if engine.attn.schedule.pred_all is not None:
        out["P"], out["|P|"] = engine.attn.schedule.pred_all.cpu().clone(), engine.attn.schedule.pred_cnt_all.cpu().clone()
    return out


def check_equal(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys(), where
    for name in a:
        assert torch.equal(a[name], b[name]), f"{where}: {name}"


@pytest.mark.parametrize("variant,predictor,block_size,summary_dtype", [
    pytest.param("serial", "none", 16, "float32", marks=pytest.mark.slow),  # make test keeps block 64 (the issue's)
    pytest.param("prr", "ema", 16, "bfloat16", marks=pytest.mark.slow), ("serial", "none", 64, "bfloat16")])
def test_side_summaries_decode_like_one_less_append(variant, predictor, block_size, summary_dtype, monkeypatch):
    """The split leaves every value as it was (the append kernel's Quest max / min are exact; the
    summaries are less_append's without them), step by step across a block boundary; the split
    really ran: less_append without Quest's metadata, the append kernel with it."""
    import prr.kernels.less as kl

    calls = []
    launch = kl.less_append
    monkeypatch.setattr(kl, "less_append", lambda *a, **k: calls.append(len(a) > 13 and a[13] is not None)
                        or launch(*a, **k))
    plan = StaticPlan(variant=variant, predicted_blocks=2, count_hits=True, side_summaries=True)
    context = 2 * block_size - 2 if block_size == 64 else 94  # crosses a block boundary at step 2
    one = less_engine(dataclasses.replace(plan, side_summaries=False), predictor, context=context,
                      block_size=block_size, summary_dtype=summary_dtype)
    split = less_engine(plan, predictor, context=context, block_size=block_size, summary_dtype=summary_dtype)
    assert split.attn.summaries_beside() and not one.attn.summaries_beside()
    check_equal(state(one), state(split), "prefill")
    for step in range(3):
        calls.clear()
        a, b = one.step(advance=True), split.step(advance=True)
        assert calls == [True, False], step  # the sparse layer: fused with Quest's, then apart
        assert torch.equal(a, b), step
        check_equal(state(one), state(split), f"step {step}")
    assert one.counters() == split.counters()


def test_side_summaries_only_where_exact():
    """Not split where selection reads the summaries (scores=features), without a compensation, on
    the torch backend (its append takes no metadata), in the eager runtime, or with the flag off."""
    plan = StaticPlan(variant="serial", side_summaries=True)
    engine = less_engine(plan, "none")
    assert engine.attn.summaries_beside()
    assert not engine.with_plan(side_summaries=False).attn.summaries_beside()
    for kw in (dict(scores="features"), dict(compensate=False)):
        assert not LessSelector(topk_blocks=3, **kw).summaries_apart(), kw
    from prr.selectors import QuestSelector

    assert not QuestSelector(topk_blocks=3).summaries_apart()
    with pytest.raises(NotImplementedError, match="summaries_apart"):
        QuestSelector(topk_blocks=3).append_summaries(engine.cache, 1, engine.pos)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
@pytest.mark.parametrize("variant,predictor,block_size", [("serial", "none", 16), ("serial", "none", 64),
                                                          ("prr", "ema", 64)])
def test_gpu_side_summaries_captured_equal_one_less_append(variant, predictor, block_size):
    """On a GPU, two streams, each engine's step replayed from a CUDA graph: the summaries on the side
    stream (joined by an event before the compensation) give the logits, A, P and metadata of one
    less_append before selection, bit for bit, over 12 steps (a missing join would let the
    compensation read a stale block: other bits)."""
    plan = StaticPlan(variant=variant, predicted_blocks=8, count_hits=True)
    outs = []
    for side in (False, True):
        engine = less_engine(dataclasses.replace(plan, side_summaries=side), predictor, "cuda", torch.bfloat16,
                             context=3001, block_size=block_size, summary_dtype="bfloat16", num_features=32)
        assert engine.attn.summaries_beside() == side and engine.attn.streams.stream is not None
        start = engine.checkpoint()
        graph = engine.capture(lambda engine=engine: engine.step(advance=True))
        engine.restore(start)
        steps = []
        for _ in range(12):
            graph.replay()
            torch.cuda.synchronize()
            steps.append((engine.graph_output.float().cpu(), state(engine)))
        outs.append(steps)
    for step, ((a, sa), (b, sb)) in enumerate(zip(*outs, strict=True)):
        assert torch.equal(a, b), step
        check_equal(sa, sb, f"step {step}")
