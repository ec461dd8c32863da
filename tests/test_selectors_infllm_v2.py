"""`infllm_v2` against InfLLM-v2's definition (arXiv 2509.24663, Eqs. 4-7), the selection written
here as explicit loops (not from prr's code), and its defining properties: the best-matching
block is chosen, the initial and local blocks are always in A, A is dense while the context fits
the budget, the group's heads (and only they) score their KV head's blocks; the compressed keys
grown token by token equal the bulk ones; runtime.block_size other than 64 is refused before the
model loads."""

import math

import pytest
import torch

from prr.cache import PagedKVCache
from prr.config_check import ConfigError, compose_config, problems_before_torch
from prr.selectors.infllm_v2 import InfLLMV2Selector
from tests.helpers import random_cache

BS = 64


def paper_selection(q: torch.Tensor, keys: torch.Tensor, length: int, k: int, init: int, local: int) -> list[int]:
    """One KV head: q [G, D] (its group's query heads), keys [T, D] -> InfLLM-v2's selected blocks.
    K_C1_i = mean(K[16i : 16i + 32]) over complete windows; S_C1 = softmax(q K_C1^T / sqrt(D)) per head;
    S_shared = Σ over the group; S_cmp(block j) = max of S_shared over the windows overlapping block j
    (window i overlaps [64j, 64j + 64) iff 16i < 64j + 64 and 16i + 32 > 64j); A = the initial blocks,
    the query's block and the `local` before it, then the best of the rest up to k in all."""
    d = q.shape[1]
    windows = [keys[16 * i : 16 * i + 32].double().mean(0) for i in range(length) if 16 * i + 32 <= length]
    shared = [0.0] * len(windows)
    for g in range(q.shape[0]):
        logits = [float(q[g].double() @ w) / math.sqrt(d) for w in windows]
        top = max(logits)
        norm = sum(math.exp(x - top) for x in logits)
        for i, x in enumerate(logits):
            shared[i] += math.exp(x - top) / norm
    num_blocks = -(-length // BS)
    scores = []
    for j in range(num_blocks):
        over = [shared[i] for i in range(len(windows)) if 16 * i < BS * (j + 1) and 16 * i + 32 > BS * j]
        scores.append(max(over) if over else 0.0)
    forced = {j for j in range(num_blocks) if j < init or j >= num_blocks - 1 - local}
    rest = sorted((j for j in range(num_blocks) if j not in forced), key=lambda j: (-scores[j], j))
    return sorted(forced | set(rest[: max(0, k - len(forced))]))


@pytest.mark.parametrize("length, group, local", [(1000, 3, 1), (725, 1, 0), (1343, 4, 2)])
def test_selection_is_the_papers(length, group, local):
    d, k = 24, 6
    sel = InfLLMV2Selector(topk_blocks=k, sink_blocks=1, local_blocks=local)
    cache = random_cache(sel, length=length, num_kv_heads=2, head_dim=d, block_size=BS, seed=length)
    q = torch.randn(1, 2, group, d, generator=torch.Generator().manual_seed(group)) * 3
    got = sel.select(q, cache, 0).blocks.mask(cache.max_blocks)[0]  # [Hkv, NB]
    for h in range(2):
        want = paper_selection(q[0, h], cache.keys[0][0, h], length, k, 1, local)
        assert got[h].nonzero().flatten().tolist() == want


def test_the_block_whose_keys_match_the_query_is_chosen_and_the_forced_ones_always():
    """Keys of block 5 along q are the best; the initial block, the local block and the newest
    block are in A although their keys point away from q (they score lowest)."""
    d, length = 16, 900  # 15 blocks, the newest partial
    g = torch.Generator().manual_seed(0)
    q = torch.randn(d, generator=g)
    keys = torch.randn(1, 1, length, d, generator=g) * 0.1
    keys[:, :, 5 * BS : 6 * BS] += 4 * q / q.norm()
    for forced in (range(0, BS), range(12 * BS, length)):  # initial block; local (13) + newest (14)
        keys[:, :, forced] -= 4 * q / q.norm()
    sel = InfLLMV2Selector(topk_blocks=4, sink_blocks=1, local_blocks=1)
    cache = PagedKVCache(1, 1, 1, d, BS, length)
    cache.append(0, keys, keys)
    sel.update_metadata(cache, 0, 0, length)
    selection = sel.select(q.view(1, 1, 1, d), cache, 0)
    assert selection.blocks.mask(cache.max_blocks)[0, 0].nonzero().flatten().tolist() == [0, 5, 13, 14]
    assert selection.scores[0, 0, :14].argmax() == 5


@pytest.mark.parametrize("length", [20, 64, 311, 512])
def test_dense_while_the_context_fits_the_budget(length):
    """At most topk_blocks blocks of context: A is every block (the paper's dense short sequences)."""
    sel = InfLLMV2Selector(topk_blocks=8, sink_blocks=1, local_blocks=1)
    cache = random_cache(sel, length=length, num_kv_heads=2, head_dim=16, block_size=BS)
    q = torch.randn(1, 2, 2, 16, generator=torch.Generator().manual_seed(1))
    mask = sel.select(q, cache, 0).blocks.mask(cache.max_blocks)[0]
    assert mask.sum(-1).tolist() == [-(-length // BS)] * 2 and mask[:, : -(-length // BS)].all()


def test_the_gqa_aggregation_is_over_the_group():
    """A KV head's scores are the sum over its group's query heads of their softmax probabilities
    (pooled after the sum): every head of the group moves them, the other group's heads do not."""
    d, length, group = 16, 1100, 3
    sel = InfLLMV2Selector(topk_blocks=6)
    cache = random_cache(sel, length=length, num_kv_heads=2, head_dim=d, block_size=BS, seed=2)
    q = torch.randn(1, 2, group, d, generator=torch.Generator().manual_seed(3)) * 3
    scores = sel.select(q, cache, 0).scores  # [1, Hkv, NB]
    other = q.clone()
    other[0, 1] = torch.randn(group, d, generator=torch.Generator().manual_seed(4)) * 3
    moved = sel.select(other, cache, 0).scores
    assert torch.equal(moved[0, 0], scores[0, 0]) and not torch.allclose(moved[0, 1], scores[0, 1])
    # one head of group 0 changed: its KV head's scores change
    one = q.clone()
    one[0, 0, 2] = -one[0, 0, 2]
    assert not torch.allclose(sel.select(one, cache, 0).scores[0, 0], scores[0, 0])
    # the sum of the heads' probabilities, then the max over windows: not the sum of per-head maxima
    per_head = [sel.select(q[:, :, h : h + 1], cache, 0).scores for h in range(group)]
    summed_maxima = sum(per_head)[0, 0, :-1]
    assert torch.all(scores[0, 0, :-1] <= summed_maxima + 1e-6) and not torch.allclose(scores[0, 0, :-1], summed_maxima)


def test_compressed_keys_grown_token_by_token_equal_the_bulk_ones():
    """append_metadata at every position (a decode) leaves the windows update_metadata writes in
    bulk (a prefill): bulk_metadata_equals_stepwise."""
    d, length, batch = 8, 300, 2
    sel = InfLLMV2Selector(topk_blocks=4)
    bulk = random_cache(sel, length=length, batch=batch, num_kv_heads=3, head_dim=d, block_size=BS)
    step = PagedKVCache(1, batch, 3, d, BS, length)
    step.append(0, bulk.keys[0][:, :, :length], bulk.values[0][:, :, :length])
    sel.update_metadata(step, 0, 0, 1)
    for pos in range(1, length):
        sel.append_metadata(step, 0, torch.full((batch,), pos))
    assert sel.bulk_metadata_equals_stepwise
    assert torch.equal(sel.compressed(step, 0), sel.compressed(bulk, 0))
    assert sel.compressed(bulk, 0)[:, :, (length - 32) // 16 + 1 :].abs().sum() == 0  # incomplete: unwritten


def test_a_block_size_other_than_64_is_refused_before_the_model_loads():
    message = "selector=infllm_v2 selects InfLLM-v2's blocks of 64 tokens .* add runtime.block_size=64"
    base = ["model=tiny-random", "selector=infllm_v2", "task.prompt_tokens=1024", "runtime=cpu"]
    cfg = compose_config([*base, "runtime.block_size=16"], check=False)
    assert any("add runtime.block_size=64" in p for p in problems_before_torch(cfg))  # before torch
    with pytest.raises(ConfigError, match=message):
        compose_config([*base, "runtime.block_size=16"])
    compose_config([*base, "runtime.block_size=64"])  # accepted
    with pytest.raises(ValueError, match="add runtime.block_size=64"):  # and outside run.py, on first use
        InfLLMV2Selector(topk_blocks=4).update_metadata(PagedKVCache(1, 1, 1, 8, 16, 64), 0, 0, 64)


def test_hinted_topk_selects_the_same_blocks_and_its_slot_exists_after_the_prefill():
    """selector.hinted_topk (the top-K from the last step's k-th score) changes no A over 40 decode
    steps crossing a block; its slot is allocated by the prefill's update (an engine checkpoint)."""
    from prr.selectors.base import TOPK_HINT

    d, prompt = 16, 1000
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 2, prompt + 40, d, generator=g)
    runs = []
    for hinted in (False, True):
        sel = InfLLMV2Selector(topk_blocks=5, hinted_topk=hinted)
        cache = PagedKVCache(1, 2, 2, d, BS, prompt + 40)
        cache.append(0, keys[:, :, :prompt], keys[:, :, :prompt])
        sel.update_metadata(cache, 0, 0, prompt)
        assert (TOPK_HINT in cache.metadata[0]) == hinted
        picks, qg = [], torch.Generator().manual_seed(6)
        for pos in range(prompt, prompt + 40):
            cache.append(0, keys[:, :, pos : pos + 1], keys[:, :, pos : pos + 1])
            sel.append_metadata(cache, 0, torch.full((2,), pos))
            picks.append(sel.select(torch.randn(2, 2, 3, d, generator=qg) * 3, cache, 0).blocks.indices)
        runs.append(torch.stack(picks))
    assert torch.equal(runs[0], runs[1])


def test_a_one_token_prefill_tail_leaves_serial_dsa_as_a_full_tail_does():
    """bulk_metadata_equals_stepwise end to end (what the graph engine's serial requests rely on,
    prr/runtime/graph_pipeline.py; tests/test_runtime.py holds it for the selectors of 16-token
    blocks): a prefill replayed with a 1-token tail and with a 40-token one leave the same last
    selection, and the decode steps after it select and output the same."""
    from prr.budget.fixed import FixedBudget
    from prr.predictors import NoPredictor
    from prr.runtime.dsa_backend import DSABackend

    g = torch.Generator().manual_seed(11)
    prompt, steps, hkv, group, d = 717, 20, 2, 3, 16
    q = torch.randn(1, hkv * group, prompt + steps, d, generator=g)
    k, v = (torch.randn(1, hkv, prompt + steps, d, generator=g) for _ in range(2))
    runs = []
    for tail in (40, 1):
        sel = InfLLMV2Selector(topk_blocks=5)
        cache = PagedKVCache(1, 1, hkv, d, BS, prompt + steps)
        backend = DSABackend(cache, hkv * group, sel, NoPredictor(), FixedBudget(), calibration_tokens=tail)
        backend.prefill(0, q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt])
        backend.finish_prefill()
        chosen = [backend.history[0][-1].blocks.mask(cache.max_blocks)]
        outs = [backend.decode(0, q[:, :, t], k[:, :, t], v[:, :, t]) for t in range(prompt, prompt + steps)]
        runs.append((chosen + [backend.previous[0].clone()], outs))
    (want_sets, want_outs), (got_sets, got_outs) = runs
    assert all(torch.equal(a, b) for a, b in zip(want_sets, got_sets, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(want_outs, got_outs, strict=True))


def test_the_kernels_sizes_are_the_options():
    """kernels/ imports nothing from prr, so the reference keeps its own copy of the paper's sizes."""
    from prr.kernels import reference_infllm_v2 as ref

    from prr.selectors import options

    assert (ref.BLOCK, ref.WINDOW, ref.STRIDE) == (options.INFLLM_V2_BLOCK_TOKENS, options.INFLLM_V2_WINDOW_TOKENS,
                                                   options.INFLLM_V2_WINDOW_STRIDE)
