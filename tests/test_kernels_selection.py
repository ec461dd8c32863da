"""Selection kernels (prr.kernels.quest, prr.kernels.topk) against their torch references and
prr's own selector code, on fresh random inputs at odd sizes. CPU: TRITON_INTERPRET=1 (set in
conftest). GPU variants (-m gpu) run at realistic sizes; run them with TRITON_INTERPRET=0."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

import prr
from prr.cache import PagedKVCache
from prr.selectors import DenseSelector, QuestSelector

ROOT = Path(__file__).resolve().parents[1]

try:
    import prr.kernels  # noqa: F401 - an install maps kernels/ to prr.kernels
except ModuleNotFoundError:  # not installed: map the folder the same way, never as bare `kernels`
    _spec = importlib.util.spec_from_file_location(
        "prr.kernels", ROOT / "kernels" / "__init__.py", submodule_search_locations=[str(ROOT / "kernels")]
    )
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["prr.kernels"] = _module
    _spec.loader.exec_module(_module)
    prr.kernels = _module

from prr.kernels import topk as topk_launcher  # noqa: E402
from prr.kernels.quest import quest_score, quest_select, quest_update  # noqa: E402
from prr.kernels.reference_selection import (  # noqa: E402
    make_quest_inputs,
    make_topk_scores,
    quest_metadata_reference,
    quest_score_reference,
    topk_select_reference,
)
from prr.kernels.topk import topk_select  # noqa: E402

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="needs a CUDA device and TRITON_INTERPRET=0",
)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def check_scores(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    finite = torch.isfinite(ref)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.equal(torch.isfinite(out), finite), "finite / -inf pattern differs"
    assert torch.all(out[~finite] == float("-inf"))
    assert not out.isnan().any()
    assert rel_err(out[finite], ref[finite]) < tol


def check_topk(scores, k, num_blocks, sink, recent, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    idx, cnt = topk_select(scores, k, num_blocks, sink, recent, **kw)
    ref_idx, ref_cnt = topk_select_reference(scores.cpu(), k, num_blocks.cpu(), sink, recent)
    assert idx.dtype == torch.int32 and cnt.dtype == torch.int32
    assert idx.shape == ref_idx.shape and cnt.shape == ref_cnt.shape
    assert torch.equal(cnt.cpu(), ref_cnt)
    assert torch.equal(idx.cpu(), ref_idx)  # same set, ascending, padding 0
    return idx, cnt


# --- quest_score ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "group,head_dim,max_blocks,num_blocks,q_dtype",
    [
        (1, 64, 27, [27, 3], torch.float32),
        (3, 128, 61, [61, 40], torch.float16),
        (4, 64, 113, [1, 113], torch.float32),
        (8, 128, 27, [13, 27], torch.float16),
        (4, 80, 61, [61, 0], torch.float32),  # D not a power of two, an empty row
    ],
)
@pytest.mark.parametrize("gqa_reduce", ["max", "sum"])
@pytest.mark.parametrize("d_chunk", [None, 0])  # heads at once over D chunks (default) / per head over D
def test_quest_score_matches_reference(group, head_dim, max_blocks, num_blocks, q_dtype, gqa_reduce, d_chunk):
    hkv = 2
    inputs = make_quest_inputs(2, hkv * group, hkv, head_dim, max_blocks, num_blocks, q_dtype, seed=group + head_dim)
    out = quest_score(**inputs, gqa_reduce=gqa_reduce, d_chunk=d_chunk)
    ref = quest_score_reference(**inputs, gqa_reduce=gqa_reduce)
    check_scores(out, ref, 1e-5)


def test_quest_score_half_precision_metadata():
    """fp16 metadata (half the bytes) is widened exactly in the kernel (bf16 too, tested on the GPU)."""
    inputs = make_quest_inputs(2, 8, 2, 64, 27, [27, 10], seed=8)
    inputs["key_max"], inputs["key_min"] = inputs["key_max"].half(), inputs["key_min"].half()
    for d_chunk in (0, 32):
        out = quest_score(**inputs, d_chunk=d_chunk)
        check_scores(out, quest_score_reference(**inputs), 1e-5)


@pytest.mark.parametrize("gqa_reduce", ["max", "sum"])
def test_quest_score_tensor_core_path(gqa_reduce):
    """fp16 q and fp16 metadata take the tensor-core path by default (d_chunk=-1: two GEMMs
    q⁺·M^T + q⁻·m^T, exact products, fp32 sums): equal to the reference within fp32 rounding,
    at an odd group (padded to the GEMM's 16 rows), odd block count and D=80."""
    inputs = make_quest_inputs(2, 6, 2, 80, 61, [61, 17], torch.float16, seed=11)
    inputs["key_max"], inputs["key_min"] = inputs["key_max"].half(), inputs["key_min"].half()
    ref = quest_score_reference(**inputs, gqa_reduce=gqa_reduce)
    for kwargs in ({}, {"d_chunk": -1, "block_n": 16}):
        check_scores(quest_score(**inputs, gqa_reduce=gqa_reduce, **kwargs), ref, 1e-5)
    fp32 = make_quest_inputs(2, 6, 2, 80, 61, [61, 17], torch.float32, seed=11)
    with pytest.raises(ValueError, match="d_chunk=-1"):
        quest_score(**fp32, d_chunk=-1)


def test_quest_score_small_tiles_and_strided_q():
    inputs = make_quest_inputs(2, 12, 3, 64, 61, [61, 30], seed=5)
    q = torch.randn(2, 64, 12).transpose(1, 2)  # non-contiguous [B, Hq, D]
    inputs["q"] = q
    for d_chunk in (0, 16):
        out = quest_score(**inputs, gqa_reduce="max", block_n=8, num_warps=2, d_chunk=d_chunk)
        check_scores(out, quest_score_reference(**inputs, gqa_reduce="max"), 1e-5)


@pytest.mark.parametrize("gqa_reduce", ["max", "sum"])
@pytest.mark.parametrize("group", [1, 3])
def test_quest_score_equals_prr_selector_scores(gqa_reduce, group):
    """The kernel reproduces Selection.scores (prr's `reduced`) from a real cache."""
    hkv, d, bs, length = 2, 64, 8, 203  # 26 blocks, the last one partly filled
    sel = QuestSelector(topk_blocks=4, gqa_reduce=gqa_reduce)
    g = torch.Generator().manual_seed(group)
    cache = PagedKVCache(1, 2, hkv, d, bs, length + 13)
    cache.append(0, torch.randn(2, hkv, length, d, generator=g) * 2, torch.randn(2, hkv, length, d, generator=g))
    sel.update_metadata(cache, 0, 0, length)
    q = torch.randn(2, hkv * group, d, generator=g)
    key_max, key_min = cache.metadata[0]["quest_key_max"], cache.metadata[0]["quest_key_min"]
    for row_length in (length, 77):  # prr's select takes one length for the batch
        expected = sel.select(q.view(2, hkv, group, d), cache, 0, length=row_length).scores
        nb = torch.full((2,), cache.num_blocks(0, row_length), dtype=torch.int32)
        out = quest_score(q, key_max, key_min, nb, gqa_reduce)
        # Past row_length prr's metadata still holds real blocks, masked by num_blocks here.
        check_scores(out, expected, 1e-5)


@pytest.mark.parametrize("group", [1, 4])
def test_quest_score_bounds_every_key(group):
    """Quest's defining property: U_b(q) >= q·k for every key k of block b (every head of the group)."""
    hkv, d, bs, length = 2, 64, 16, 200
    g = torch.Generator().manual_seed(11)
    keys = torch.randn(2, hkv, length, d, generator=g) * 3
    max_blocks = -(-length // bs)
    key_max, key_min = quest_metadata_reference(keys, length, bs, max_blocks)
    q = torch.randn(2, hkv * group, d, generator=g)
    nb = torch.tensor([max_blocks, max_blocks], dtype=torch.int32)
    out = quest_score(q, key_max, key_min, nb, "max")  # [B, Hkv, NB]
    padded = torch.cat([keys, keys.new_zeros(2, hkv, max_blocks * bs - length, d)], 2)
    dots = torch.einsum("bhgd,bhtd->bhgt", q.view(2, hkv, group, d), padded)  # [B, Hkv, G, T]
    dots[..., length:] = float("-inf")
    best = dots.view(2, hkv, group, max_blocks, bs).amax(-1).amax(2)  # [B, Hkv, NB]
    assert torch.all(out >= best - 1e-4 * best.abs().clamp(min=1))


def test_quest_score_errors():
    inputs = make_quest_inputs(1, 4, 2, 64, 5)
    with pytest.raises(ValueError, match="gqa_reduce"):
        quest_score(**inputs, gqa_reduce="union")
    with pytest.raises(ValueError, match="not a multiple"):
        quest_score(inputs["q"][:, :3], inputs["key_max"], inputs["key_min"], inputs["num_blocks"])
    with pytest.raises(ValueError, match="num_blocks must be an int32"):
        quest_score(inputs["q"], inputs["key_max"], inputs["key_min"], inputs["num_blocks"].float())
    big = make_quest_inputs(1, 2, 2, 512, 3)
    with pytest.raises(ValueError, match="head_dim=512 is not supported"):
        quest_score(**big)
    with pytest.raises(ValueError, match="d_chunk=24"):
        quest_score(**inputs, d_chunk=24)


# --- quest_select (fused score + top-k) -----------------------------------------------------


@pytest.mark.parametrize(
    "group,head_dim,max_blocks,num_blocks,k,sink,recent,gqa_reduce",
    [
        (4, 64, 113, [113, 40], 9, 1, 1, "max"),
        (3, 128, 27, [27, 3], 50, 0, 1, "sum"),  # k >= nb
        (1, 64, 61, [0, 61], 1, 2, 2, "max"),  # an empty row; forced blocks > k
    ],
)
@pytest.mark.parametrize("radix_bits", [1, 2])
def test_quest_select_equals_score_then_topk(group, head_dim, max_blocks, num_blocks, k, sink, recent, gqa_reduce,
                                             radix_bits):
    hkv = 2
    inputs = make_quest_inputs(2, hkv * group, hkv, head_dim, max_blocks, num_blocks, torch.float16, seed=k)
    arrivals = torch.zeros(2 * hkv, dtype=torch.int32)
    for _ in range(2):  # the workspace is re-armed by each launch
        scores, idx, cnt = quest_select(**inputs, k=k, sink_blocks=sink, recent_blocks=recent,
                                        gqa_reduce=gqa_reduce, arrivals=arrivals, block_n=16,
                                        radix_bits=radix_bits)
        assert torch.equal(arrivals, torch.zeros_like(arrivals))
    check_scores(scores, quest_score_reference(**inputs, gqa_reduce=gqa_reduce), 1e-5)
    ref_idx, ref_cnt = topk_select_reference(scores, k, inputs["num_blocks"], sink, recent)
    assert torch.equal(idx, ref_idx) and torch.equal(cnt, ref_cnt)


# --- quest_update --------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim,k_dtype", [(64, torch.float32), (128, torch.float16)])
def test_quest_update_appends_equal_rebuild(head_dim, k_dtype):
    """Token-by-token appends crossing block boundaries, rows at different positions, from
    stale metadata: equals rebuilding the metadata from the keys."""
    hkv, bs, max_blocks = 3, 8, 7
    g = torch.Generator().manual_seed(head_dim)
    keys = (torch.randn(2, hkv, max_blocks * bs, head_dim, generator=g) * 2).to(k_dtype)
    starts = [5, 17]  # row 0 from inside block 0, row 1 from inside block 2
    key_max = torch.randn(2, hkv, max_blocks, head_dim, generator=g)  # stale contents of a reused cache
    key_min = key_max - 1.0
    for b, start in enumerate(starts):  # metadata as it stands after `start` tokens
        mx, mn = quest_metadata_reference(keys[b : b + 1], start, bs, max_blocks)
        nb = -(-start // bs)
        key_max[b, :, :nb], key_min[b, :, :nb] = mx[0, :, :nb], mn[0, :, :nb]
    for step in range(20):
        positions = torch.tensor([s + step for s in starts], dtype=torch.int32)
        k_new = keys[torch.arange(2), :, positions.long()]  # [B, Hkv, D]
        quest_update(key_max, key_min, k_new, positions, bs)
    for b, start in enumerate(starts):
        end = start + 20
        mx, mn = quest_metadata_reference(keys[b : b + 1], end, bs, max_blocks)
        nb = -(-end // bs)
        assert torch.equal(key_max[b, :, :nb], mx[0, :, :nb])
        assert torch.equal(key_min[b, :, :nb], mn[0, :, :nb])


def test_quest_update_equals_prr_update_metadata():
    hkv, d, bs, prompt = 2, 64, 16, 45
    sel = QuestSelector(topk_blocks=4)
    g = torch.Generator().manual_seed(3)
    cache = PagedKVCache(1, 2, hkv, d, bs, prompt + 40)
    cache.append(0, torch.randn(2, hkv, prompt, d, generator=g), torch.randn(2, hkv, prompt, d, generator=g))
    sel.update_metadata(cache, 0, 0, prompt)
    key_max = cache.metadata[0]["quest_key_max"].clone()
    key_min = cache.metadata[0]["quest_key_min"].clone()
    for _ in range(25):  # crosses the blocks at 48 and 64
        k, v = torch.randn(2, hkv, 1, d, generator=g), torch.randn(2, hkv, 1, d, generator=g)
        start, end = cache.append(0, k, v)
        sel.update_metadata(cache, 0, start, end)
        quest_update(key_max, key_min, k[:, :, 0], torch.full((2,), start, dtype=torch.int32), bs)
    assert torch.equal(key_max, cache.metadata[0]["quest_key_max"])
    assert torch.equal(key_min, cache.metadata[0]["quest_key_min"])


def test_quest_update_ignores_positions_outside_the_cache():
    key_max = torch.randn(2, 2, 4, 64)
    key_min = key_max - 1
    before = key_max.clone(), key_min.clone()
    positions = torch.tensor([-1, 4 * 16], dtype=torch.int32)  # before the start, past the capacity
    quest_update(key_max, key_min, torch.randn(2, 2, 64), positions, 16)
    assert torch.equal(key_max, before[0]) and torch.equal(key_min, before[1])


def test_quest_update_errors():
    key_max = torch.zeros(1, 2, 4, 64)
    with pytest.raises(ValueError, match="power of two"):
        quest_update(key_max, key_max.clone(), torch.zeros(1, 2, 64), torch.zeros(1, dtype=torch.int32), 12)
    with pytest.raises(ValueError, match="k_new must be"):
        quest_update(key_max, key_max.clone(), torch.zeros(1, 3, 64), torch.zeros(1, dtype=torch.int32), 16)


# --- topk_select ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,n,num_blocks,k,sink,recent",
    [
        ("randn", 3, [3, 2], 2, 0, 1),
        ("randn", 27, [27, 5], 4, 1, 1),
        ("ties", 61, [61, 33], 10, 1, 2),
        ("integers", 113, [113, 100], 17, 2, 1),
        ("integers", 113, [60, 113], 200, 1, 1),  # k >= nb: everything valid
        ("ties", 61, [61, 0], 1, 0, 1),  # k = 1; an empty row
        ("extremes", 61, [61, 61], 20, 0, 0),  # ±inf, ±FLT_MAX, denormals, ±0
        ("randn", 27, [27, 27], 3, 4, 2),  # more forced blocks than k: lowest forced ids
        ("ties", 1110, [1110, 777], 64, 1, 3),
    ],
)
@pytest.mark.parametrize("radix_bits", [1, 2])
def test_topk_select_matches_top_blocks(kind, n, num_blocks, k, sink, recent, radix_bits):
    scores, nb = make_topk_scores(2, 3, n, num_blocks, kind, seed=n + k)
    check_topk(scores, k, nb, sink, recent, radix_bits=radix_bits)


@pytest.mark.parametrize(
    "kind,n,num_blocks,k,sink,recent",
    [
        ("randn", 1500, [1500, 1500], 40, 1, 1),  # candidates kept: the filtered path
        ("randn", 1100, [1100, 300], 64, 0, 2),  # a context far shorter than the row (strided groups)
        pytest.param("randn", 1100, [40, 1100], 64, 1, 1, marks=pytest.mark.slow),  # fewer blocks than groups: every valid block passes
        pytest.param("ties", 1024, [1024, 900], 16, 1, 1, marks=pytest.mark.slow),  # three values: too many candidates, the full row
        ("extremes", 1030, [1030, 1030], 33, 2, 0),  # k not a power of two; ±inf, ±0, denormals
    ],
)
def test_topk_candidate_filter_equals_full_row(kind, n, num_blocks, k, sink, recent):
    """The candidate filter (rows >= 1024 blocks, k groups) selects exactly what the full-row
    passes select, whether it prunes, finds no bound, or overflows its scratch."""
    from prr.kernels.topk import candidate_filter_shape

    assert candidate_filter_shape(triton_next_pow2(n), k)[0] > 0  # the filter is on for these shapes
    scores, nb = make_topk_scores(2, 3, n, num_blocks, kind, seed=n + k)
    filtered = check_topk(scores, k, nb, sink, recent)
    full = topk_select(scores, k, nb, sink, recent, candidate_filter=False)
    assert torch.equal(filtered[0], full[0]) and torch.equal(filtered[1], full[1])


def test_candidate_filter_policy():
    """The filter's cap holds 1.5x (<= 16 rows) or 2x the iid mean of candidates, a power of two; the
    filter is off where that exceeds a quarter of the row; 2-bit candidate passes above 512."""
    import math

    from prr.kernels.topk import candidate_filter_shape, filter_groups

    assert candidate_filter_shape(8192, 128, 64) == (128, 2048, 2)  # H200: 17.5 µs vs 24.3 (cap N/8)
    assert candidate_filter_shape(2048, 32, 8) == (32, 256, 4) and candidate_filter_shape(2048, 32, 64) == (32, 512, 4)
    assert candidate_filter_shape(2048, 128, 8)[0] == 0 and candidate_filter_shape(8192, 512, 64)[0] == 0
    assert candidate_filter_shape(512, 8, 8)[0] == 0 and filter_groups(512, 8) == 0  # rows under 1024 blocks
    assert candidate_filter_shape(2048, 32, 16)[1] == 256 and candidate_filter_shape(2048, 32, 17)[1] == 512
    for block in (1024, 2048, 4096, 8192, 16384):
        for k in (1, 5, 16, 33, 100, 128, 300, 512):
            for rows in (1, 8, 64):
                groups, cap, radix = candidate_filter_shape(block, k, rows)
                if groups:
                    assert groups == filter_groups(block, k) >= k and cap & (cap - 1) == 0 and 4 * cap <= block
                    mean = groups * (math.log(groups) + 0.58)
                    assert cap >= max(16, (1.5 if rows <= 16 else 2.0) * mean) and radix == (4 if cap <= 512 else 2)


@pytest.mark.parametrize("cap,radix_bits,kept", [(256, 2, "some"), (1024, 2, "all"), (512, 4, "all"), (32, 4, "none")])
def test_topk_candidate_cap_and_radix_knobs_select_the_same(cap, radix_bits, kept):
    """candidate_cap / candidate_radix_bits only move work: a cap all rows' candidates fit (2- or
    4-bit candidate passes), some fit, or none fit (the full row) selects what the reference does."""
    scores, nb = make_topk_scores(2, 3, 1300, [1300, 700], "randn", seed=cap + radix_bits)
    fits = filter_keeps_candidates(scores, 40, nb, 1, 1, cap=cap)
    assert {"all": fits.all(), "none": ~fits.any(), "some": fits.any() & ~fits.all()}[kept]
    check_topk(scores, 40, nb, 1, 1, candidate_cap=cap, candidate_radix_bits=radix_bits)


def test_topk_candidate_knobs_bad_values_raise():
    scores, nb = make_topk_scores(1, 1, 40, [40], "randn")
    with pytest.raises(ValueError, match="candidate_cap=100"):
        topk_select(scores, 4, nb, candidate_cap=100)
    with pytest.raises(ValueError, match="candidate_radix_bits=3"):
        topk_select(scores, 4, nb, candidate_radix_bits=3)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def bit_range_row(g: torch.Generator, n: int, base: float | None, spread: int, valid_fraction: float):
    """n fp32 scores whose bit patterns are base's plus 0 .. spread (one sign, no inf: their keys
    share every bit above those of spread; spread 0: all equal; base None: N(0, 1), both signs),
    a random valid_fraction of them kept and the rest -inf. Exactly one valid: valid_fraction < 0;
    none: 0."""
    if base is None:
        row = torch.randn(n, generator=g)
    else:
        bits = torch.tensor([base], dtype=torch.float32).view(torch.int32)
        row = (bits + torch.randint(0, spread + 1, (n,), generator=g, dtype=torch.int32)).view(torch.float32)
    if valid_fraction < 0:
        keep = torch.zeros(n, dtype=torch.bool)
        keep[torch.randint(0, n, (1,), generator=g)] = True
    else:
        keep = torch.rand(n, generator=g) < valid_fraction
    return row.masked_fill(~keep, float("-inf"))


# (base, spread of the bit patterns, valid fraction): where the smallest and largest key differ
# from bit 0 to bit 30 (digit boundaries 4/16/256 and just past them), both signs, no shared bit
# (sparse N(0, 1)), ties at the threshold (few distinct values), all equal (no pass), one valid
# key, no valid key (k_eff 0).
BIT_RANGE_ROWS = [
    (1000.0, 0, 0.1), (1000.0, 1, 0.1), (1000.0, 15, 0.12), (1000.0, 16, 0.12),
    (-3.5, 255, 0.15), (-3.5, 256, 0.15), (0.7, 4099, 0.15), (1e-30, 1 << 20, 0.15),
    (-1e30, 7, 0.15), (1000.0, 63, 1.0), (None, 0, 0.03), (1000.0, 0, -1.0),
    (2.0, 1 << 28, 0.15), (-7.0, 2, 0.002), (1.0, 0, 0.0), (1000.0, 1 << 14, 1.0),
]


def bit_range_scores(n: int, seed: int) -> torch.Tensor:
    """[2, 8, n]: one row of BIT_RANGE_ROWS per (batch, head); the last row is 1000 + U[0, 1)."""
    g = torch.Generator().manual_seed(seed)
    rows = [bit_range_row(g, n, *spec) for spec in BIT_RANGE_ROWS]
    rows[-1] = 1000.0 + torch.rand(n, generator=g)  # all in [1000, 1001): 10 leading bits shared
    return torch.stack(rows).view(2, 8, n)


def filter_keeps_candidates(scores: torch.Tensor, k: int, num_blocks: torch.Tensor, sink: int, recent: int,
                            cap: int | None = None):
    """[B, Hkv] bool: the row kernel's candidate filter (the policy's cap, or `cap`) keeps the
    row's candidates rather than falling back to the full row; the kernel's rule in floats."""
    from prr.kernels.reference_selection import forced_scores
    from prr.kernels.topk import candidate_filter_shape

    n = scores.shape[-1]
    block = triton_next_pow2(n)
    groups, policy_cap, _ = candidate_filter_shape(block, k, scores.shape[0] * scores.shape[1])
    cap = cap or policy_cap
    assert groups > 0
    s = forced_scores(scores, num_blocks, sink, recent)
    s = torch.nn.functional.pad(s, (0, block - n), value=float("-inf"))
    valid = s > float("-inf")
    k_eff = valid.sum(-1).clamp(max=k)
    group_max = s.view(*s.shape[:2], block // groups, groups).amax(2)  # block b in group b % groups
    nonempty = group_max > float("-inf")
    bound = torch.where(nonempty, group_max, float("inf")).amin(-1)
    bound = torch.where(nonempty.sum(-1) >= k_eff, bound, float("-inf"))
    return (valid & (s >= bound[..., None])).sum(-1) <= cap


@pytest.mark.parametrize("k,sink,recent,radix_bits", [(24, 0, 0, 4), (7, 1, 2, 4), (5, 0, 1, 4), (3, 1, 2, 4), (5, 3, 3, 4),
                                                   (24, 0, 0, 2), (7, 1, 2, 2)])
def test_topk_radix_skips_common_leading_bits_candidate_rows(k, sink, recent, radix_bits):
    """The 4- and 2-bit passes over the candidate filter's rows (cap 256) start from the bits the
    smallest and largest candidate share: same selection as top_blocks for keys differing from bit
    0 up to bit 30, all equal (no pass), ties at the threshold, -inf and forced blocks, k_eff 0."""
    n = 1500
    scores = bit_range_scores(n, seed=k + 10 * sink + recent)
    nb = torch.tensor([n, 1234], dtype=torch.int32)
    assert filter_keeps_candidates(scores, k, nb, sink, recent, cap=256).all()  # every row on the 4-bit path
    _, cnt = check_topk(scores, k, nb, sink, recent, candidate_cap=256, candidate_radix_bits=radix_bits)
    if sink + recent == 0:
        assert (cnt == 0).any() and (cnt == 1).any()  # a row without valid keys, one with one


@pytest.mark.parametrize("n,radix_bits", [(201, 1), pytest.param(201, 2, marks=pytest.mark.slow), (77, 2)])
def test_topk_radix_skips_common_leading_bits_full_rows(n, radix_bits):
    """The same pass skipping on the full-row 1- and 2-bit passes (rows under 1024 blocks)."""
    scores = bit_range_scores(n, seed=n + radix_bits)
    nb = torch.tensor([n, n - 20], dtype=torch.int32)
    for k, sink, recent in ((13, 0, 0), (40, 1, 1), (1, 1, 1), (2, 0, 2)):
        check_topk(scores, k, nb, sink, recent, radix_bits=radix_bits)


def test_topk_radix_skip_dense_narrow_row_falls_back_to_full_row():
    """Dense rows of a few distinct close values: too many candidates, the full 2-bit row
    passes from the shared bits (and the filtered and unfiltered launches agree)."""
    g = torch.Generator().manual_seed(5)
    n, k = 1100, 16
    bits = torch.tensor([1000.0]).view(torch.int32)
    scores = (bits + torch.randint(0, 3, (1, 2, n), generator=g, dtype=torch.int32)).view(torch.float32)
    nb = torch.tensor([n], dtype=torch.int32)
    assert not filter_keeps_candidates(scores, k, nb, 0, 0).any()
    idx, cnt = check_topk(scores, k, nb, 0, 0)
    full = topk_select(scores, k, nb, 0, 0, candidate_filter=False)
    assert torch.equal(idx, full[0]) and torch.equal(cnt, full[1])


def test_topk_select_k_zero_and_counts():
    scores, nb = make_topk_scores(2, 2, 27, [27, 4], "randn")
    idx, cnt = topk_select(scores, 0, nb)
    assert idx.shape == (2, 2, 0) and torch.equal(cnt, torch.zeros(2, 2, dtype=torch.int32))
    idx, cnt = check_topk(scores, 50, nb, 1, 1)
    assert idx.shape == (2, 2, 27) and cnt.tolist() == [[27, 27], [4, 4]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])])
def test_topk_select_signed_zeros_tie(device):
    """-0.0 == +0.0 as floats: a tie broken by block index, not by the sign bit."""
    g = torch.Generator().manual_seed(0)
    scores = torch.where(torch.rand(2, 2, 61, generator=g) < 0.5, -0.0, 0.0)
    scores[..., 40:] = 1.0
    check_topk(scores.to(device), 30, torch.tensor([61, 50], dtype=torch.int32, device=device), 0, 0)


def test_topk_select_tiled_path(monkeypatch):
    """Rows longer than MAX_ROW_BLOCK go through the tiled kernel: several tiles per row here."""
    monkeypatch.setattr(topk_launcher, "MAX_ROW_BLOCK", 16)
    monkeypatch.setattr(topk_launcher, "TILE", 32)
    for kind, k, radix_bits in (("ties", 9, 1), ("integers", 40, 2)):
        scores, nb = make_topk_scores(2, 2, 113, [113, 70], kind, seed=k)
        check_topk(scores, k, nb, 1, 2, radix_bits=radix_bits)


def test_topk_select_fp16_and_strided_scores():
    scores, nb = make_topk_scores(2, 4, 61, [61, 50], "ties", seed=4)
    check_topk(scores.half(), 7, nb, 1, 1)
    wide = torch.randn(2, 61, 4).transpose(1, 2)  # non-contiguous [B, Hkv, N]
    check_topk(wide, 9, nb, 0, 1)


def test_topk_select_property():
    """Random small rows with few distinct values (ties everywhere) and some -inf, random nb, k,
    forcing, and the one-program or the split-row kernel (split=CHUNK)."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=15, deadline=None)
    @hypothesis.given(
        n=st.integers(1, 70),
        k=st.integers(1, 80),
        sink=st.integers(0, 3),
        recent=st.integers(0, 3),
        values=st.integers(1, 4),
        split=st.sampled_from([None, 16, 32]),
        seed=st.integers(0, 2**16),
    )
    def check(n, k, sink, recent, values, split, seed):
        g = torch.Generator().manual_seed(seed)
        scores = torch.randint(0, values, (2, 2, n), generator=g).float() - 1.0
        scores[torch.rand(scores.shape, generator=g) < 0.1] = float("-inf")  # never taken
        nb = torch.randint(0, n + 1, (2,), generator=g).to(torch.int32)
        check_topk(scores, k, nb, sink, recent, split=split)

    check()


def test_topk_select_errors():
    scores, nb = make_topk_scores(1, 2, 27)
    with pytest.raises(ValueError, match="k=-1"):
        topk_select(scores, -1, nb)
    with pytest.raises(ValueError, match="num_blocks must be an int32"):
        topk_select(scores, 3, nb.float())
    with pytest.raises(ValueError, match=r"\[B, Hkv, N\]"):
        topk_select(scores[0], 3, nb)


# --- GPU, realistic sizes (Hq 32, Hkv 8, D 128, 128K context, block 16 -> 8192 blocks) ------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("gqa_reduce", ["max", "sum"])
@pytest.mark.parametrize("d_chunk", [0, 32])
def test_gpu_quest_score_128k(gqa_reduce, d_chunk):
    inputs = make_quest_inputs(2, 32, 8, 128, 8192, [8192, 5001], torch.bfloat16, seed=1, device="cuda")
    out = quest_score(**inputs, gqa_reduce=gqa_reduce, d_chunk=d_chunk)
    check_scores(out, quest_score_reference(**inputs, gqa_reduce=gqa_reduce), 1e-5)


@pytest.mark.gpu
@gpu
def test_gpu_quest_score_bf16_metadata():
    inputs = make_quest_inputs(1, 32, 8, 128, 8192, None, torch.bfloat16, seed=4, device="cuda")
    inputs["key_max"], inputs["key_min"] = inputs["key_max"].bfloat16(), inputs["key_min"].bfloat16()
    for d_chunk in (0, 32, -1, None):  # None: the tensor-core path (q and metadata both bf16)
        check_scores(quest_score(**inputs, d_chunk=d_chunk), quest_score_reference(**inputs), 1e-5)


@pytest.mark.gpu
@gpu
def test_gpu_quest_update():
    hkv, d, bs, max_blocks = 8, 128, 16, 8192
    g = torch.Generator().manual_seed(2)
    keys = (torch.randn(2, hkv, 64, d, generator=g)).to(torch.bfloat16).cuda()
    key_max = torch.randn(2, hkv, max_blocks, d, device="cuda")
    key_min = key_max - 1
    base = [131000, 4000]  # rows far apart, near the end of a 128K cache; both cross block boundaries
    for step in range(40):
        positions = torch.tensor([p + step for p in base], dtype=torch.int32, device="cuda")
        quest_update(key_max, key_min, keys[:, :, step], positions, bs)
    for b, p in enumerate(base):
        first, last = p // bs, (p + 39) // bs
        for blk in range(first, last + 1):
            lo, hi = max(p, blk * bs), min(p + 40, (blk + 1) * bs)
            chunk = keys[b, :, lo - p : hi - p].float()  # [Hkv, n, D]
            if lo == blk * bs:  # the block started within the appends: exactly its keys
                assert torch.equal(key_max[b, :, blk], chunk.amax(1))
                assert torch.equal(key_min[b, :, blk], chunk.amin(1))
            else:
                assert torch.all(key_max[b, :, blk] >= chunk.amax(1))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,k", [(2048, 128), (2048, 32), (8192, 128), (8192, 512), (40000, 256)])
@pytest.mark.parametrize("radix_bits", [1, 2])
def test_gpu_topk_select(n, k, radix_bits):
    # multi_program=False: rows past MAX_ROW_BLOCK take the multi-program path by default
    # (tests/test_kernels_topk_long.py); here the one-program kernels, the tiled one at 40000
    for kind in ("randn", "ties"):
        scores, nb = make_topk_scores(1, 8, n, None, kind, seed=n, device="cuda")
        check_topk(scores, k, nb, 1, 1, radix_bits=radix_bits, multi_program=False)
    scores, _ = make_topk_scores(2, 8, n, None, "integers", seed=1, device="cuda")
    nb = torch.tensor([n, n // 3], dtype=torch.int32, device="cuda")
    check_topk(scores, k, nb, 1, 2, radix_bits=radix_bits, multi_program=False)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("batch,num_blocks", [(1, None), (2, [8192, 3001])])
@pytest.mark.parametrize("radix_bits", [2])
@pytest.mark.parametrize("meta_dtype", [torch.float32, torch.bfloat16])  # bf16: the tensor-core score
def test_gpu_quest_select_fused(batch, num_blocks, radix_bits, meta_dtype):
    inputs = make_quest_inputs(batch, 32, 8, 128, 8192, num_blocks, torch.bfloat16, seed=3, device="cuda")
    inputs["key_max"], inputs["key_min"] = inputs["key_max"].to(meta_dtype), inputs["key_min"].to(meta_dtype)
    arrivals = torch.zeros(batch * 8, dtype=torch.int32, device="cuda")
    for _ in range(3):
        scores, idx, cnt = quest_select(**inputs, k=128, sink_blocks=1, recent_blocks=1, arrivals=arrivals,
                                        radix_bits=radix_bits)
    torch.cuda.synchronize()
    assert torch.equal(arrivals, torch.zeros_like(arrivals))
    check_scores(scores, quest_score_reference(**inputs), 1e-5)
    ref_idx, ref_cnt = topk_select_reference(scores.cpu(), 128, inputs["num_blocks"].cpu(), 1, 1)
    assert torch.equal(idx.cpu(), ref_idx) and torch.equal(cnt.cpu(), ref_cnt)


@pytest.mark.gpu
@gpu
def test_gpu_selection_pipeline_bf16():
    """Score + top-k at 128K, block 16, bf16 q: the set equals prr's top_blocks over the reference scores."""
    inputs = make_quest_inputs(1, 32, 8, 128, 8192, None, torch.bfloat16, seed=7, device="cuda")
    scores = quest_score(**inputs)
    ref = quest_score_reference(**inputs)
    check_scores(scores, ref, 1e-5)
    check_topk(scores, 128, inputs["num_blocks"], 1, 1)


def test_quest_triton_selection_takes_the_callers_block_counts():
    """Selector.select with the engine's per-step num_blocks (no launches to derive them) selects
    what it selects from the lengths alone, on ragged rows; PRRStep.select hands them on."""
    from prr.runtime.prr_step import PRRStep

    hkv, g_, d, bs = 2, 2, 32, 16
    sel = QuestSelector(topk_blocks=3, sink_blocks=1, local_blocks=1)
    assert sel.set_backend("triton") == "triton"
    gen = torch.Generator().manual_seed(4)
    cache = PagedKVCache(1, 2, hkv, d, bs, 200)
    cache.append(0, torch.randn(2, hkv, 150, d, generator=gen), torch.randn(2, hkv, 150, d, generator=gen))
    sel.update_metadata(cache, 0, 0, 150)
    q = torch.randn(2, hkv, g_, d, generator=gen)
    lengths = torch.tensor([150, 71], dtype=torch.int32)
    derived = sel.select(q, cache, 0, lengths)
    given = sel.select(q, cache, 0, lengths, num_blocks=(lengths + bs - 1).div(bs, rounding_mode="floor"))
    assert torch.equal(given.blocks.indices, derived.blocks.indices) and torch.equal(given.blocks.count, derived.blocks.count)
    assert torch.equal(given.scores, derived.scores)
    # the counts handed in are the ones used (nothing re-derived from the lengths): blocks below
    # them only, their newest block forced
    fewer = torch.tensor([6, 2], dtype=torch.int32)
    short = sel.select(q, cache, 0, lengths, num_blocks=fewer)
    assert short.blocks.count.tolist() == [[3, 3], [2, 2]]
    assert (short.blocks.indices[0] < 6).all() and (short.blocks.indices[0] == 5).any(-1).all()
    assert short.blocks.indices[1, :, :2].tolist() == [[0, 1], [0, 1]]
    dense = DenseSelector()
    assert dense.select(q, cache, 0, lengths, num_blocks=fewer).blocks.count.tolist() == [[6, 6], [2, 2]]
    assert dense.select(q, cache, 0, lengths).blocks.count.tolist() == [[10, 10], [5, 5]]

    seen = {}

    class Recording:
        def select(self, q, cache, layer, length, num_blocks=None):
            seen.update(length=length, num_blocks=num_blocks)

    engine = PRRStep.__new__(PRRStep)  # only select's delegation is exercised
    engine.selector, engine.cache, engine.group = Recording(), cache, g_
    nb = torch.tensor([10, 5], dtype=torch.int32)
    engine.select(0, q.view(2, hkv * g_, d), lengths, nb)
    assert seen["length"] is lengths and seen["num_blocks"] is nb
