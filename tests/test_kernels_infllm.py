"""InfLLM's selection kernels (prr.kernels.infllm) against their torch definition, the selector's
own ops (`InfLLMSelector._provisional`, `_add_window_attention`, `_finalise`, `block_scores` +
`Selector.select`'s reduce), on fresh random inputs at odd sizes: per-row lengths not multiples
of the block, odd block counts, G = 1, 3, 4, r not dividing the block; identical selected sets,
fp32 slots and scores within 1e-5 (relative norm). Then the selector's Triton path against its
torch path while decoding, both variants (infllm, infllm_prr) and per_head. CPU:
TRITON_INTERPRET=1 (conftest). GPU variants (-m gpu) at the 8B shape, and one CUDA-graph capture."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prr.kernels.infllm import infllm_live_update, infllm_scores, infllm_step
from prr.kernels.topk import topk_select

from prr.cache import PagedKVCache
from prr.selectors import InfLLMSelector
from prr.selectors.base import Selector

ROOT = Path(__file__).resolve().parents[1]
GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device and TRITON_INTERPRET=0")

# name -> selector options (infllm = the published rule, infllm_prr = conf/selector/infllm_prr.yaml)
VARIANTS = {
    "infllm": {},
    "infllm_per_head": {"per_head": True, "gqa_reduce": "max"},
    "infllm_prr": {"scoring": "rope", "representatives_from": "one_query"},
    "infllm_prr_per_head": {"scoring": "rope", "representatives_from": "one_query", "per_head": True},
    "one_query_agnostic": {"representatives_from": "one_query", "gqa_reduce": "max"},
    "window_rope": {"scoring": "rope", "per_head": True},
}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30)).item()


def selector(variant: str, head_dim: int, **kwargs) -> InfLLMSelector:
    sel = InfLLMSelector(**{**VARIANTS[variant], **kwargs})
    sel.bind_model(SimpleNamespace(head_dim=head_dim, rope_theta=10000.0, rope_scaling=None))
    return sel


def random_state(sel: InfLLMSelector, batch: int, kv_heads: int, group: int, head_dim: int, block: int,
                 max_blocks: int, seed: int, device="cpu", dtype=torch.float32) -> PagedKVCache:
    """A one-layer cache full of random keys and random InfLLM slots: window scores, representatives
    (equal over a group for one_query, as that rule keeps them), live means."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, batch, kv_heads, head_dim, block, max_blocks * block, dtype, device)
    shape = (batch, kv_heads, max_blocks * block, head_dim)
    cache.append(0, (torch.randn(shape, generator=g) * 2).to(device, dtype), torch.randn(shape, generator=g).to(device, dtype))
    repr_keys = torch.randn(batch, kv_heads, max_blocks, group, head_dim, generator=g)
    if sel.representatives_from == "one_query":
        repr_keys = repr_keys[:, :, :, :1].expand_as(repr_keys)
    sel._repr(cache, 0, group).copy_(repr_keys)
    sel._live(cache, 0).copy_(torch.randn(batch, kv_heads, max_blocks, head_dim, generator=g))
    if sel.representatives_from == "window_attention":
        sel._window(cache, 0, group).copy_(torch.rand(batch, kv_heads, max_blocks, group, block, generator=g) * 3)
    return cache


def reduced_like_select(sel: Selector, per_head: torch.Tensor, num_blocks: torch.Tensor) -> torch.Tensor:
    """head scores [B, Hkv, G, NB] -> [B, Hkv, NB] as `Selector.select` reduces them."""
    outside = torch.arange(per_head.shape[-1], device=per_head.device) >= num_blocks.view(-1, 1, 1)
    per_head = per_head.masked_fill(outside.unsqueeze(2), float("-inf"))
    reduced = per_head.sum(2) if sel.gqa_reduce == "sum" else per_head.amax(2)
    return reduced.masked_fill(outside, float("-inf"))


def assert_slots_equal(got: PagedKVCache, want: PagedKVCache, what: str = "") -> None:
    for name, ref in want.metadata[0].items():
        mine = got.metadata[0][name]
        if ref.dtype.is_floating_point:
            assert rel_err(mine, ref) < 1e-5, (what, name, rel_err(mine, ref))
        else:
            assert torch.equal(mine.cpu(), ref.cpu()), (what, name, mine, ref)


# --- each kernel against its torch definition ------------------------------------------------


