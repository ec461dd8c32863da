"""Defining properties of the predictors beyond the paper: spin, query_similarity,
cross_layer, and the calibrated EMA option; plus one tiny end-to-end run each."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from prr.blocks import BlockSet
from prr.predictors import CrossLayerPredictor, EmaPredictor, QuerySimilarityPredictor, SpinPredictor
from prr.selectors.base import Selection

N = 23  # max blocks
ROOT = Path(__file__).resolve().parents[1]


def selection(ids, scores=None, nb=N, heads=1):
    """A over blocks `ids` in a context of nb blocks: [1, heads, N]."""
    mask = torch.zeros(1, heads, N, dtype=torch.bool)
    mask[0, :, ids] = True
    s = torch.randn(1, heads, N) if scores is None else scores.expand(1, heads, N).clone()
    s = s.masked_fill(torch.arange(N) >= nb, float("-inf"))
    return Selection(BlockSet.from_mask(mask, max(len(ids), 1)), s)


def consistent(ids, nb=N):
    """A selection whose blocks are the top scorers, as a selector's are (bar forced blocks)."""
    scores = torch.zeros(1, 1, N)
    scores[0, 0, ids] = 3.0
    return selection(ids, scores, nb=nb)


def members(blocks: BlockSet, head: int = 0) -> list[int]:
    return blocks.indices[0, head, : blocks.count[0, head]].tolist()


# --- spin -------------------------------------------------------------------------------

def test_spin_without_exploration_ranks_a_static_pattern_best_first():
    scores = torch.linspace(-2, 2, N)[torch.randperm(N, generator=torch.Generator().manual_seed(1))].view(1, 1, N)
    best = scores[0, 0].argsort(descending=True)[:5].tolist()
    p = SpinPredictor(explore=0.0, selection_bonus=0.0)
    st = p.init_state(1, 1, 1, N, "cpu")
    for _ in range(6):
        p.update(st, 0, selection(best, scores))
    assert members(p.propose(st, 0, N, 5)) == best  # best first, in score order


def test_spin_diagonal_tracks_a_pattern_sliding_with_the_newest_block():
    # One new block per step; the selected block is always 3 blocks behind the newest.
    p = SpinPredictor(alpha_vertical=0.9, alpha_diagonal=0.9, explore=0.0)
    st = p.init_state(1, 1, 1, N, "cpu")
    for nb in range(8, 18):
        scores = torch.zeros(1, 1, N)
        scores[0, 0, nb - 1 - 3] = 5.0
        p.update(st, 0, selection([nb - 1 - 3], scores, nb=nb))
    # Next step has 18 blocks: the pattern is at block 14; the vertical EMA alone would not know it.
    assert members(p.propose(st, 0, 18, 1)) == [18 - 1 - 3]
    assert st.vertical[0, 0, 0, 14] < st.diagonal[0, 0, 0, 3]


def test_spin_exploration_share_and_determinism():
    p = SpinPredictor(explore=0.25, seed=3)
    st = p.init_state(2, 1, 2, N, "cpu")
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        p.update(st, 1, selection([0, 2, 4, 6], torch.randn(1, 2, N, generator=g), nb=20, heads=2))
    a, b = p.propose(st, 1, 20, 8), p.propose(st, 1, 20, 8)
    assert torch.equal(a.indices, b.indices) and (a.count == 8).all()  # same state -> same P
    ranked = torch.sort(p.rank(st, 1, 20)[0, 0], descending=True, stable=True).indices.tolist()
    assert members(a)[:6] == ranked[:6]  # floor(0.25 * 8) = 2 drawn: the best 6 in rank order first...
    assert not set(members(a)[6:]) & set(ranked[:6])  # ...then 2 drawn from the other blocks
    assert all(b < 20 for b in members(a)) and len(set(members(a))) == 8
    other = SpinPredictor(explore=0.25, seed=4)
    assert members(other.propose(st, 1, 20, 8))[6:] != members(a)[6:]  # another seed draws other blocks


def test_spin_validates_its_options():
    with pytest.raises(ValueError, match="explore=1.0"):
        SpinPredictor(explore=1.0)
    with pytest.raises(ValueError, match="alpha_diagonal=1.5"):
        SpinPredictor(alpha_diagonal=1.5)


# --- query_similarity ---------------------------------------------------------------------

