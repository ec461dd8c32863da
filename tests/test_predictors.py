"""Predictors' defining properties."""

import pytest
import torch

from prr.blocks import BlockSet
from prr.predictors import EmaPredictor, LastStepPredictor, NoPredictor, OraclePredictor
from prr.predictors.ema import standardise
from prr.selectors.base import Selection

N = 23  # max blocks


def selection(ids, scores=None, nb=N):
    mask = torch.zeros(1, 1, N, dtype=torch.bool)
    mask[0, 0, ids] = True
    s = torch.randn(1, 1, N) if scores is None else scores
    s = s.masked_fill(torch.arange(N) >= nb, float("-inf"))
    return Selection(BlockSet.from_mask(mask, len(ids)), s)


def test_none_predicts_nothing():
    p = NoPredictor()
    st = p.init_state(2, 1, 1, N, "cpu")
    assert p.propose(st, 0, N, 10).count.sum() == 0


def test_last_step_predicts_previous_selection():
    p = LastStepPredictor()
    st = p.init_state(2, 1, 1, N, "cpu")
    p.update(st, 1, selection([0, 4, 7, 22]))
    pred = p.propose(st, 1, N, 10)
    assert sorted(pred.indices[0, 0, : pred.count[0, 0]].tolist()) == [0, 4, 7, 22]
    assert p.propose(st, 0, N, 10).count.sum() == 0  # other layer saw nothing


def test_oracle_returns_current_selection_whatever_the_budget():
    p = OraclePredictor()
    st = p.init_state(1, 1, 1, N, "cpu")
    a = selection([1, 2, 3])
    assert p.propose(st, 0, N, 0, current=a) is a.blocks


def test_ema_update_matches_formula():
    p = EmaPredictor(alpha=0.5, stickiness=2.0, recency=3.0, recent_blocks=1, calibrate=False)
    st = p.init_state(1, 1, 1, N, "cpu")
    s1, s2 = torch.randn(1, 1, N), torch.randn(1, 1, N)
    p.update(st, 0, selection([0, 5], s1))
    p.update(st, 0, selection([5, 9], s2))
    ema = 0.5 * (0.5 * standardise(s1)) + 0.5 * standardise(s2)
    expected = ema.clone()
    expected[0, 0, [5, 9]] += 2.0
    expected[0, 0, N - 1] += 3.0
    assert torch.allclose(p.rank(st, 0, N), expected, atol=1e-6)
    assert torch.isneginf(p.rank(st, 0, N - 3)[0, 0, N - 3 :]).all()  # outside the context


def test_ema_calibration_prefers_stickiness_on_a_static_selection():
    # A fixed selection whose blocks score low: only stickiness (β > 0) predicts it.
    history = []
    g = torch.Generator().manual_seed(0)
    for _ in range(16):
        scores = torch.randn(1, 1, N, generator=g)
        scores[0, 0, [2, 11, 17]] = -3.0
        history.append(selection([2, 11, 17], scores))
    p = EmaPredictor(alpha_grid=(0.0, 0.5), stickiness_grid=(0.0, 4.0), recency_grid=(0.0,), calibrate=True)
    info = p.calibrate([None, history])
    assert info["stickiness"] == 4.0 and info["calibration_hit_rate"] == 1.0
    st = p.init_state(2, 1, 1, N, "cpu")
    assert st.stickiness[1] == 4.0


