"""One definition per predictor, eager on the CPU or captured in a CUDA graph (issue 19):
`num_blocks` may be a host int or a per-row device tensor, selections may carry int32
indices in score order, propose is a pure function of the state, and no Python value in
the state changes from step to step (a captured graph would replay a stale one)."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from prr.blocks import BlockSet, top_blocks
from prr.predictors import (
    CrossLayerPredictor,
    EmaMembershipPredictor,
    EmaPredictor,
    LastStepPredictor,
    NoPredictor,
    OraclePredictor,
    QuerySimilarityPredictor,
    SpinPredictor,
)
from prr.predictors.spin import mix32, uniform_draw
from prr.selectors.base import Selection
from tests.helpers import replays_selections

N = 19  # max blocks
L = 3  # layers: 0 dense, 1 and 2 sparse
H = 2  # KV heads
G, D = 2, 4  # query heads per KV head, head dim
K = 5  # blocks a selection keeps
BUDGET = 7  # |P|
STEPS = 6
CONF = Path(__file__).resolve().parents[1] / "conf"
# Every predictor of conf/ (a new one too, built from its YAML), but those that replay a serial pass
# recorded before decoding (bench_hit_rate: tests/test_bench_hit_rate.py checks it against serial DSA).
NAMES = [p.stem for p in sorted((CONF / "predictor").glob("*.yaml")) if not replays_selections(p.stem)]

# Python values in a state that `update` may change: a structural fact, fixed once every
# layer has seen its first selection (prr/predictors/cross_layer.py says why it is safe).
STRUCTURAL = {"updated_layers"}


def calibrated_ema() -> EmaPredictor:
    p = EmaPredictor(per_layer=True, burn_in_steps=1, alpha_grid=(0.0, 0.8), stickiness_grid=(0.0, 2.0),
                     recency_grid=(0.0, 1.0), calibrate=True)
    g = torch.Generator().manual_seed(11)
    history = [[selection(torch.randn(1, H, N, generator=g), torch.tensor([N - 2])) for _ in range(5)]
               for _ in range(L - 1)]
    p.calibrate([None, *history])
    return p


def make(name: str):
    """The predictor `name` with the options these tests need (small caches, exploration, calibration
    on a trajectory); one these do not name, as its YAML configures it."""
    if name not in BUILDERS:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return instantiate(compose(config_name="config", overrides=[f"predictor={name}"]).predictor)
    return BUILDERS[name]()


BUILDERS = {
    "none": NoPredictor,
    "last_step": LastStepPredictor,
    "ema": lambda: EmaPredictor(calibrate=False, recent_blocks=2),
    "ema_calibrated": calibrated_ema,
    "ema_membership": lambda: EmaMembershipPredictor(alpha=0.7),
    "spin": lambda: SpinPredictor(explore=0.3, seed=7),
    "query_similarity": lambda: QuerySimilarityPredictor(cache_size=3, neighbours=2),
    "cross_layer": lambda: CrossLayerPredictor(temporal_weight=0.4, calibrate=False),
    "oracle": OraclePredictor,
}


def selection(scores: torch.Tensor, nb: torch.Tensor) -> Selection:
    """scores [B, H, N], nb [B] -> A as a kernel hands it over: int32 indices in score order,
    padded with 0 past count (rows with fewer than K blocks), scores -inf past each context."""
    scores = scores.masked_fill(torch.arange(N) >= nb.view(-1, 1, 1), float("-inf"))
    a = top_blocks(scores, K)
    return Selection(BlockSet(a.indices.int(), a.count.int()), scores)


def trajectory(nb0: list[int], seed: int = 0):
    """STEPS decode steps for rows with nb0[r] blocks at the first (one more each step):
    -> per step (nb [B], {layer: (selection, query)})."""
    g = torch.Generator().manual_seed(seed)
    b = len(nb0)
    steps = []
    for t in range(STEPS):
        nb = torch.tensor(nb0) + t
        layers = {layer: (selection(torch.randn(b, H, N, generator=g), nb), torch.randn(b, H, G, D, generator=g))
                  for layer in (1, 2)}
        steps.append((nb, layers))
    return steps


def row(steps, r: int):
    """The trajectory of batch row r alone (B = 1)."""
    out = []
    for nb, layers in steps:
        alone = {layer: (Selection(BlockSet(a.blocks.indices[r:r + 1], a.blocks.count[r:r + 1]), a.scores[r:r + 1]),
                         q[r:r + 1]) for layer, (a, q) in layers.items()}
        out.append((nb[r:r + 1], alone))
    return out


def drive(p, steps, as_int: bool, dtype=torch.int64, state=None):
    """Run the runtime's order (per layer: propose, then update) -> ([P], [rank], state)."""
    batch = steps[0][0].shape[0]
    state = p.init_state(L, batch, H, N, "cpu") if state is None else state
    proposals, ranks = [], []
    for nb, layers in steps:
        for layer, (a, q) in layers.items():
            num_blocks = int(nb[0]) if as_int else nb.to(dtype)
            blocks = p.propose(state, layer, num_blocks, BUDGET, current=a, query=q)
            proposals.append((blocks.indices.clone(), blocks.count.clone()))
            ranks.append(p.rank(state, layer, num_blocks).clone())
            p.update(state, layer, a)
    return proposals, ranks, state