def test_query_similarity_reuses_the_selection_of_an_identical_past_query():
    g = torch.Generator().manual_seed(0)
    q1, q2 = torch.randn(1, 1, 3, 8, generator=g), torch.randn(1, 1, 3, 8, generator=g)
    p = QuerySimilarityPredictor(cache_size=4, neighbours=1, recent_blocks=0)
    st = p.init_state(1, 1, 1, N, "cpu")
    p.propose(st, 0, N, 3, query=q1)
    p.update(st, 0, selection([2, 9, 15]))
    p.propose(st, 0, N, 3, query=q2)
    p.update(st, 0, selection([4, 5, 6]))  # the last selection, not q1's
    assert sorted(members(p.propose(st, 0, N, 3, query=q1 * 2.0))) == [2, 9, 15]  # cosine: scale-free
    assert sorted(members(p.propose(st, 0, N, 3, query=q2))) == [4, 5, 6]


def test_query_similarity_predicts_the_union_of_neighbours_and_recent_window():
    q = torch.ones(1, 1, 1, 4)
    p = QuerySimilarityPredictor(cache_size=8, neighbours=2, recent_blocks=2)
    st = p.init_state(1, 1, 1, N, "cpu")
    for ids in ([1, 3], [5, 7]):
        p.propose(st, 0, 20, 2, query=q)
        p.update(st, 0, selection(ids, nb=20))
    assert sorted(members(p.propose(st, 0, 20, 6, query=q))) == [1, 3, 5, 7, 18, 19]


def test_query_similarity_memory_is_bounded_by_cache_size():
    p = QuerySimilarityPredictor(cache_size=5, neighbours=2)
    st = p.init_state(2, 1, 3, N, "cpu")
    g = torch.Generator().manual_seed(0)
    sizes = []
    for step in range(12):
        p.propose(st, 1, N, 4, query=torch.randn(1, 3, 2, 8, generator=g))
        p.update(st, 1, selection([step % N, 7], nb=N, heads=3))
        sizes.append((st.keys.numel(), st.set_ids.numel(), st.set_count.numel()))
    # id lists of the selections' capacity (2), not max_blocks: C + 1 slots (the last: A_{t-1})
    assert len(set(sizes)) == 1 and st.keys.shape[3] == 5 and st.filled[1] == 5 and st.set_ids.shape[3:] == (6, 2)
    # the oldest pairs were overwritten: the 12th selection (block 11) is cached, the 1st (block 0) is not
    cached = BlockSet(st.set_ids[1, 0, 0, :5], st.set_count[1, 0, 0, :5]).mask(N)  # [C, N]
    assert cached[:, 11].any() and not cached[:, 0].any()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_query_similarity_lists_widen_for_a_larger_selection(backend):
    """The id lists are sized by the first selection's capacity and widened, the pairs kept, where a
    larger one comes later (eagerly)."""
    g = torch.Generator().manual_seed(2)
    q1, q2 = torch.randn(1, 1, 3, 8, generator=g), torch.randn(1, 1, 3, 8, generator=g)
    p = QuerySimilarityPredictor(cache_size=4, neighbours=1, recent_blocks=0)
    assert p.set_backend(backend) == backend
    st = p.init_state(1, 1, 1, N, "cpu")
    assert st.set_ids.shape[-1] == 0  # sized by the first update
    p.propose(st, 0, N, 2, query=q1)
    p.update(st, 0, selection([2, 9]))
    assert st.set_ids.shape[-1] == 2
    p.propose(st, 0, N, 2, query=q2)
    p.update(st, 0, selection([4, 5, 6, 7]))
    assert st.set_ids.shape[-1] == 4
    assert sorted(members(p.propose(st, 0, N, 2, query=q1))) == [2, 9]
    assert sorted(members(p.propose(st, 0, N, 4, query=q2))) == [4, 5, 6, 7]


def test_query_similarity_refuses_to_guess_without_the_query():
    p = QuerySimilarityPredictor()
    st = p.init_state(1, 1, 1, N, "cpu")
    with pytest.raises(ValueError, match="needs this step's query"):
        p.propose(st, 0, N, 3)


# --- cross_layer ----------------------------------------------------------------------------

def test_cross_layer_predicts_the_layer_below_of_the_same_step():
    p = CrossLayerPredictor(temporal_weight=0.0, calibrate=False)
    st = p.init_state(3, 1, 1, N, "cpu")
    for t in range(3):  # warm-up steps: layers 1 and 2 sparse, layer 0 dense
        p.update(st, 1, consistent([t, 10]))
        p.update(st, 2, consistent([20, 21]))
    a1 = consistent([3, 8, 12])  # layer 1 at the new step
    p.update(st, 1, a1)
    assert sorted(members(p.propose(st, 2, N, 3))) == [3, 8, 12]  # not layer 2's own [20, 21]
    # the first sparse layer has nothing below: its own temporal EMA (stickiness on its last set)
    assert p.source_layer(st, 1) is None
    # The source is structural, the same on every step: the nearest layer ever selected below
    # (layer 0 is dense and never is), not a count of this step's updates that would live on the host.
    p.update(st, 2, selection([1, 2]))
    assert p.source_layer(st, 2) == 1 and p.source_layer(st, 0) is None