@pytest.mark.parametrize("scoring", ["position_agnostic", "rope"])
@pytest.mark.parametrize("batch, kv_heads, head_dim, block, positions",
                         [(2, 3, 16, 8, [26, 61]), (1, 2, 32, 16, [47]), (3, 1, 16, 4, [0, 13, 38])])
def test_live_update_equals_the_selectors_update(scoring, batch, kv_heads, head_dim, block, positions):
    sel = selector("infllm", head_dim, topk_blocks=6, scoring=scoring)
    cache = random_state(sel, batch, kv_heads, 1, head_dim, block, 11, seed=len(positions))
    twin = copy.deepcopy(cache)
    pos = torch.tensor(positions)
    sel._provisional(cache, 0, pos // block, 1, pos + 1)  # the torch definition (append_metadata's)
    freqs = sel._freqs(twin) if scoring == "position_agnostic" else None
    infllm_live_update(sel._live(twin, 0), twin.keys[0], pos.to(torch.int32), block, freqs)
    assert_slots_equal(twin, cache)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("group, head_dim, block, representatives, lengths, local",
                         [(3, 16, 8, 3, [61, 99], 2), (1, 32, 16, 5, [77], 1), (4, 16, 8, 8, [40, 59, 104], 0)])
def test_step_equals_the_selectors_window_work_and_finalising(variant, group, head_dim, block, representatives,
                                                              lengths, local):
    """One selection's metadata work: per row a fresh or an already-added query, a block to
    finalise or none (finalised = target − 1 or target), a sink inside the window at short rows."""
    sel = selector(variant, head_dim, topk_blocks=8, sink_blocks=1, local_blocks=local, representatives=representatives)
    b, kv_heads = len(lengths), 2
    cache = random_state(sel, b, kv_heads, group, head_dim, block, 15, seed=group + block)
    lengths_t = torch.tensor(lengths)
    nb = (lengths_t + block - 1) // block
    target = torch.minimum(lengths_t // block, nb - sel.window_blocks)
    sel._finalised(cache, 0).copy_((target - torch.arange(b) % 2).clamp(min=0))  # finalise at odd rows
    if sel.representatives_from == "window_attention":
        sel._scored(cache, 0).copy_(lengths_t - 1 + (torch.arange(b) % 3 == 1).long())  # row 1 already added
    twin = copy.deepcopy(cache)
    q = torch.randn(b, kv_heads, group, head_dim, generator=torch.Generator().manual_seed(7))
    if sel.representatives_from == "window_attention":  # the torch definition, as head_scores runs it
        sel._add_window_attention(q.unsqueeze(3), (lengths_t - 1).view(b, 1), cache, 0)
    sel._finalise(q, cache, 0, lengths_t, sel._finalised(cache, 0), 1)
    window = sel.representatives_from == "window_attention"
    infllm_step(q.reshape(b, kv_heads * group, head_dim), twin.keys[0], lengths_t.to(torch.int32),
                sel._repr(twin, 0, group), sel._finalised(twin, 0), sel._arrivals(twin, 0), block, sel.sink_blocks,
                sel.window_blocks, representatives, window=sel._window(twin, 0, group) if window else None,
                scored=sel._scored(twin, 0) if window else None,
                inv_freq=sel._freqs(twin) if sel.scoring == "position_agnostic" else None,
                layer_sum=not window and not sel.per_head)
    assert torch.equal(sel._arrivals(twin, 0), torch.zeros(b, dtype=torch.int32))  # re-armed
    del twin.metadata[0]["infllm_arrivals"]
    assert_slots_equal(twin, cache)


def test_step_kernel_chunks_a_long_window():
    """A window of more forced tokens than one dot (chunks of 16 here): two passes, the same adds."""
    sel = selector("infllm", 16, topk_blocks=12, sink_blocks=2, local_blocks=6, representatives=2)
    cache = random_state(sel, 2, 2, 3, 16, 4, 23, seed=3)
    lengths_t = torch.tensor([87, 50])
    twin = copy.deepcopy(cache)
    q = torch.randn(2, 2, 3, 16)
    sel._add_window_attention(q.unsqueeze(3), (lengths_t - 1).view(2, 1), cache, 0)
    sel._finalise(q, cache, 0, lengths_t, sel._finalised(cache, 0), 1)
    infllm_step(q.reshape(2, 6, 16), twin.keys[0], lengths_t, sel._repr(twin, 0, 3), sel._finalised(twin, 0),
                sel._arrivals(twin, 0), 4, 2, sel.window_blocks, 2, window=sel._window(twin, 0, 3),
                scored=sel._scored(twin, 0), inv_freq=sel._freqs(twin), forced_chunk=16)
    del twin.metadata[0]["infllm_arrivals"]
    assert_slots_equal(twin, cache)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("gqa_reduce", ["sum", "max"])
@pytest.mark.parametrize("group, head_dim, block, lengths, block_n",
                         [(3, 16, 8, [61, 99], None), (4, 32, 16, [203], 4), (1, 16, 8, [9, 150, 77], 32)])
def test_scores_equal_the_selectors_and_select_the_same_blocks(variant, gqa_reduce, group, head_dim, block, lengths,
                                                               block_n):
    sel = selector(variant, head_dim, topk_blocks=7, sink_blocks=1, local_blocks=2, **{"gqa_reduce": gqa_reduce})
    b, kv_heads, max_blocks = len(lengths), 2, 21
    cache = random_state(sel, b, kv_heads, group, head_dim, block, max_blocks, seed=group * 10 + len(lengths))
    lengths_t = torch.tensor(lengths)
    nb = ((lengths_t + block - 1) // block).to(torch.int32)
    sel._finalised(cache, 0).copy_((nb.long() - sel.window_blocks - torch.arange(b)).clamp(min=0))  # some lag
    q = torch.randn(b, kv_heads, group, head_dim, generator=torch.Generator().manual_seed(11))
    want = reduced_like_select(sel, sel.block_scores(q, cache, 0, lengths_t), nb.long())
    got = infllm_scores(q.reshape(b, kv_heads * group, head_dim), lengths_t.to(torch.int32), nb,
                        sel._finalised(cache, 0), sel._repr(cache, 0, group), sel._live(cache, 0),
                        inv_freq=sel._freqs(cache) if sel.scoring == "position_agnostic" else None,
                        fixed_position=sel.window_blocks * block - 1, layer_sum=not sel.per_head,
                        gqa_reduce=gqa_reduce, shared_repr=sel.representatives_from == "one_query", block_n=block_n)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite) and not got.isnan().any()
    assert rel_err(got[finite], want[finite]) < 1e-5
    recent = sel.local_blocks + int(sel.force_newest)
    idx, cnt = topk_select(got, sel.topk_blocks, nb, sink_blocks=sel.sink_blocks, recent_blocks=recent)
    ref_idx, ref_cnt = topk_select(want, sel.topk_blocks, nb, sink_blocks=sel.sink_blocks, recent_blocks=recent)
    assert torch.equal(idx, ref_idx) and torch.equal(cnt, ref_cnt)


@pytest.mark.parametrize("variant", ["infllm", "infllm_prr"])
def test_a_triton_decode_step_adds_no_slot_after_a_torch_prefill(variant):
    """The graph engine checkpoints the slots as a list after the prefill (run.py's prefill runs
    torch ops) and restores them after its warm-up steps: a Triton step must add no slot (seen on
    the H200: an arrival counter allocated at the first step misaligned that list)."""
    sel = selector(variant, 16, topk_blocks=6, local_blocks=2)
    cache = PagedKVCache(1, 1, 2, 16, 8, 60)
    cache.append(0, torch.randn(1, 2, 37, 16), torch.randn(1, 2, 37, 16))
    sel.update_metadata(cache, 0, 0, 37)
    queries = torch.randn(1, 2, 3, 37, 16)
    sel.catch_up(queries[:, :, :, -1], cache, 0, 37, queries=queries)
    names = list(cache.metadata[0])
    assert sel.set_backend("triton") == "triton"
    start, _ = cache.append(0, torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
    sel.append_metadata(cache, 0, torch.full((1,), start))
    sel.select(torch.randn(1, 2, 3, 16), cache, 0)
    assert list(cache.metadata[0]) == names


def test_kernels_refuse_what_they_cannot_run():
    sel = selector("infllm", 12, topk_blocks=8)
    assert any("head_dim=12" in p for p in sel.triton_problems())
    assert sel.set_backend("triton") == "torch"
    union = selector("infllm", 16, topk_blocks=8, gqa_reduce="union")
    assert any("gqa_reduce=union" in p for p in union.triton_problems())
    assert selector("infllm_prr", 16, topk_blocks=8).triton_problems() == []
    keys = torch.zeros(1, 2, 24, 12)
    with pytest.raises(ValueError, match="head_dim=12"):
        infllm_live_update(torch.zeros(1, 2, 3, 12), keys, torch.zeros(1, dtype=torch.int32), 8)
    keys = torch.zeros(1, 2, 24, 16)
    with pytest.raises(ValueError, match="block_size=6"):
        infllm_live_update(torch.zeros(1, 2, 4, 16), keys, torch.zeros(1, dtype=torch.int32), 6)
    with pytest.raises(ValueError, match="live must be fp32"):
        infllm_live_update(torch.zeros(1, 2, 3, 16, dtype=torch.float16), keys, torch.zeros(1, dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="window_attention needs both"):
        infllm_step(torch.zeros(1, 4, 16), keys, torch.ones(1, dtype=torch.int32), torch.zeros(1, 2, 3, 2, 16),
                    torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int32), 8, 1, 2, 4,
                    window=torch.zeros(1, 2, 3, 2, 8))
    with pytest.raises(ValueError, match="gqa_reduce='union'"):
        infllm_scores(torch.zeros(1, 4, 16), torch.ones(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                      torch.zeros(1, dtype=torch.int64), torch.zeros(1, 2, 3, 2, 16), torch.zeros(1, 2, 3, 16),
                      gqa_reduce="union")


# --- the selector's Triton path against its torch path ------------------------------------------


def decode_both(variant: str, group: int, steps: int, prompt: int, kv_heads=2, head_dim=16, block=8, batch=1,
                device="cpu", dtype=torch.float32, seed=0, **options):
    """Prefill `prompt` random tokens (torch catch_up for both), then decode `steps` tokens with a
    torch-backend and a triton-backend selector on twin caches; yields (step, torch selection,
    triton selection, torch cache, triton cache, triton selector, q)."""
    kw = {"topk_blocks": 7, "sink_blocks": 1, "local_blocks": 2, "representatives": 3, **options}
    ref, fast = selector(variant, head_dim, **kw), selector(variant, head_dim, **kw)
    assert fast.set_backend("triton") == "triton", fast.triton_problems()
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, batch, kv_heads, head_dim, block, prompt + steps, dtype, device)
    shape = (batch, kv_heads, prompt, head_dim)
    cache.append(0, (torch.randn(shape, generator=g) * 2).to(device, dtype), torch.randn(shape, generator=g).to(device, dtype))
    twin = copy.deepcopy(cache)
    queries = torch.randn(batch, kv_heads, group, prompt, head_dim, generator=g).to(device, dtype)
    for sel, c in ((ref, cache), (fast, twin)):
        sel.update_metadata(c, 0, 0, prompt)
        sel.catch_up(queries[:, :, :, -1], c, 0, prompt, queries=queries)
    for step in range(steps):
        k = (torch.randn(batch, kv_heads, 1, head_dim, generator=g) * 2).to(device, dtype)
        v = torch.randn(batch, kv_heads, 1, head_dim, generator=g).to(device, dtype)
        for sel, c in ((ref, cache), (fast, twin)):
            start, _ = c.append(0, k, v)
            sel.append_metadata(c, 0, torch.full((batch,), start, device=device))
        q = torch.randn(batch, kv_heads, group, head_dim, generator=g).to(device, dtype)
        yield step, ref.select(q, cache, 0), fast.select(q, twin, 0), cache, twin, fast, q


FAST_DECODES = {("infllm", 3)}  # `make test`; the rest under -m slow (~15 s each here)


@pytest.mark.parametrize("variant, group", [
    pytest.param(v, g, marks=() if (v, g) in FAST_DECODES else pytest.mark.slow) for v in sorted(VARIANTS) for g in (1, 3)])
def test_triton_path_selects_what_the_torch_path_selects(variant, group):
    """19 decode steps from a 45-token prompt (blocks of 8: three blocks finalised on the way),
    batch 2: the same A, scores within 1e-5 and the same slots at every step; a second selection
    at a step (the oracle's look) changes nothing and selects the same."""
    for step, want, got, cache, twin, fast, q in decode_both(variant, group, 19, 45, batch=2, seed=group):
        assert torch.equal(got.blocks.indices, want.blocks.indices), step
        assert torch.equal(got.blocks.count, want.blocks.count), step
        finite = torch.isfinite(want.scores)
        assert torch.equal(torch.isfinite(got.scores), finite)
        assert rel_err(got.scores[finite], want.scores[finite]) < 1e-5
        assert_slots_equal(twin, cache, f"step {step}")  # (the arrival counters too: both zero)
        if step % 9 == 4:
            before = [t.clone() for t in twin.metadata[0].values()]
            again = fast.select(q, twin, 0)
            assert all(torch.equal(a, t) for a, t in zip(before, twin.metadata[0].values(), strict=True))
            assert torch.equal(again.blocks.indices, got.blocks.indices)


# --- GPU ------------------------------------------------------------------------------------------


def boundary_gap(sel: Selector, scores: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[B, Hkv] relative gap between the k-th and (k+1)-th block of a selection's scores with the
    forced blocks first (inf where there is no (k+1)-th): a set is well defined far above fp32 noise."""
    forced = sel.forced_mask(num_blocks, scores.shape[-1], scores.device)
    top = scores.masked_fill(forced, float("inf")).double().sort(-1, descending=True).values
    k = sel.topk_blocks
    if top.shape[-1] <= k:
        return torch.full(top.shape[:2], float("inf"), dtype=torch.float64, device=scores.device)
    kth, nxt = top[..., k - 1], top[..., k]
    real = torch.isfinite(kth) & torch.isfinite(nxt)
    return torch.where(real, (kth - nxt) / kth.abs().clamp(min=1e-300), float("inf"))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", ["infllm", "infllm_prr", "infllm_per_head", "infllm_prr_per_head"])
def test_triton_path_selects_what_the_torch_path_selects_on_a_gpu(variant):
    """The 8B shape (32 query / 8 KV heads, D 128, blocks of 16), bf16 cache, 40 steps from a
    1,000-token prompt: the same A wherever the torch path's k-th and (k+1)-th scores are not
    within 1e-5 of each other, slots and scores within 1e-5."""
    torch.backends.cuda.matmul.allow_tf32 = False
    gaps_checked = 0
    for step, want, got, cache, twin, fast, _ in decode_both(variant, 4, 40, 1000, kv_heads=8, head_dim=128, block=16,
                                                          device="cuda", dtype=torch.bfloat16, topk_blocks=32,
                                                          local_blocks=4, representatives=4):
        finite = torch.isfinite(want.scores)
        assert torch.equal(torch.isfinite(got.scores), finite)
        assert rel_err(got.scores[finite], want.scores[finite]) < 1e-5, step
        differ = (got.blocks.indices != want.blocks.indices).any(-1)
        if differ.any():
            assert (boundary_gap(fast, want.scores, cache.num_blocks(0))[differ] < 1e-5).all(), step
        gaps_checked += int(not differ.any())
        assert_slots_equal(twin, cache, f"step {step}")  # (the arrival counters too: both zero)
    assert gaps_checked >= 38


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", ["infllm", "infllm_prr"])
def test_triton_path_replays_in_a_cuda_graph(variant):
    """append_metadata + select captured once and replayed step after step (positions in device
    tensors) equal the same calls made eagerly: static shapes, no host synchronisation."""
    b, hkv, group, d, bs, prompt, steps = 1, 8, 4, 128, 16, 700, 24
    sel = selector(variant, d, topk_blocks=32, local_blocks=4, representatives=4)
    assert sel.set_backend("triton") == "triton"
    g = torch.Generator(device="cuda").manual_seed(0)
    eager = PagedKVCache(1, b, hkv, d, bs, prompt + steps + bs, torch.bfloat16, "cuda")
    eager.append(0, torch.randn(b, hkv, prompt, d, generator=g, device="cuda").bfloat16(),
                 torch.randn(b, hkv, prompt, d, generator=g, device="cuda").bfloat16())
    queries = torch.randn(b, hkv, group, prompt, d, generator=g, device="cuda").bfloat16()
    sel.update_metadata(eager, 0, 0, prompt)
    sel.catch_up(queries[:, :, :, -1], eager, 0, prompt, queries=queries)
    sel._arrivals(eager, 0)
    graphed = copy.deepcopy(eager)
    pos = torch.full((b,), prompt, dtype=torch.int32, device="cuda")
    q = torch.empty(b, hkv, group, d, dtype=torch.bfloat16, device="cuda")
    out = {}

    def step(cache):
        sel.append_metadata(cache, 0, pos)
        lengths = pos + 1
        return sel.select(q, cache, 0, lengths, num_blocks=(pos + bs).div(bs, rounding_mode="floor"))

    def write_token(t):
        k = torch.randn(b, hkv, d, generator=g, device="cuda").bfloat16()
        for cache in (eager, graphed):
            cache.keys[0][:, :, prompt + t] = k
        q.copy_(torch.randn(b, hkv, group, d, generator=g, device="cuda"))
        pos.fill_(prompt + t)

    saved = [t.clone() for t in graphed.metadata[0].values()]
    write_token(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(graphed)  # warm-up (compiles the kernels)
    torch.cuda.current_stream().wait_stream(stream)
    for t, old in zip(graphed.metadata[0].values(), saved, strict=True):
        t.copy_(old)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out["sel"] = step(graphed)
    for t, old in zip(graphed.metadata[0].values(), saved, strict=True):
        t.copy_(old)  # (the capture ran nothing; restore anyway)
    for t in range(steps):
        if t:
            write_token(t)
        want = step(eager)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out["sel"].blocks.indices, want.blocks.indices), t
        assert torch.equal(out["sel"].scores, want.scores), t
    for name, ref in eager.metadata[0].items():
        assert torch.equal(graphed.metadata[0][name], ref), name


# --- compiles for the H200 ------------------------------------------------------------------------

SCRIPT = textwrap.dedent('''
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import prr.kernels.infllm_jit as K

    F, B16, I32, I64 = "*fp32", "*bf16", "*i32", "*i64"
    UNIT = ("stride_qd", "stride_kd", "stride_ws", "stride_rd", "stride_ld", "stride_on")
    failed = []

    def build(fn, types, constexprs):
        fixed = {**constexprs, **{n: 1 for n in fn.arg_names if n in UNIT}}
        sig = {n: "constexpr" if n in fixed else types.get(n, "i32") for n in fn.arg_names}
        try:
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=fixed), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4})
        except Exception as e:  # noqa: BLE001 - reported below
            failed.append(f"{fn.__name__} {constexprs}: {type(e).__name__}: {str(e)[:1500]}")

    build(K._infllm_live_kernel, {"k_ptr": B16, "positions_ptr": I32, "inv_freq_ptr": F, "live_ptr": F},
          {"HEAD_DIM": 128, "BLOCK_SIZE": 16, "UNROTATE": True, "PDL": False})
    step_types = {"q_ptr": B16, "k_ptr": B16, "lengths_ptr": I32, "inv_freq_ptr": F, "window_ptr": F, "repr_ptr": F,
                  "finalised_ptr": I64, "scored_ptr": I64, "arrivals_ptr": I32, "sqrt_d": "fp32"}
    for window, unrotate, layer_sum in ((True, True, False), (False, False, True)):
        build(K._infllm_step_kernel, step_types,
              {"GROUP": 4, "DOT_PAD": 16, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "SINK_BLOCKS": 1, "WINDOW_BLOCKS": 5,
               "FORCED_CHUNK": 128, "FORCED_CHUNKS": 1, "R": 4, "WINDOW_ATTENTION": window, "UNROTATE": unrotate,
               "LAYER_SUM": layer_sum, "NATIVE_DOT": True, "INPUT_PRECISION": "tf32", "PDL": False})
    score_types = {"q_ptr": B16, "lengths_ptr": I32, "num_blocks_ptr": I32, "finalised_ptr": I64, "inv_freq_ptr": F,
                   "repr_ptr": F, "live_ptr": F, "out_ptr": F, "fixed_position": "fp32"}
    for rotate, layer_sum, shared, bn in ((True, True, False, 8), (False, False, True, 32)):
        build(K._infllm_score_kernel, score_types,
              {"GROUP": 4, "GROUP_PAD": 4, "HEAD_DIM": 128, "BLOCK_N": bn, "ROTATE": rotate, "LAYER_SUM": layer_sum,
               "SUM_GROUP": True, "SHARED_REPR": shared, "PDL": False})
    print("\\n".join(failed) if failed else "all compiled")
    sys.exit(1 if failed else 0)
''')


def test_infllm_kernels_compile_for_sm90():
    """The interpreter accepts code a GPU compile rejects: each kernel compiled ahead of time for
    sm_90 (through ptxas) in its engine variants, in a subprocess without TRITON_INTERPRET."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    assert "all compiled" in done.stdout
