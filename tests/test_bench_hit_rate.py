"""predictor=bench_hit_rate, the benchmark tool that replays a recorded serial pass with a chosen
share of each A swapped out (prr/predictors/bench_hit_rate.py): its defining property, the
measured hit rate equals the requested share (exactly per (row, KV head), up to the rounding of
round(hit_rate·min(|A|, |P|))), and exact-mode PRR over its P decodes serial DSA's tokens."""

from __future__ import annotations

import os

import pytest
import torch

from prr.blocks import BlockSet
from prr.config_check import ConfigError
from prr.predictors.bench_hit_rate import BenchHitRatePredictor, swapped_predictions
from tests.test_graph_run import run_tiny

GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()


def random_selections(rows: int, cap: int, num_blocks: torch.Tensor, gen: torch.Generator):
    """A of each row: between 1 and cap distinct blocks below its num_blocks, ascending, padded with 0."""
    idx = torch.zeros(rows, cap, dtype=torch.int32)
    cnt = torch.zeros(rows, dtype=torch.int32)
    for r in range(rows):
        n = int(torch.randint(1, min(cap, int(num_blocks[r])) + 1, (1,), generator=gen))
        a = torch.randperm(int(num_blocks[r]), generator=gen)[:n].sort().values
        idx[r, :n], cnt[r] = a.int(), n
    return idx, cnt


@pytest.mark.parametrize("hit_rate", [0.0, 0.3, 0.5, 0.7, 0.9, 1.0])
@pytest.mark.parametrize("size", [3, 8, 13])
def test_p_holds_the_asked_share_of_a_per_row(hit_rate, size):
    """Per row: |P ∩ A| = round(hit_rate·min(|A|, size)); the rest of P lies in the context
    outside A (as many as there are, up to size); P ascending, distinct, padded with 0."""
    gen = torch.Generator().manual_seed(7)
    rows, cap, max_blocks = 200, 8, 40
    num_blocks = torch.randint(1, max_blocks + 1, (rows,), generator=gen)
    num_blocks[:5] = torch.tensor([1, 2, 8, 9, 10])  # contexts with few or no blocks outside A
    idx, cnt = random_selections(rows, cap, num_blocks, gen)
    p, pcnt, keep = swapped_predictions(idx, cnt, num_blocks, hit_rate, size, max_blocks,
                                        torch.Generator().manual_seed(3))
    assert p.shape == (rows, size) and p.dtype == torch.int32 and pcnt.dtype == torch.int32
    for r in range(rows):
        a = set(idx[r, : cnt[r]].tolist())
        members = p[r, : pcnt[r]].tolist()
        want_keep = round(hit_rate * min(len(a), size))
        assert int(keep[r]) == want_keep
        assert len(set(members) & a) == want_keep
        assert members == sorted(set(members)) and all(0 <= b < int(num_blocks[r]) for b in members)
        assert len(members) == want_keep + min(size - want_keep, int(num_blocks[r]) - len(a))
        assert (p[r, pcnt[r] :] == 0).all()
    again = swapped_predictions(idx, cnt, num_blocks, hit_rate, size, max_blocks, torch.Generator().manual_seed(3))
    assert all(torch.equal(x, y) for x, y in zip((p, pcnt, keep), again, strict=True))  # seeded: deterministic


def test_the_script_replays_the_recorded_steps_per_layer():
    """Record -> script -> replay on the predictor alone: update advances each layer's device
    counter (recording A while recording is on), propose copies P of the counter's step, and P's
    hits against the recorded A are the asked share, per (row, KV head); past the recorded steps P
    is empty."""
    layers, steps, batch, heads, cap, max_blocks, size = 3, 4, 2, 3, 5, 30, 5
    pred = BenchHitRatePredictor(hit_rate=0.6, seed=1)
    state = pred.init_state(layers, batch, heads, max_blocks, "cpu")
    pred.update(state, 1, selection_of(torch.zeros(batch, heads, cap, dtype=torch.int32), 2))  # a prefill-tail update
    pred.start_recording(state, steps, batch, heads, cap, max_blocks)
    assert state.step.tolist() == [0, 0, 0]
    gen = torch.Generator().manual_seed(0)
    recorded = {}
    for s in range(steps):
        for layer in (1, 2):
            idx, cnt = random_selections(batch * heads, cap, torch.full((batch * heads,), 20 + s), gen)
            recorded[s, layer] = (idx, cnt)
            pred.update(state, layer, selection_of(idx.view(batch, heads, cap), cnt.view(batch, heads)))
            assert pred.propose(state, layer, 20, size).count.sum() == 0  # no P while recording
    state.step.zero_()  # (the engine rewinds its checkpoint)
    info = pred.finish_recording(state, torch.tensor([[20 + s] * batch for s in range(steps)]), size, [1, 2])
    hits = total = 0
    for s in range(steps):
        for layer in (1, 2):
            p = pred.propose(state, layer, 20 + s, size)
            idx, cnt = recorded[s, layer]
            for r in range(batch * heads):
                a = set(idx[r, : cnt[r]].tolist())
                got = set(p.indices.view(-1, size)[r, : p.count.view(-1)[r]].tolist())
                assert len(got & a) == round(0.6 * min(len(a), size))
                hits, total = hits + len(got & a), total + len(a)
            pred.update(state, layer, selection_of(idx.view(batch, heads, cap), cnt.view(batch, heads)))
    assert info["expected_hit_rate"] == pytest.approx(hits / total, abs=1e-15) and info["selected"] == total
    assert pred.propose(state, 1, 24, size).count.sum() == 0  # past the recorded steps: an empty P
    assert state.step.tolist() == [0, steps, steps]


