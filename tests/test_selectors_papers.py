"""Quest and LESS against their papers' formulas, written here as explicit loops (not from
prr's code): Quest's per-channel min/max bound and top-K pages (arXiv 2406.10774, with prr's
GQA reduction for grouped heads), LESS's merge of sparse attention with a low-rank state of
the tokens left out (arXiv 2402.09398, with prr's per-block summaries of the unselected blocks).
InfLLM's reference is kernels/reference_selection.infllm_reference_selections
(tests/test_selectors_infllm.py)."""

import math

import pytest
import torch

from prr.predictors import NoPredictor
from prr.selectors import LessSelector, QuestSelector
from tests.helpers import eager_step, random_cache


def quest_bound(q: torch.Tensor, keys: torch.Tensor) -> float:
    """Quest's criticality of one page for one head: Σ_i max(q_i · max_j k_ji, q_i · min_j k_ji)."""
    total = 0.0
    for i in range(q.shape[0]):
        hi = max(float(k[i]) for k in keys)
        lo = min(float(k[i]) for k in keys)
        total += max(float(q[i]) * hi, float(q[i]) * lo)
    return total


@pytest.mark.parametrize("group, reduce", [(1, "max"), (3, "max"), (3, "sum")])
def test_quest_selects_the_top_pages_of_its_bound(group, reduce):
    """Per KV head: the sink and newest pages, plus the top-K pages by Quest's bound (one head:
    the paper's rule; a GQA group: its heads' bounds reduced by max or sum, prr's extension)."""
    bs, d, length, k = 8, 12, 93, 5
    sel = QuestSelector(topk_blocks=k, sink_blocks=1, local_blocks=0, gqa_reduce=reduce)
    cache = random_cache(sel, length=length, num_kv_heads=2, head_dim=d, block_size=bs, seed=group)
    q = torch.randn(1, 2, group, d, generator=torch.Generator().manual_seed(7))
    got = sel.select(q, cache, 0).blocks.mask(cache.max_blocks)[0]  # [Hkv, NB]
    num_blocks = -(-length // bs)
    for h in range(2):
        keys = cache.keys[0][0, h, :length]
        scores = []
        for b in range(num_blocks):
            page = keys[b * bs : min((b + 1) * bs, length)]
            bounds = [quest_bound(q[0, h, g], page) for g in range(group)]
            scores.append(max(bounds) if reduce == "max" else sum(bounds))
            for g in range(group):  # the bound holds for every key of the page
                assert all(float(q[0, h, g] @ key) <= bounds[g] + 1e-4 for key in page)
        forced = {0, num_blocks - 1}
        ranked = sorted((b for b in range(num_blocks) if b not in forced), key=lambda b: (-scores[b], b))
        want = sorted(forced | set(ranked[: k - len(forced)]))
        assert got[h].nonzero().flatten().tolist() == want


def test_less_output_is_sparse_attention_merged_with_the_low_rank_state_of_the_rest():
    """LESS's output: (Σ_{j∈A} e^{s_j} v_j + Σ_{j∉A} φ(q)·φ(k_j) v_j) / (Σ_{j∈A} e^{s_j} + Σ_{j∉A} φ(q)·φ(k_j)),
    s_j = q·k_j/√D, with φ the positive random features of the selector's draw (keys centred on
    c: e^{q·k/√D} = e^{q·c/√D} e^{q·(k−c)/√D}, the first factor exact), token by token."""
    bs, d, length, group = 8, 16, 77, 2
    sel = LessSelector(topk_blocks=4, num_features=32)
    cache = random_cache(sel, length=length, num_kv_heads=1, head_dim=d, block_size=bs, seed=3)
    q = torch.randn(1, 1, group, d, generator=torch.Generator().manual_seed(4))
    out, selection, _ = eager_step(sel, NoPredictor(), cache, q, 0)
    chosen = set(selection.blocks.indices[0, 0, : int(selection.blocks.count[0, 0])].tolist())
    w = cache.metadata[0]["less_w"][0].double()  # [m, D]: the selector's feature draw
    center = cache.metadata[0]["less_center"][0, 0].double()
    keys, values = cache.keys[0][0, 0, :length].double(), cache.values[0][0, 0, :length].double()
    scale, m = 1.0 / math.sqrt(d), w.shape[0]

    def phi(x: torch.Tensor) -> torch.Tensor:
        x = x * math.sqrt(scale)
        return torch.exp(w @ x - 0.5 * (x @ x)) / math.sqrt(m)

    for g in range(group):
        qg = q[0, 0, g].double()
        num, den = torch.zeros(d, dtype=torch.float64), 0.0
        for j in range(length):
            if j // bs in chosen:
                weight = math.exp(scale * float(qg @ keys[j]))
            else:
                weight = math.exp(scale * float(qg @ center)) * float(phi(qg) @ phi(keys[j] - center))
            num += weight * values[j]
            den += weight
        torch.testing.assert_close(out[0, 0, g].double(), num / den, rtol=1e-4, atol=1e-5)