def leaves(state, path="state"):
    """Every leaf reachable from a state: {path: value}."""
    if dataclasses.is_dataclass(state):
        items = [(f.name, getattr(state, f.name)) for f in dataclasses.fields(state)]
    elif isinstance(state, dict):
        items = list(state.items())
    elif isinstance(state, (list, tuple)):
        items = list(enumerate(state))
    else:
        return {path: state}
    out = {}
    for key, value in items:
        out.update(leaves(value, f"{path}.{key}"))
    return out or {path: state}


def host_values(state) -> dict:
    """The Python (non-tensor) leaves of a state, structural ones left out."""
    return {k: copy.deepcopy(v) for k, v in leaves(state).items()
            if not isinstance(v, torch.Tensor) and k.rsplit(".", 1)[-1] not in STRUCTURAL}


def tensors(state) -> dict:
    return {k: v.clone() for k, v in leaves(state).items() if isinstance(v, torch.Tensor)}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", NAMES)
def test_num_blocks_as_host_int_or_device_tensor_gives_the_same_rank_and_p(name):
    steps = trajectory([9, 9])  # both rows share the count, so a host int can express it
    ref = drive(make(name), steps, as_int=True)
    for dtype in (torch.int64, torch.int32):
        got = drive(make(name), steps, as_int=False, dtype=dtype)
        for (i1, c1), (i2, c2) in zip(ref[0], got[0], strict=True):
            assert torch.equal(i1, i2) and torch.equal(c1, c2)
        assert all(torch.equal(r1, r2) for r1, r2 in zip(ref[1], got[1], strict=True))


@pytest.mark.parametrize("name", NAMES)
def test_rows_with_different_contexts_predict_as_if_each_ran_alone(name):
    steps = trajectory([4, 11], seed=1)  # row 0's first selections keep fewer than K blocks: padded
    together, ranks, _ = drive(make(name), steps, as_int=False)
    for r in range(2):
        alone, ranks_alone, _ = drive(make(name), row(steps, r), as_int=True)
        for (i1, c1), (i2, c2) in zip(together, alone, strict=True):
            assert torch.equal(i1[r:r + 1], i2) and torch.equal(c1[r:r + 1], c2)
        assert all(torch.allclose(r1[r:r + 1], r2) for r1, r2 in zip(ranks, ranks_alone, strict=True))
    for (indices, count), (nb, _) in zip(together[::2], steps, strict=True):  # never beyond a row's own context
        valid = torch.arange(indices.shape[-1]) < count.unsqueeze(-1)
        assert (indices < nb.view(-1, 1, 1)).logical_or(~valid).all()