def selection_of(idx: torch.Tensor, cnt: torch.Tensor):
    from prr.selectors.base import Selection

    return Selection(BlockSet(idx, cnt), torch.zeros(*idx.shape[:2], 30))


@pytest.mark.parametrize("hit_rate,extra", [(0.5, []), (1 / 3, []), (0.0, []), (0.5, ["budget.ratio=1.5"])])
def test_a_whole_run_hits_the_asked_share_and_decodes_serial_dsa(tmp_path, hit_rate, extra):
    """runtime.engine=graph (CPU: torch ops): the measured hit rate is round(h·6)/6 of each A of 6
    blocks, exactly; exact-mode PRR over that P decodes serial DSA's tokens."""
    serial = run_tiny(tmp_path, "predictor=none", "runtime.engine=graph", name="serial")
    run = run_tiny(tmp_path, "predictor=bench_hit_rate", f"predictor.hit_rate={hit_rate}", *extra,
                   "runtime.engine=graph", name="replay")
    assert run["generated_token_ids"] == serial["generated_token_ids"]
    assert run["variant"] == "prr" and run["predicted_blocks"] == (9 if extra else 6)
    assert run["hit_rate"] == round(hit_rate * 6) / 6  # every A holds 6 blocks (K = 6 of 19)
    record = run["budget_setup"]["calibration"]  # the script's counts, in the run's record
    assert record["expected_hit_rate"] == run["hit_rate"]
    assert record["hits"] == round(hit_rate * 6) * record["selected"] // 6
    if hit_rate > 0:
        assert run["precision"] == pytest.approx(round(hit_rate * 6) / run["predicted_blocks"], abs=1e-12)


def test_replay_holds_over_several_sparse_layers_in_bf16(tmp_path):
    """3 sparse layers (each its own step counter and script), bf16 on the CPU's torch ops: the
    asked share exactly and serial DSA's tokens."""
    more = ["++model.num_layers=4", "task.prompt_tokens=600", "task.max_new_tokens=8", "selector.topk_blocks=8",
            "runtime.dtype=bfloat16", "runtime.engine=graph"]
    serial = run_tiny(tmp_path, "predictor=none", *more, name="serial")
    run = run_tiny(tmp_path, "predictor=bench_hit_rate", "predictor.hit_rate=0.5", *more, name="replay")
    assert run["generated_token_ids"] == serial["generated_token_ids"] and run["hit_rate"] == 0.5


@pytest.mark.parametrize("overrides,match", [
    (["predictor=bench_hit_rate"], "only runtime.engine=graph records"),
    (["predictor=bench_hit_rate", "predictor.hit_rate=1.5", "runtime.engine=graph"],
     r"predictor.hit_rate=1.5 must lie in \[0, 1\]"),
    (["predictor=bench_hit_rate", "predictor.hit_rate=0.7", "budget=profiled", "runtime.engine=graph"],
     "set budget.hit_rate=0.7"),
])
def test_what_it_cannot_replay_is_refused(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        run_tiny(tmp_path, *overrides, name="refused")
    assert not (tmp_path / "refused").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_replay_on_a_gpu_hits_the_asked_share(tmp_path, dtype):
    """The replay inside the captured CUDA-graph step (P copied on the side stream from the script
    by the device counter): the asked share exactly and serial DSA's tokens."""
    gpu = ["runtime=cuda", f"runtime.dtype={dtype}", "backend=triton"]
    serial = run_tiny(tmp_path, "predictor=none", *gpu, name="serial")
    run = run_tiny(tmp_path, "predictor=bench_hit_rate", "predictor.hit_rate=0.5", *gpu, name="replay")
    assert run["generated_token_ids"] == serial["generated_token_ids"]
    assert run["hit_rate"] == 0.5


def test_a_forced_token_replaces_the_greedy_one_where_the_table_has_one():
    """GraphDecoder.forced_tokens (the replay's teacher forcing): a row whose table holds a token at
    the step's position reads it as the next input; a row holding -1 there reads its greedy token."""
    from prr.runtime.graph_decode import StaticPlan
    from tests.test_graph_decode import make

    engine = make(StaticPlan(variant="serial"), "quest", 6, context=203, batch=2)
    free = make(StaticPlan(variant="serial"), "quest", 6, context=203, batch=2)
    greedy = free.step(advance=True).argmax(-1)  # [B]: what each row would read next
    engine.forced_tokens = torch.full((2, engine.max_tokens), -1, dtype=torch.long)
    forced = (int(greedy[0]) + 1) % engine.model.config.vocab_size  # any token but the greedy one
    engine.forced_tokens[0, 203] = forced
    engine.step(advance=True)
    assert engine.token[:, 0].tolist() == [forced, int(greedy[1])]
    assert engine.pos.tolist() == [204, 204]