def static_history() -> list[Selection]:
    """A fixed selection whose blocks score low (only stickiness predicts it), 16 steps."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(16):
        scores = torch.randn(1, 1, N, generator=g)
        scores[0, 0, [2, 11, 17]] = -3.0
        out.append(selection([2, 11, 17], scores))
    return out


@pytest.mark.parametrize("per_layer", [False, True])
def test_ema_calibration_keeps_an_alpha_the_config_gives_and_fits_an_unset_one(per_layer):
    grids = dict(alpha_grid=(0.0, 0.5), stickiness_grid=(0.0, 4.0), recency_grid=(0.0,), per_layer=per_layer,
                 calibrate=True)
    kept = EmaPredictor(alpha=0.9, **grids)  # predictor.alpha=0.9: not in the grid, kept all the same
    info = kept.calibrate([None, static_history()])
    assert info["kept"] == ["alpha"] and info["alpha"] == pytest.approx([0.9, 0.9] if per_layer else 0.9)
    # (per layer: layer 0 has no history and takes the uncalibrated stickiness)
    assert info["stickiness"] == pytest.approx([1.0, 4.0] if per_layer else 4.0)
    assert kept.init_state(2, 1, 1, N, "cpu").alpha.tolist() == pytest.approx([0.9, 0.9])
    fitted = EmaPredictor(**grids)  # alpha: null (the YAML default): calibrated over its grid
    info = fitted.calibrate([None, static_history()])
    assert info["kept"] == [] and float(fitted.init_state(2, 1, 1, N, "cpu").alpha[1]) in (0.0, 0.5)
    assert EmaPredictor(calibrate=False).init_state(1, 1, 1, N, "cpu").alpha.tolist() == pytest.approx([0.8])
    assert EmaPredictor().calibrate([None, static_history()]) == {}  # opt-in since issue 53


def test_the_calibration_log_line_marks_kept_values():
    from prr.runtime.eager_run import calibration_line

    assert calibration_line({"alpha": 0.5, "stickiness": 4.0, "kept": ["alpha"]}) == "alpha=0.5 (kept), stickiness=4.0"


def test_ema_calibration_is_causal():
    # A alternates between two disjoint sets and its blocks score high only when selected:
    # a replay that peeked at A_t would be perfect; a causal one cannot be.
    history = []
    for t in range(16):
        ids = [1, 3, 5] if t % 2 else [10, 12, 14]
        scores = torch.zeros(1, 1, N)
        scores[0, 0, ids] = 5.0
        history.append(selection(ids, scores))
    info = EmaPredictor(alpha_grid=(0.0, 0.5, 0.9), stickiness_grid=(0.0, 4.0), recency_grid=(0.0,),
                        calibrate=True).calibrate([history])
    assert info["calibration_hit_rate"] < 0.9


def test_ema_calibration_of_rows_with_different_contexts_does_not_depend_on_their_order():
    """A ragged batch calibrates on its rows' stacked histories: each row's recency bonus and
    mask follow its own context (rows of 12 and 23 blocks whose newest block is always in A)."""
    from prr.selectors.base import stack_rows

    g = torch.Generator().manual_seed(3)

    def row(nb: int) -> list[Selection]:
        out = []
        for _ in range(16):
            scores = torch.randn(1, 1, N, generator=g)
            ids = sorted({nb - 1, *torch.randperm(nb - 1, generator=g)[:2].tolist()})
            out.append(selection(ids, scores, nb=nb))
        return out

    short, long = row(12), row(N)
    grid = dict(alpha_grid=(0.0, 0.9), stickiness_grid=(0.0,), recency_grid=(0.0, 4.0), calibrate=True)
    infos = [EmaPredictor(**grid).calibrate([[stack_rows([a, b]) for a, b in zip(x, y, strict=True)]])
             for x, y in ((short, long), (long, short))]
    assert infos[0] == infos[1] and infos[0]["recency"] == 4.0


@pytest.mark.parametrize("one_size", [False, True])
def test_ema_calibrations_grid_hits_equal_ranking_each_triple_apart(one_size):
    """EmaPredictor._grid_hits (one EMA per α, membership by the |A_t|-th rank) against the
    definition: every (α, β, γ) replayed apart, P = the top |A_t| by a stable descending sort
    (ties to the lower block id). Scores on a coarse grid (ties in the EMA), |A_t| differing per
    row and head (one_size: one |A_t| for all, the k-th value path), rows of different contexts,
    three layers."""
    g = torch.Generator().manual_seed(5)
    steps, layers, batch, heads, n = 12, 3, 2, 2, N
    nb = torch.tensor([n, 15])  # context blocks per row
    scores = (torch.randn(steps, layers, batch, heads, n, generator=g) * 2).round() / 2
    scores = scores.masked_fill(torch.arange(n) >= nb.view(batch, 1, 1), float("-inf"))
    size = 1 + (torch.rand(steps, layers, batch, heads, 1, generator=g) * nb.view(batch, 1, 1)).long()
    if one_size:
        size = torch.full_like(size, 6)
    rank_noise = torch.rand(steps, layers, batch, heads, n, generator=g).masked_fill(torch.arange(n) >= nb.view(batch, 1, 1), 2)
    selected = rank_noise.argsort(-1).argsort(-1) < size  # |A_t| random blocks of the context per row and head
    p = EmaPredictor(alpha_grid=(0.0, 0.5, 0.9), stickiness_grid=(0.0, 0.5, 4.0), recency_grid=(0.0, 1.0),
                     burn_in_steps=2)
    finite = torch.isfinite(scores)
    hits, wanted = p._grid_hits(standardise(scores), finite, selected, finite[..., 0, :].sum(-1))

    ids = torch.arange(n)
    for c, (a, s, r) in enumerate(torch.tensor(p.grid)):  # (fp32, as the predictor's state)
        ema, expected, total = torch.zeros(layers, batch, heads, n), torch.zeros(layers), torch.zeros(layers)
        for t in range(steps):
            if t > p.burn_in_steps:
                recent = (ids == nb.view(batch, 1, 1) - 1).float()  # [B, 1, N]
                rank = (ema + s * selected[t - 1] + r * recent).masked_fill(~finite[t], float("-inf"))
                order = rank.sort(dim=-1, descending=True, stable=True).indices
                in_p = torch.zeros_like(selected[t]).scatter_(-1, order, ids < selected[t].sum(-1, keepdim=True))
                expected += (in_p & selected[t]).sum((-1, -2, -3))
                total += selected[t].sum((-1, -2, -3))
            z = standardise(scores[t])
            ema = torch.where(finite[t], a * ema + (1 - a) * z, ema)
        assert hits[c].tolist() == expected.tolist(), p.grid[c]
    assert wanted.tolist() == total.tolist()


def test_ema_learns_the_prefill_tail_batched_over_layers_as_update_does_step_by_step():
    """EmaPredictor.learn_tail (layers of one tail length at once) leaves the state `update`
    leaves layer by layer, step by step (Predictor.learn_tail), bit for bit: per-layer α, a dense
    layer, a layer with a shorter tail, selections of different capacities."""
    from prr.predictors.base import Predictor

    g = torch.Generator().manual_seed(7)

    def step(capacity: int) -> Selection:
        scores = torch.randn(2, 3, N, generator=g).masked_fill(torch.arange(N) >= 19, float("-inf"))
        count = torch.randint(1, capacity + 1, (2, 3), generator=g)
        return Selection(BlockSet(torch.randint(0, 19, (2, 3, capacity), generator=g), count), scores)

    history = [None, [step(5) for _ in range(9)], [step(7) for _ in range(9)], [step(5) for _ in range(4)]]
    p = EmaPredictor(calibrate=False)
    states = [p.init_state(4, 2, 3, N, "cpu") for _ in range(2)]
    for st in states:
        st.alpha.copy_(torch.tensor([0.8, 0.5, 0.9, 0.7]))
    p.learn_tail(states[0], history)
    Predictor.learn_tail(p, states[1], history)
    assert torch.equal(states[0].ema, states[1].ema) and torch.equal(states[0].last_selected, states[1].last_selected)
    assert states[0].ema[1:].abs().sum() > 0 and not states[0].ema[0].any()