def test_cross_layer_source_skips_dense_layers_and_ignores_layers_above():
    p = CrossLayerPredictor(temporal_weight=0.0, calibrate=False)
    st = p.init_state(5, 1, 1, N, "cpu")
    for layer in (1, 4):  # layers 0, 2 and 3 dense
        p.update(st, layer, consistent([layer, 10]))
    assert [p.source_layer(st, i) for i in range(5)] == [None, None, 1, 1, 1]
    assert sorted(members(p.propose(st, 4, N, 2))) == [1, 10]  # layer 1's set, past dense layers 2-3


def test_cross_layer_with_full_temporal_weight_is_the_ema():
    g = torch.Generator().manual_seed(0)
    cross = CrossLayerPredictor(temporal_weight=1.0, calibrate=False)
    ema = EmaPredictor(calibrate=False)
    sc, se = cross.init_state(2, 1, 1, N, "cpu"), ema.init_state(2, 1, 1, N, "cpu")
    for _ in range(4):
        for layer in (0, 1):
            a = selection(torch.randperm(N, generator=g)[:4].tolist())
            cross.update(sc, layer, a)
            ema.update(se, layer, a)
    assert torch.equal(cross.rank(sc, 1, N), ema.rank(se, 1, N))


# --- shared properties -----------------------------------------------------------------------

def make(name):
    q = torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(9))
    return {
        "spin": (SpinPredictor(explore=0.2), {}),
        "query_similarity": (QuerySimilarityPredictor(cache_size=3), {"query": q}),
        "cross_layer": (CrossLayerPredictor(temporal_weight=0.5, calibrate=False), {}),
    }[name]


@pytest.mark.parametrize("name", ["spin", "query_similarity", "cross_layer"])
def test_never_proposes_blocks_beyond_the_context_and_is_deterministic(name):
    runs = []
    for _ in range(2):
        p, extra = make(name)
        st = p.init_state(2, 1, 2, N, "cpu")
        g = torch.Generator().manual_seed(5)
        proposals = []
        for nb in range(4, 14):
            for layer in (0, 1):
                blocks = p.propose(st, layer, nb, 8, **extra)
                valid = blocks.indices[blocks.valid()]
                assert (valid < nb).all() and (blocks.count <= min(8, nb)).all()
                proposals.append(blocks.indices.clone())
                ids = torch.randperm(nb, generator=g)[:3].tolist()
                p.update(st, layer, selection(ids, torch.randn(1, 2, N, generator=g), nb=nb, heads=2))
        runs.append(torch.stack(proposals))
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("predictor", ["spin", "query_similarity", "cross_layer", "ema_calibrated"])
def test_runs_end_to_end_on_the_tiny_model(tmp_path, predictor):
    from prr.runner import run

    overrides = ["model=tiny-random", "logger=none", "selector.dense_layers=[0]", "task.prompt_tokens=300",
                 "task.max_new_tokens=6", "task.stop_at_eos=false", "selector.topk_blocks=6", "runtime.block_size=16",
                 f"predictor={predictor}", "budget.ratio=1.5", "runtime.check_serial=true"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    summary = run(cfg, tmp_path / predictor)
    assert 0 < summary["hit_rate"] <= 1 and summary["mean_predicted_blocks"] == 9
    assert summary["max_serial_relerr"] <= 1e-5  # exact repair: PRR output is serial DSA's, whatever P


def test_hit_rate_figure_draws_one_line_per_predictor_and_task(tmp_path):
    import pandas as pd

    from analysis.predictor_figures import plot_hit_rate_vs_budget, save_hit_rate_vs_budget

    rows = [{"task": t, "predictor": p, "ratio": r, "hit_rate": 0.5 + 0.1 * r + 0.01 * i}
            for t in ("long_text", "ruler_niah") for i, p in enumerate(("ema", "spin", "cross_layer")) for r in (1.0, 1.5)]
    fig = plot_hit_rate_vs_budget(pd.DataFrame(rows))
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["long_text", "ruler_niah"]
    assert all(len(ax.get_lines()) == 3 for ax in panels)
    assert list(panels[0].get_lines()[1].get_ydata()) == pytest.approx([61.0, 66.0])  # spin, in %
    paths = save_hit_rate_vs_budget(pd.DataFrame(rows), tmp_path)
    assert sorted(p.suffix for p in paths) == [".pdf", ".png"] and all(p.stat().st_size > 0 for p in paths)
    with pytest.raises(ValueError, match="missing \\['hit_rate'\\]"):
        plot_hit_rate_vs_budget(pd.DataFrame(rows).drop(columns="hit_rate"))
