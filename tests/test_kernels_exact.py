"""Exact-selection kernels (prr.kernels.exact) against their fp64 torch reference and prr's own
`ExactSelector` torch path, on fresh random inputs at odd sizes. CPU: TRITON_INTERPRET=1 (set in
conftest). GPU variants (-m gpu) run at the 8B shape; run them with TRITON_INTERPRET=0."""

from __future__ import annotations

import math
import os

import pytest
import torch
from prr.kernels.exact import default_tiling, exact_block_lse, exact_block_mass, exact_scores
from prr.kernels.reference_exact import exact_scores_reference, make_exact_inputs
from prr.kernels.reference_selection import topk_select_reference
from prr.kernels.topk import topk_select

from prr.cache import PagedKVCache
from prr.selectors import ExactSelector

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="needs a CUDA device and TRITON_INTERPRET=0",
)
TOL = {torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5}  # masses in fp32 from exact 16-bit inputs


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def check_scores(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    finite = torch.isfinite(ref)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.equal(torch.isfinite(out), finite), "finite / -inf pattern differs"
    assert torch.all(out[~finite] == float("-inf")) and not out.isnan().any()
    if finite.any():
        assert rel_err(out[finite], ref[finite]) < tol


def boundary_gap(ref: torch.Tensor, k: int, num_blocks: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """[B, Hkv] relative gap between the reference's k-th and (k+1)-th selectable scores (inf where
    no (k+1)-th exists): a set is well defined where it is far above fp32 noise."""
    from prr.kernels.reference_selection import forced_scores

    top = forced_scores(ref, num_blocks, sink, recent).double().sort(-1, descending=True).values
    if top.shape[-1] <= k:
        return torch.full(top.shape[:2], float("inf"), dtype=torch.float64)
    kth, nxt = top[..., k - 1], top[..., k]
    real = torch.isfinite(kth) & torch.isfinite(nxt)
    return torch.where(real, (kth - nxt) / kth.abs().clamp(min=1e-300), float("inf"))


def check_same_set_or_near_tie(idx, cnt, ref, k, num_blocks, sink, recent) -> None:
    """idx, cnt: a kernel's selection; ref: reference scores [B, Hkv, N]. Equal sets wherever the
    reference has no near-tie (relative gap 1e-5) at the boundary; equal counts everywhere."""
    ref_idx, ref_cnt = topk_select_reference(ref.cpu(), k, num_blocks.cpu(), sink, recent)
    assert torch.equal(cnt.cpu(), ref_cnt)
    differ = (idx.cpu() != ref_idx).any(-1)
    assert (~differ | (boundary_gap(ref.cpu(), k, num_blocks.cpu(), sink, recent) < 1e-5)).all()


@pytest.mark.parametrize(
    "group,head_dim,block_size,max_blocks,lengths,dtype",
    [
        (1, 64, 16, 7, [27, 100], torch.float32),
        (3, 128, 16, 8, [113, 61], torch.float16),
        (4, 64, 16, 70, [1110, 27], torch.float32),
        (8, 64, 64, 19, [1110, 1], torch.bfloat16),
        (4, 128, 32, 5, [0, 150], torch.float32),  # an empty row: every score -inf
    ],
)
@pytest.mark.parametrize("gqa_reduce", ["max", "sum"])
def test_exact_scores_match_reference(group, head_dim, block_size, max_blocks, lengths, dtype, gqa_reduce):
    x = make_exact_inputs(len(lengths), 2 * group, 2, head_dim, block_size, max_blocks, lengths, dtype,
                          seed=group * 7 + head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    out = exact_scores(**x, block_size=block_size, scale=scale, gqa_reduce=gqa_reduce)
    ref = exact_scores_reference(**x, block_size=block_size, scale=scale, gqa_reduce=gqa_reduce)
    check_scores(out, ref, TOL[dtype])
    # every row's masses sum to 1 per head: the max over heads is at most 1, the sum exactly G
    sums = out.masked_fill(~torch.isfinite(out), 0.0).sum(-1)
    live = x["lengths"] > 0
    if gqa_reduce == "sum":
        assert torch.allclose(sums[live], torch.full_like(sums[live], float(group)), rtol=1e-5)


@pytest.mark.parametrize("tile_blocks,tiles", [(1, 1), (1, 3), (2, 5), (8, 2)])
def test_tilings_give_the_same_scores(tile_blocks, tiles):
    """Runs of any number of tiles, and runs that end inside a row, combine to the same masses."""
    x = make_exact_inputs(2, 6, 2, 64, 16, 37, [590, 213], torch.float32, seed=3)
    ref = exact_scores_reference(**x, block_size=16, scale=0.125)
    out = exact_scores(**x, block_size=16, scale=0.125, tile_blocks=tile_blocks, tiles=tiles, block_n=16)
    check_scores(out, ref, 1e-5)


def test_block_lse_is_each_blocks_log_sum_exp():
    x = make_exact_inputs(1, 3, 1, 64, 16, 9, [131], torch.float32, seed=5)
    block_lse, part_lse = exact_block_lse(**x, block_size=16, scale=0.125, tile_blocks=2, tiles=2)
    s = (x["q"][0].double() @ x["keys"][0, 0, :131].double().T) * 0.125  # [G, 131]
    padded = torch.full((3, 144), float("-inf"), dtype=torch.float64)
    padded[:, :131] = s
    want = torch.logsumexp(padded.view(3, 9, 16), -1)  # [G, NB]
    assert torch.allclose(block_lse[0, 0].double(), want, rtol=1e-6, atol=1e-5)
    want_parts = torch.logsumexp(torch.nn.functional.pad(want, (0, 3), value=float("-inf")).view(3, 3, 4), -1)
    assert torch.allclose(part_lse[0, 0].double(), want_parts, rtol=1e-6, atol=1e-5)
    mass = exact_block_mass(block_lse, part_lse, x["num_blocks"], 4, "sum")
    assert torch.allclose(mass[0, 0].double(), torch.exp(want - torch.logsumexp(s, -1, keepdim=True)).sum(0),
                          rtol=1e-5)


@pytest.mark.parametrize(
    "group,max_blocks,lengths,k,sink,recent",
    [
        (1, 27, [432, 61], 4, 1, 1),
        (3, 61, [976, 500], 9, 1, 2),
        (4, 113, [1808, 1110], 32, 0, 1),
        (8, 7, [100, 27], 16, 1, 1),  # top-K >= number of blocks: every block
    ],
)
@pytest.mark.parametrize("gqa_reduce", ["max", "sum"])
def test_exact_selection_equals_reference_set(group, max_blocks, lengths, k, sink, recent, gqa_reduce):
    x = make_exact_inputs(2, 2 * group, 2, 64, 16, max_blocks, lengths, torch.float32, seed=max_blocks + k)
    scores = exact_scores(**x, block_size=16, scale=0.125, gqa_reduce=gqa_reduce)
    ref = exact_scores_reference(**x, block_size=16, scale=0.125, gqa_reduce=gqa_reduce)
    assert (boundary_gap(ref, k, x["num_blocks"], sink, recent) > 1e-4).all(), "inputs with a near-tie at the boundary"
    idx, cnt = topk_select(scores, k, x["num_blocks"], sink, recent)
    ref_idx, ref_cnt = topk_select_reference(ref, k, x["num_blocks"], sink, recent)
    assert torch.equal(cnt, ref_cnt) and torch.equal(idx, ref_idx)


def make_cache(batch: int, hkv: int, d: int, bs: int, tokens: int, seed: int) -> PagedKVCache:
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, batch, hkv, d, bs, tokens + 20)
    cache.append(0, torch.randn(batch, hkv, tokens, d, generator=gen), torch.randn(batch, hkv, tokens, d, generator=gen))
    return cache


@pytest.mark.parametrize("group,gqa_reduce", [(1, "max"), (3, "sum"), (4, "max"), (8, "sum")])
def test_exact_selector_triton_path_equals_torch_path(group, gqa_reduce):
    """ExactSelector.select on both backends over a ragged batch: the same A (int32 ascending,
    padding 0), the same counts, scores within fp32 tolerance; with and without the engine's counts."""
    hkv, d, bs = 2, 64, 16
    cache = make_cache(2, hkv, d, bs, 300, seed=group)
    gen = torch.Generator().manual_seed(10 + group)
    q = torch.randn(2, hkv, group, d, generator=gen) * 2
    lengths = torch.tensor([300, 117], dtype=torch.int32)
    torch_sel = ExactSelector(topk_blocks=5, sink_blocks=1, local_blocks=1, gqa_reduce=gqa_reduce)
    triton_sel = ExactSelector(topk_blocks=5, sink_blocks=1, local_blocks=1, gqa_reduce=gqa_reduce)
    assert triton_sel.set_backend("triton") == "triton"
    want = torch_sel.select(q, cache, 0, lengths)
    nb = (lengths + bs - 1).div(bs, rounding_mode="floor")
    for got in (triton_sel.select(q, cache, 0, lengths), triton_sel.select(q, cache, 0, lengths, num_blocks=nb)):
        assert got.blocks.indices.dtype == torch.int32
        assert torch.equal(got.blocks.indices, want.blocks.indices)
        assert torch.equal(got.blocks.count, want.blocks.count)
        check_scores(got.scores, want.scores, 1e-5)


def test_union_reduction_has_no_triton_exact_path():
    sel = ExactSelector(topk_blocks=4, gqa_reduce="union")
    assert sel.triton_problems() and "union" in sel.triton_problems()[0]
    assert sel.set_backend("triton") == "torch"
    assert ExactSelector(topk_blocks=4).triton_problems() == []


def test_exact_kernel_errors():
    x = make_exact_inputs(1, 4, 2, 64, 16, 4, None, torch.float32)
    with pytest.raises(ValueError, match="block_size=24"):
        exact_scores(x["q"], x["keys"][:, :, :48], x["lengths"], x["num_blocks"], 24, 0.125)
    with pytest.raises(ValueError, match="gqa_reduce='union'"):
        exact_scores(**x, block_size=16, scale=0.125, gqa_reduce="union")
    with pytest.raises(ValueError, match="Hq must be a multiple"):
        exact_scores(x["q"][:, :3], x["keys"], x["lengths"], x["num_blocks"], 16, 0.125)
    with pytest.raises(ValueError, match="native_dot=True"):
        exact_block_lse(**x, block_size=16, scale=0.125, native_dot=True)
    with pytest.raises(ValueError, match="num_blocks must be"):
        exact_scores(x["q"], x["keys"], x["lengths"], x["num_blocks"].float(), 16, 0.125)
    with pytest.raises(ValueError, match="keys per tile"):
        exact_block_lse(**x, block_size=4, scale=0.125, tile_blocks=2)
    assert default_tiling(16) == (8, 4) and default_tiling(64) == (2, 4) and default_tiling(256) == (1, 2)


@pytest.mark.slow  # 35-80 s under the interpreter (make test-full); the kernels vs torch run in make test
def test_exact_triton_selection_in_the_engine_equals_eager(tmp_path, monkeypatch):
    """The graph engine with backend=triton (exact's kernels under the interpreter) decodes the
    eager runtime's tokens with the same hit rate and overlap (tests/test_one_engine.py's check),
    and both runtimes select through the kernels."""
    import prr.kernels.exact as launcher

    from tests.test_one_engine import check_same_algorithm

    calls = []
    kernel = launcher.exact_scores
    monkeypatch.setattr(launcher, "exact_scores", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    check_same_algorithm(tmp_path, ("exact", "last_step", "backend=triton"), [])
    assert len(calls) >= 2 * 16  # every decode step of the sparse layer, in both runtimes


# --- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tokens,block_size", [(32768, 16), (32768 + 77, 64)])
@pytest.mark.parametrize("gqa_reduce", ["max", "sum"])
def test_gpu_exact_scores_8b_shape(tokens, block_size, gqa_reduce):
    """32 query / 8 KV heads, head 128, bf16 (tensor-core dot), ragged batch of 2."""
    max_blocks = -(-tokens // block_size)
    x = make_exact_inputs(2, 32, 8, 128, block_size, max_blocks, [tokens, tokens // 3], torch.bfloat16, seed=11,
                          device="cuda")
    scale = 1 / math.sqrt(128)
    out = exact_scores(**x, block_size=block_size, scale=scale, gqa_reduce=gqa_reduce)
    ref = exact_scores_reference(**x, block_size=block_size, scale=scale, gqa_reduce=gqa_reduce)
    check_scores(out, ref, 1e-5)
    idx, cnt = topk_select(out, 128, x["num_blocks"], 1, 1)
    check_same_set_or_near_tie(idx, cnt, ref, 128, x["num_blocks"], 1, 1)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_exact_selector_captured_equals_torch(dtype):
    """The selector's Triton path replayed from a CUDA graph (static shapes, no host sync) selects
    what its torch path selects on the same cache."""
    hkv, group, d, bs = 8, 4, 128, 16
    gen = torch.Generator().manual_seed(2)
    cache = PagedKVCache(1, 2, hkv, d, bs, 8192, dtype=dtype, device="cuda")
    cache.append(0, torch.randn(2, hkv, 8000, d, generator=gen).cuda(), torch.randn(2, hkv, 8000, d, generator=gen).cuda())
    q = (torch.randn(2, hkv, group, d, generator=gen) * 2).to(dtype).cuda()
    lengths = torch.tensor([8000, 3001], dtype=torch.int32, device="cuda")
    nb = (lengths + bs - 1).div(bs, rounding_mode="floor").to(torch.int32)
    sel = ExactSelector(topk_blocks=64)
    want = sel.select(q, cache, 0, lengths)
    sel.set_backend("triton")
    sel.select(q, cache, 0, lengths, num_blocks=nb)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = sel.select(q, cache, 0, lengths, num_blocks=nb)
    graph.replay()
    torch.cuda.synchronize()
    check_scores(got.scores, want.scores, 1e-5)
    check_same_set_or_near_tie(got.blocks.indices, got.blocks.count, want.scores, 64, nb, 1, 1)


def test_exact_counts_handed_in_are_the_ones_used():
    """num_blocks below what the lengths imply: only those blocks' tokens count (the softmax over
    them), as Quest's selection takes the engine's counts."""
    x = make_exact_inputs(2, 8, 2, 64, 16, 20, [300, 150], torch.float32, seed=9)
    fewer = torch.tensor([11, 4], dtype=torch.int32)
    out = exact_scores(x["q"], x["keys"], x["lengths"], fewer, 16, 0.125, tile_blocks=8, tiles=1)
    ref = exact_scores_reference(x["q"], x["keys"], fewer * 16, fewer, 16, 0.125)
    check_scores(out, ref, 1e-5)


@pytest.mark.slow  # the kernels under TRITON_INTERPRET=1
def test_exact_ragged_batch_on_the_triton_backend():
    """The graph engine on a ragged batch with exact's kernels decodes what each row decodes alone
    (tests/test_ragged_batch.py's decode; exact keeps no metadata, so tokens, A and next P per step
    are compared here): per-row lengths reach the q·K and mass passes."""
    from prr.runtime.graph_decode import StaticPlan
    from tests.test_ragged_batch import CONFIG64, LENGTHS, decode

    plan = StaticPlan(variant="prr", predicted_blocks=2, block_size=16, count_hits=True)

    def run(rows):
        return decode(plan, rows, lambda: ExactSelector(topk_blocks=3, sink_blocks=1, dense_layers=(0,)),
                      "ema_membership", backend="triton", config=CONFIG64)

    batch_tokens, batch_steps = run([0, 1, 2])
    for b in range(len(LENGTHS)):
        tokens, steps = run([b])
        assert torch.equal(batch_tokens[b], tokens[0]), f"row {b}"
        assert len(steps) == len(batch_steps) > 2
        for step in range(1, len(steps) - 1):  # between the metadata entries: A and next P per sparse layer
            for mine, one in zip(batch_steps[step], steps[step], strict=True):
                assert len(mine) == len(one) > 0
                for x, y in zip(mine, one, strict=True):
                    if x is not None:
                        assert torch.equal(x[b], y[0]), f"row {b}, step {step}"