@pytest.mark.parametrize("name", NAMES)
def test_propose_is_a_pure_function_of_the_state(name):
    p = make(name)
    steps = trajectory([8, 13], seed=2)
    _, _, state = drive(p, steps[:3], as_int=False)  # warm: lazily sized buffers exist
    nb, layers = steps[3]
    a, q = layers[2]
    before = tensors(state)
    first = p.propose(state, 2, nb, BUDGET, current=a, query=q)
    after = tensors(state)
    # Only query_similarity writes to the state in propose: the pending query and its flag.
    pending = {k for k in before if k.endswith((".pending", ".has_pending"))}
    assert pending == (set() if name != "query_similarity" else {"state.pending", "state.has_pending"})
    assert same({k: v for k, v in before.items() if k not in pending}, {k: v for k, v in after.items() if k not in pending})
    second = p.propose(state, 2, nb, BUDGET, current=a, query=q)
    assert torch.equal(first.indices, second.indices) and torch.equal(first.count, second.count)
    assert same(after, tensors(state))
    # static: the budget's, the selection's where P = A (the oracle), none without speculation
    assert first.capacity == (0 if not p.speculates else K if not p.uses_budget else BUDGET)


@pytest.mark.parametrize("name", NAMES)
def test_update_changes_no_python_value_and_reallocates_nothing(name):
    p = make(name)
    steps = trajectory([6, 10], seed=3)
    state = p.init_state(L, 2, H, N, "cpu")
    initial = host_values(state)
    drive(p, steps[:1], as_int=False, state=state)  # first step: lazy buffers and structural facts settle
    structural = {k: copy.deepcopy(v) for k, v in leaves(state).items() if k.rsplit(".", 1)[-1] in STRUCTURAL}
    pointers = {k: v.data_ptr() for k, v in leaves(state).items() if isinstance(v, torch.Tensor)}
    drive(p, steps[1:], as_int=False, state=state)
    assert host_values(state) == initial
    assert {k: v for k, v in leaves(state).items() if k.rsplit(".", 1)[-1] in STRUCTURAL} == structural
    assert {k: v.data_ptr() for k, v in leaves(state).items() if isinstance(v, torch.Tensor)} == pointers
    if name == "cross_layer":
        assert state.updated_layers == {1, 2}


@pytest.mark.parametrize("name", NAMES)
def test_propose_and_update_compile_without_graph_breaks(name):
    """torch.compile(fullgraph=True) fails on any host sync or data-dependent Python branch.
    aot_eager traces (dynamo) and functionalises the in-place state updates, as inductor
    would, without compiling kernels: seconds, not minutes."""
    steps = trajectory([7, 12], seed=4)
    p, ref = make(name), make(name)
    _, _, state = drive(p, steps[:1], as_int=False)
    _, _, ref_state = drive(ref, steps[:1], as_int=False)

    def step(state, layer, nb, indices, count, scores, query):
        a = Selection(BlockSet(indices, count), scores)
        blocks = p.propose(state, layer, nb, BUDGET, current=a, query=query)
        p.update(state, layer, a)
        return blocks.indices, blocks.count

    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="aot_eager")
    torch._dynamo.reset()
    for nb, layers in steps[1:]:
        for layer, (a, q) in layers.items():
            got = compiled(state, layer, nb, a.blocks.indices, a.blocks.count, a.scores, q)
            want = ref.propose(ref_state, layer, nb, BUDGET, current=a, query=q)
            ref.update(ref_state, layer, a)
            assert torch.equal(got[0], want.indices) and torch.equal(got[1], want.count)
    assert same(tensors(state), tensors(ref_state))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")  # none and oracle launch no device work
@pytest.mark.parametrize("name", NAMES)
def test_propose_and_update_replay_in_a_cuda_graph(name):
    """Captured once, replayed on new inputs: the same P and state as eager calls."""
    dev = torch.device("cuda")
    steps = [(nb.to(dev), {layer: (Selection(BlockSet(a.blocks.indices.to(dev), a.blocks.count.to(dev)),
                                             a.scores.to(dev)), q.to(dev)) for layer, (a, q) in layers.items()})
             for nb, layers in trajectory([5, 12], seed=5)]
    p, ref = make(name), make(name)
    state, ref_state = p.init_state(L, 2, H, N, dev), ref.init_state(L, 2, H, N, dev)
    # Static inputs: the graph reads these buffers; each step copies its data in.
    nb0, layers0 = steps[0]
    static = {"nb": nb0.clone(), **{layer: (a.blocks.indices.clone(), a.blocks.count.clone(), a.scores.clone(), q.clone())
                                    for layer, (a, q) in layers0.items()}}

    def step():
        out = []
        for layer in (1, 2):
            indices, count, scores, query = static[layer]
            a = Selection(BlockSet(indices, count), scores)
            out.append(p.propose(state, layer, static["nb"], BUDGET, current=a, query=query))
            p.update(state, layer, a)
        return out

    def load(nb, layers):
        static["nb"].copy_(nb)
        for layer, (a, q) in layers.items():
            for dst, src in zip(static[layer], (a.blocks.indices, a.blocks.count, a.scores, q), strict=True):
                dst.copy_(src)

    load(*steps[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # eager warm-up of step 0 (sizes lazy buffers)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for nb, layers in steps[:1]:  # the reference runs step 0 too
        for layer, (a, q) in layers.items():
            ref.propose(ref_state, layer, nb, BUDGET, current=a, query=q)
            ref.update(ref_state, layer, a)
    for nb, layers in steps[1:]:
        load(nb, layers)
        graph.replay()
        for i, (layer, (a, q)) in enumerate(layers.items()):
            want = ref.propose(ref_state, layer, nb, BUDGET, current=a, query=q)
            ref.update(ref_state, layer, a)
            assert torch.equal(captured[i].indices, want.indices) and torch.equal(captured[i].count, want.count)
    assert same(tensors(state), tensors(ref_state))


# --- spin's counter-based draw ------------------------------------------------------------------

def test_mix32_is_the_reference_lowbias32_on_host_ints_and_tensors():
    def reference(x):  # 32-bit unsigned arithmetic, written plainly
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFF_FFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFF_FFFF
        return x ^ (x >> 16)

    xs = [0, 1, 2, 12345, 0x7FFF_FFFF, 0x8000_0000, 0xFFFF_FFFF]
    assert [mix32(x) for x in xs] == [reference(x) for x in xs]
    assert mix32(torch.tensor(xs)).tolist() == [reference(x) for x in xs]


def test_spin_draw_is_uniform_and_differs_by_seed_step_and_layer():
    step = torch.tensor(3)
    u = uniform_draw(0, 1, step, (1, 64, 256)).flatten()  # 16384 values
    assert ((u >= 0) & (u < 1)).all()
    counts = torch.histc(u, bins=16, min=0, max=1)
    expected = u.numel() / 16
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 45  # 15 degrees of freedom: p < 1e-4 above this
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    neighbours = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]  # consecutive blocks are not related
    assert abs(float(neighbours)) < 0.05
    base = uniform_draw(0, 1, step, (2, 4, 32))
    assert torch.equal(base, uniform_draw(0, 1, step.clone(), (2, 4, 32)))  # a pure function
    assert torch.equal(base[0], base[1])  # batch rows share the draw (batch invariance)
    for other in (uniform_draw(1, 1, step, (2, 4, 32)), uniform_draw(0, 2, step, (2, 4, 32)),
                  uniform_draw(0, 1, step + 1, (2, 4, 32)), uniform_draw(-1, 1, step, (2, 4, 32)),
                  uniform_draw(1 << 40, 1, step, (2, 4, 32))):
        assert (other != base).float().mean() > 0.99
    assert (base[0, 0] != base[0, 1]).all()  # KV heads draw apart


def test_spin_explores_every_other_block_about_equally_over_steps():
    p = SpinPredictor(explore=0.5, seed=1, selection_bonus=0.0)
    st = p.init_state(1, 1, 1, N, "cpu")
    drawn = torch.zeros(N)
    scores = torch.zeros(1, 1, N)
    scores[0, 0, :2] = 5.0  # blocks 0 and 1 always rank best: the exploited half of |P| = 4
    for _ in range(600):
        blocks = p.propose(st, 0, 12, 4)
        assert blocks.indices[0, 0, :2].tolist() == [0, 1]
        drawn[blocks.indices[0, 0, 2:]] += 1
        p.update(st, 0, selection(scores, torch.tensor([12])))
    share = drawn[2:12] / drawn.sum()  # 10 other blocks of the context, none past it
    assert drawn[12:].sum() == 0 and ((share - 0.1).abs() < 0.03).all()
    assert math.isclose(float(drawn.sum()), 1200)
