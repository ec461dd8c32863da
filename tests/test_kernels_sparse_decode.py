"""Triton sparse decode attention and partial-state merge vs float64 torch references.

CPU: the Triton interpreter (conftest sets TRITON_INTERPRET=1), fp32 and fp16, small odd
sizes. GPU (`-m gpu`, needs CUDA and TRITON_INTERPRET=0 so the kernels are compiled):
bf16 at Llama-8B shapes, and a timing table printed with `-s` (never asserted on).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from prr.kernels import reference_sparse_decode as ref
from prr.kernels import sparse_decode as sd

from prr.block_attention import attend_blocks, block_partials
from prr.blocks import BlockSet
from prr.cache import PagedKVCache

BOUNDS = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
FAST = settings(max_examples=6, deadline=None, derandomize=True)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, bound: float, what: str) -> None:
    assert actual.dtype == torch.float32, f"{what}: dtype {actual.dtype}, want fp32"
    assert actual.shape == expected.shape, f"{what}: shape {list(actual.shape)} vs {list(expected.shape)}"
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    err = ref.relative_error(actual, expected)
    assert err <= bound, f"{what}: relative error {err:.3g} > {bound:g}"


def check_sparse_decode(inputs: ref.SparseDecodeInputs, dtype: torch.dtype, **kwargs) -> None:
    bound = BOUNDS[dtype]
    for per_block in (False, True):
        out, lse = sd.sparse_decode(*inputs.args(), per_block=per_block, **kwargs)
        ref_out, ref_lse = ref.sparse_decode_reference(*inputs.args(), per_block=per_block)
        assert_close(out, ref_out, bound, f"out (per_block={per_block})")
        assert_close(lse, ref_lse, bound, f"lse (per_block={per_block})")


# lengths (ragged batch), Hq, Hkv, D, block_size, topk_blocks, capacity, dtype, extra kwargs
CASES = [
    pytest.param([27], 1, 1, 64, 16, 8, None, torch.float32, {}, id="27tok-topk>=blocks-G1"),
    pytest.param([61, 27], 3, 1, 64, 16, 3, 5, torch.float16, {"tokens_per_split": 32}, id="ragged-pad-G3-fp16"),
    pytest.param([113, 61], 8, 2, 128, 32, 3, 4, torch.float32, {"tokens_per_split": 32}, id="113-bs32-G4-D128"),
    pytest.param([1110, 577], 16, 2, 64, 16, 40, 48, torch.float16, {}, id="1110-G8-default-splits-fp16"),
    pytest.param([1110], 4, 1, 128, 32, 100, None, torch.float32, {"tokens_per_split": 1 << 20},
                 id="1110-all-blocks-one-split"),
    pytest.param([113, 200], 6, 2, 64, 64, 3, 4, torch.float32, {"tile_tokens": 16}, id="bs64-subtiles-G3"),
    pytest.param([61, 113], 4, 1, 128, 16, 5, 7, torch.float16, {"native_dot": False}, id="fp16-fp32-dot"),
    pytest.param([113], 2, 1, 256, 16, 4, 6, torch.float32, {}, id="D256"),
    pytest.param([1110, 577], 6, 2, 64, 16, 40, 48, torch.float32, {"tile_tokens": 32, "tokens_per_split": 64},
                 id="tile32-splits"),  # small grids default to tile 128: keep tile 32 covered
]


@pytest.mark.parametrize("lengths, hq, hkv, d, bs, topk, capacity, dtype, kwargs", CASES)
def test_sparse_decode_matches_reference(lengths, hq, hkv, d, bs, topk, capacity, dtype, kwargs):
    inputs = ref.random_sparse_decode_inputs(
        len(lengths) * 100 + hq, lengths, hq, hkv, d, bs, topk, capacity, dtype=dtype
    )
    check_sparse_decode(inputs, dtype, **kwargs)


@pytest.mark.parametrize("lengths, hq, hkv, d, bs, topk, capacity, dtype, tokens_per_split", [
    ([1110, 577], 6, 2, 64, 16, 40, 48, torch.float32, 64),  # G3, ragged, 12 splits
    ([113, 61], 8, 2, 128, 32, 3, 5, torch.float16, 32),  # fp16, a padded list
    ([900], 8, 1, 128, 16, 40, 48, torch.float32, 32),  # 24 splits merged in 4 chunks of 8 (G8, D 128)
])
def test_fused_merge_equals_the_merge_launch(lengths, hq, hkv, d, bs, topk, capacity, dtype, tokens_per_split):
    """fuse_merge: the last split of a row merges it in the split kernel; equals the separate
    merge launch and the reference, empty rows included, and leaves its workspace zeroed."""
    inputs = ref.random_sparse_decode_inputs(len(lengths) + hq, lengths, hq, hkv, d, bs, topk, capacity,
                                             dtype=dtype, empty_rows=((0, 1),))
    kw = dict(tokens_per_split=tokens_per_split)
    assert sd.sparse_decode_num_splits(capacity, len(lengths), hkv, bs, "cpu", tokens_per_split=tokens_per_split,
                                       head_dim=d, cache_dtype=dtype) > 1
    want = sd.sparse_decode(*inputs.args(), **kw)
    arrivals = torch.zeros(len(lengths) * hkv, dtype=torch.int32)
    for _ in range(2):  # the workspace is re-armed by each launch
        got = sd.sparse_decode(*inputs.args(), fuse_merge=True, arrivals=arrivals, **kw)
        assert torch.equal(arrivals, torch.zeros_like(arrivals))
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    ref_out, ref_lse = ref.sparse_decode_reference(*inputs.args())
    assert_close(got[0], ref_out, BOUNDS[dtype], "fused out")
    with pytest.raises(ValueError, match="fuse_merge=True"):
        sd.sparse_decode(*inputs.args(), fuse_merge=True, per_block=True)
    group = hq // hkv  # row 0's KV head 1 has an empty list: its query heads get lse = -inf, out = 0
    assert torch.isneginf(got[1][0, group:2 * group]).all() and (got[0][0, group:2 * group] == 0).all()


def test_fused_merge_refuses_more_splits_than_its_unrolled_tail_takes():
    q, cache = torch.zeros(1, 2, 64), torch.zeros(1, 1, 300 * 16, 64)
    ids, counts = torch.arange(300, dtype=torch.int32).view(1, 1, 300), torch.full((1, 1), 300, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"merges 300 splits .* raise tokens_per_split \(now 16\)"):
        sd.sparse_decode(q, cache, cache, ids, counts, torch.tensor([4800]), 16, 0.125, fuse_merge=True, tile_tokens=16,
                         tokens_per_split=16)


def test_int64_ids_and_empty_rows():
    inputs = ref.random_sparse_decode_inputs(
        7, [113, 61], 4, 2, 64, 16, 4, capacity=6, ids_dtype=torch.int64, empty_rows=((0, 1), (1, 0))
    )
    check_sparse_decode(inputs, torch.float32, tokens_per_split=32)
    out, lse = sd.sparse_decode(*inputs.args())
    assert torch.isneginf(lse[0, 2:4]).all() and torch.isneginf(lse[1, 0:2]).all()
    assert (out[0, 2:4] == 0).all() and (out[1, 0:2] == 0).all()


def test_empty_capacity():
    """C = 0 (BlockSet.empty): lse = -inf, out = 0; per_block gives empty tensors."""
    inputs = ref.random_sparse_decode_inputs(3, [27, 61], 3, 1, 64, 16, 0, dtype=torch.float16)
    assert inputs.block_ids.shape[-1] == 0
    out, lse = sd.sparse_decode(*inputs.args())
    assert out.shape == (2, 3, 64) and lse.shape == (2, 3)
    assert torch.isneginf(lse).all() and (out == 0).all()
    out, lse = sd.sparse_decode(*inputs.args(), per_block=True)
    assert out.shape == (2, 3, 0, 64) and lse.shape == (2, 3, 0)


def test_counts_beyond_capacity_are_clamped():
    inputs = ref.random_sparse_decode_inputs(5, [113], 2, 1, 64, 16, 4)
    big = ref.SparseDecodeInputs(**{**vars(inputs), "block_counts": inputs.block_counts + 100})
    check_sparse_decode(big, torch.float32)  # the reference clamps by construction: valid = position < count


def test_reference_agrees_with_prr_block_attention():
    """Our reference (ragged lengths, kernel layout) equals prr.block_attention at a uniform length."""
    length, bs, hkv, g, d = 113, 16, 2, 3, 64
    inputs = ref.random_sparse_decode_inputs(11, [length, length], hkv * g, hkv, d, bs, 5, capacity=7)
    cache = PagedKVCache(1, 2, hkv, d, bs, length)
    cache.keys[0].copy_(inputs.k_cache)
    cache.values[0].copy_(inputs.v_cache)
    blocks = BlockSet(indices=inputs.block_ids.long(), count=inputs.block_counts.long())
    qg = inputs.q.view(2, hkv, g, d)
    whole = attend_blocks(qg, cache, 0, blocks, length, inputs.scale)
    parts = block_partials(qg, cache, 0, blocks, length, inputs.scale)
    out, lse = ref.sparse_decode_reference(*inputs.args())
    assert ref.relative_error(out, whole.out.reshape(2, hkv * g, d)) < 1e-6
    assert ref.relative_error(lse, whole.lse.reshape(2, hkv * g)) < 1e-6
    out, lse = ref.sparse_decode_reference(*inputs.args(), per_block=True)
    assert ref.relative_error(out, parts.out.reshape(2, hkv * g, 7, d)) < 1e-6
    assert ref.relative_error(lse, parts.lse.reshape(2, hkv * g, 7)) < 1e-6


# ---------------------------------------------------------------------------- merge


@pytest.mark.parametrize("lead, n, d", [((2, 3), 37, 64), ((5,), 300, 48), ((1, 4), 1, 128)])
@pytest.mark.parametrize("with_keep", [False, True])
def test_merge_matches_reference(lead, n, d, with_keep):
    out, lse, keep = ref.random_partials(n * d, lead, n, d)
    keep = keep if with_keep else None
    merged_out, merged_lse = sd.merge_partials(out, lse, keep)
    ref_out, ref_lse = ref.merge_partials_reference(out, lse, keep)
    assert_close(merged_out, ref_out, 1e-5, "merged out")
    assert_close(merged_lse, ref_lse, 1e-5, "merged lse")


def test_merge_drops_exactly_and_never_nan():
    out, lse, keep = ref.random_partials(1, (3,), 9, 64)
    keep[0] = False  # all dropped
    lse[1] = float("-inf")  # all empty
    out[2, ~keep[2]] = float("nan")  # garbage in dropped partials must not leak
    merged_out, merged_lse = sd.merge_partials(out, lse, keep)
    assert not torch.isnan(merged_out).any()
    assert torch.isneginf(merged_lse[:2]).all() and (merged_out[:2] == 0).all()
    ref_out, ref_lse = ref.merge_partials_reference(out[2:, keep[2]], lse[2:, keep[2]])
    assert_close(merged_out[2:], ref_out, 1e-5, "kept-only out")
    assert_close(merged_lse[2:], ref_lse, 1e-5, "kept-only lse")
    empty_out, empty_lse = sd.merge_partials(out[:, :0], lse[:, :0])
    assert torch.isneginf(empty_lse).all() and (empty_out == 0).all() and empty_out.shape == (3, 64)


@FAST
@given(seed=st.integers(0, 2**16), n=st.integers(2, 40), groups=st.integers(1, 5))
def test_merge_is_commutative_and_associative(seed, n, groups):
    out, lse, _ = ref.random_partials(seed, (3,), n, 64)
    whole_out, whole_lse = sd.merge_partials(out, lse)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g)
    perm_out, perm_lse = sd.merge_partials(out[:, perm], lse[:, perm])
    assert_close(perm_out, whole_out.double(), 1e-6, "permuted out")
    assert_close(perm_lse, whole_lse.double(), 1e-6, "permuted lse")
    # Merge contiguous groups of the permuted partials, then merge the group states.
    cuts = sorted(torch.randperm(n - 1, generator=g)[: groups - 1].add(1).tolist())
    bounds = [0, *cuts, n]
    states = [sd.merge_partials(out[:, perm[a:b]], lse[:, perm[a:b]]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    nested_out, nested_lse = sd.merge_partials(
        torch.stack([s[0] for s in states], 1), torch.stack([s[1] for s in states], 1)
    )
    assert_close(nested_out, whole_out.double(), 1e-6, "nested out")
    assert_close(nested_lse, whole_lse.double(), 1e-6, "nested lse")


# ------------------------------------------------------------------- properties


def sublist(inputs: ref.SparseDecodeInputs, member: torch.Tensor) -> ref.SparseDecodeInputs:
    """The inputs restricted to the valid entries where member [B, Hkv, C] is True (same capacity)."""
    capacity = inputs.block_ids.shape[-1]
    valid = torch.arange(capacity) < inputs.block_counts.unsqueeze(-1)
    chosen = member & valid
    order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True)  # chosen first
    ids = torch.gather(inputs.block_ids, -1, order)
    return ref.SparseDecodeInputs(**{**vars(inputs), "block_ids": ids, "block_counts": chosen.sum(-1)})


@FAST
@given(seed=st.integers(0, 2**16), parts=st.integers(1, 4), group=st.sampled_from([1, 3, 4]))
def test_split_block_set_then_merge_equals_whole(seed, parts, group):
    inputs = ref.random_sparse_decode_inputs(seed, [113, 90], group * 2, 2, 64, 16, 6, capacity=8)
    whole_out, whole_lse = sd.sparse_decode(*inputs.args())
    g = torch.Generator().manual_seed(seed)
    part_of = torch.randint(parts, inputs.block_ids.shape, generator=g)
    states = [sd.sparse_decode(*sublist(inputs, part_of == p).args(), tokens_per_split=32) for p in range(parts)]
    merged_out, merged_lse = sd.merge_partials(
        torch.stack([s[0] for s in states], 2), torch.stack([s[1] for s in states], 2)
    )
    assert_close(merged_out, whole_out.double(), 1e-5, "merged parts out")
    assert_close(merged_lse, whole_lse.double(), 1e-5, "merged parts lse")


@FAST
@given(seed=st.integers(0, 2**16), group=st.sampled_from([1, 3, 8]))
def test_keep_masked_per_block_merge_equals_kept_blocks(seed, group):
    """Exact-mode PRR: per-block partials of P merged under keep = P ∩ A equal attending P ∩ A."""
    inputs = ref.random_sparse_decode_inputs(seed, [61, 113], group, 1, 64, 16, 6, capacity=7)
    g = torch.Generator().manual_seed(seed)
    kept = torch.rand(inputs.block_ids.shape, generator=g) < 0.5  # [B, Hkv, C]
    out, lse = sd.sparse_decode(*inputs.args(), per_block=True)  # [B, Hq, C, (D)]
    keep = kept.repeat_interleave(group, dim=1)  # per query head
    merged_out, merged_lse = sd.merge_partials(out, lse, keep)
    direct_out, direct_lse = sd.sparse_decode(*sublist(inputs, kept).args())
    ref_out, ref_lse = ref.sparse_decode_reference(*sublist(inputs, kept).args())
    assert_close(merged_out, ref_out, 1e-5, "kept merge out")
    assert_close(merged_lse, ref_lse, 1e-5, "kept merge lse")
    assert_close(direct_out, ref_out, 1e-5, "kept direct out")
    assert_close(direct_lse, ref_lse, 1e-5, "kept direct lse")


# ---------------------------------------------------------------------- checks


def test_input_checks_name_the_problem():
    inputs = ref.random_sparse_decode_inputs(0, [61], 4, 2, 64, 16, 2)
    args = list(inputs.args())

    def call(**changes):
        a = dict(zip(["q", "k", "v", "ids", "counts", "lengths", "bs", "scale"], args, strict=True))
        a.update(changes)
        return sd.sparse_decode(*a.values())

    odd = torch.zeros(1, 4, 96)
    with pytest.raises(ValueError, match=r"head_dim D=96 is not supported.*\(64, 128, 256\)"):
        call(q=odd, k=torch.zeros(1, 2, 64, 96), v=torch.zeros(1, 2, 64, 96))
    with pytest.raises(ValueError, match="block_size=8 must be a power of two >= 16"):
        call(bs=8)
    with pytest.raises(ValueError, match="block_size=48"):
        call(bs=48)
    with pytest.raises(ValueError, match="Hq=3 must be a positive multiple of Hkv=2"):
        call(q=torch.zeros(1, 3, 64))
    with pytest.raises(ValueError, match="block_ids must have dtype"):
        call(ids=inputs.block_ids.float())
    with pytest.raises(ValueError, match="lengths must have shape"):
        call(lengths=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="k_cache and v_cache must share a dtype"):
        call(v=inputs.v_cache.half())
    with pytest.raises(TypeError, match="scale must be a Python number"):
        call(scale=torch.tensor(0.1))
    with pytest.raises(ValueError, match="out must be"):
        sd.merge_partials(torch.zeros(2, 3, 4), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="keep must be a bool"):
        sd.merge_partials(torch.zeros(2, 3, 4), torch.zeros(2, 3), torch.ones(2, 3))


@pytest.mark.parametrize("out_dtype", [pytest.param(torch.float16, marks=pytest.mark.slow), torch.bfloat16])  # (fp16: make test-full)
@pytest.mark.parametrize("kw", [{"tokens_per_split": 1 << 20}, {"tokens_per_split": 64},
                                {"tokens_per_split": 64, "fuse_merge": True}], ids=["one-split", "merge", "fused"])
def test_out_dtype_is_the_fp32_output_rounded(out_dtype, kw):
    """out_dtype rounds the merged output once (single split, merge launch, fused merge); lse stays fp32."""
    inputs = ref.random_sparse_decode_inputs(11, [1110, 577], 6, 2, 64, 16, 40, 48, dtype=torch.float32)
    want_out, want_lse = sd.sparse_decode(*inputs.args(), **kw)
    out, lse = sd.sparse_decode(*inputs.args(), out_dtype=out_dtype, **kw)
    assert out.dtype == out_dtype and lse.dtype == torch.float32
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    ulp = torch.finfo(out_dtype).eps  # one rounding: within half an ulp of the fp32 value (an ulp: any rounding mode)
    assert ((out.float() - want_out).abs() <= ulp * want_out.abs() + 1e-30).all()
    merged, _ = sd.merge_partials(*sd.sparse_decode(*inputs.args(), merge_splits=False, tokens_per_split=64),
                                  out_dtype=out_dtype)
    assert merged.dtype == out_dtype and ((merged.float() - want_out).abs() <= ulp * want_out.abs() + 1e-30).all()
    with pytest.raises(ValueError, match="merged output only"):
        sd.sparse_decode(*inputs.args(), per_block=True, out_dtype=out_dtype)


def test_split_plan_takes_wide_tiles_only_for_one_program_per_sm():
    """Default tile: 128 tokens for a 16-bit cache when the default plan's rows x splits fit the
    SMs once (batch 1, 2K budget), else 32 (fp32 tiles of 128 overflow shared memory); an
    explicit tile or split size is kept; the split count matches what sparse_decode launches."""
    cpu = torch.device("cpu")
    assert sd._split_plan(128, 8, 16, 128, 2, None, None, cpu)[0] == 128  # b1, 2K tokens in blocks of 16
    assert sd._split_plan(32, 8, 64, 128, 2, None, None, cpu)[0] == 128  # b1, 2K tokens in blocks of 64
    assert sd._split_plan(128, 8, 16, 128, 4, None, None, cpu)[0] == 32  # fp32 cache
    assert sd._split_plan(512, 8, 16, 128, 2, None, None, cpu)[0] == 32  # b1, 8K: 512 programs
    assert sd._split_plan(128, 64, 16, 128, 2, None, None, cpu)[0] == 32  # b8, 2K
    assert sd._split_plan(128, 8, 16, 256, 2, None, None, cpu)[0] == 32  # D 256: not measured, kept at 32
    assert sd._split_plan(128, 8, 16, 128, 2, 64, None, cpu)[0] == 64
    assert sd._split_plan(128, 8, 16, 128, 2, None, 64, cpu)[0] == 32  # a split size asked for: not rounded up
    for dtype in (torch.float16, torch.float32):
        for capacity, tokens_per_split in ((48, None), (48, 64), (48, 200), (7, None)):
            tile, entries, splits = sd._split_plan(capacity, 4, 16, 64, 2 if dtype == torch.float16 else 4, None,
                                                   tokens_per_split, cpu)
            assert tile == (128 if dtype == torch.float16 and tokens_per_split is None else 32)
            inputs = ref.random_sparse_decode_inputs(5, [1110, 577], 4, 2, 64, 16, min(capacity, 40), capacity,
                                                     dtype=dtype)
            out, _ = sd.sparse_decode(*inputs.args(), merge_splits=False, tokens_per_split=tokens_per_split)
            assert out.shape[2] == splits == sd.sparse_decode_num_splits(
                capacity, 2, 2, 16, "cpu", tokens_per_split=tokens_per_split, head_dim=64, cache_dtype=dtype)


def test_split_plan_depends_only_on_static_shapes():
    # Llama-8B at batch 1, 8K-token budget in blocks of 16: enough programs for 132 SMs.
    splits = sd.sparse_decode_num_splits(512, 1, 8, 16, device="cpu", head_dim=128, cache_dtype=torch.bfloat16)
    assert splits * 8 >= 2 * sd.DEFAULT_NUM_SMS
    assert sd.sparse_decode_num_splits(0, 1, 8, 16, device="cpu", head_dim=128, cache_dtype=torch.bfloat16) == 1


def test_per_block_programs_fill_at_most_one_wave_of_whole_entries():
    """per_block's default grid: never more than PROGRAMS_PER_SM programs per SM when the rows
    allow it (no partial second wave), at least MIN_ENTRIES_PER_BLOCK_PROGRAM entries per program;
    tokens_per_program is taken as whole blocks."""
    sms = sd.DEFAULT_NUM_SMS
    for capacity in (1, 7, 32, 128, 129, 512, 2048):
        for rows in (1, 8, 13, 64, 200):
            entries = sd.per_block_entries(capacity, rows, 64, "cpu")
            programs = -(-capacity // entries) * rows
            assert entries >= sd.MIN_ENTRIES_PER_BLOCK_PROGRAM
            assert programs <= max(rows, sd.PROGRAMS_PER_SM * sms), (capacity, rows, entries)
    assert sd.per_block_entries(128, 64, 64, "cpu") == 16  # batch 8, 8K tokens of 64: 512 programs, not 576
    assert sd.per_block_entries(128, 8, 64, "cpu") == 4  # batch 1: 256 tokens per program
    assert sd.per_block_entries(128, 8, 64, "cpu", tokens_per_program=100) == 2
    assert sd.per_block_entries(128, 8, 64, "cpu", tokens_per_program=1) == 1


# ------------------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
compiled = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="TRITON_INTERPRET=1 (conftest default): run with TRITON_INTERPRET=0 to compile the kernels",
)


@pytest.mark.gpu
@needs_cuda
@compiled
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("budget, lengths", [(2048, [32768]), (8192, [32768, 30001])])
@pytest.mark.parametrize("native_dot", [None, False])
def test_gpu_llama8b_bf16(bs, budget, lengths, native_dot):
    inputs = ref.random_sparse_decode_inputs(
        bs + budget, lengths, 32, 8, 128, bs, budget // bs, capacity=budget // bs + 3,
        dtype=torch.bfloat16, device="cuda", empty_rows=((0, 7),),
    )  # fmt: skip
    for per_block in (False, True):
        out, lse = sd.sparse_decode(*inputs.args(), per_block=per_block, native_dot=native_dot)
        ref_out, ref_lse = ref.sparse_decode_reference(*inputs.args(), per_block=per_block)
        err_out, err_lse = ref.relative_error(out, ref_out), ref.relative_error(lse, ref_lse)
        print(f"bs={bs} budget={budget} B={len(lengths)} native={native_dot} per_block={per_block}: "
              f"out {err_out:.2e} lse {err_lse:.2e}")  # fmt: skip
        assert err_out <= 1e-2 and err_lse <= 1e-3
    merged = sd.merge_partials(*sd.sparse_decode(*inputs.args(), per_block=True))
    whole = sd.sparse_decode(*inputs.args())
    assert ref.relative_error(merged[0], whole[0].double()) <= 1e-5
    fused = sd.sparse_decode(*inputs.args(), fuse_merge=True)  # as `whole`, merged in the split kernel
    assert ref.relative_error(fused[0], whole[0].double()) <= 1e-5 and torch.equal(fused[1].isinf(), whole[1].isinf())
    finite = whole[1].isfinite()
    assert ref.relative_error(fused[1][finite], whole[1][finite].double()) <= 1e-6


@pytest.mark.gpu
@needs_cuda
@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_batch1_default_plan_launches_at_head_dim_128(dtype):
    """Batch 1, 2K budget, D = 128: the plan whose 16-bit tile is 128 tokens; fp32 must keep a
    tile that fits shared memory (it launches) and both match the reference."""
    inputs = ref.random_sparse_decode_inputs(3, [32768], 32, 8, 128, 16, 128, capacity=128, dtype=dtype, device="cuda")
    out, lse = sd.sparse_decode(*inputs.args(), out_dtype=torch.bfloat16)
    ref_out, ref_lse = ref.sparse_decode_reference(*inputs.args())
    assert out.dtype == torch.bfloat16
    assert ref.relative_error(out.float(), ref_out) <= 1e-2 and ref.relative_error(lse, ref_lse) <= 1e-3


def _graph_time_us(fn, calls: int = 20, replays: int = 20) -> float:
    """Median µs per call of `fn(i)` (i = 0..calls-1) captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


GPU_VARIANTS_BS16 = {
    "default": {},
    "fp32-dot(tf32)": {"native_dot": False},
    "pv-bf16 (no hi/lo)": {"precise_pv": False},
    "split128": {"tokens_per_split": 128},
    "split256": {"tokens_per_split": 256},
    "split512": {"tokens_per_split": 512},
    "stages2": {"num_stages": 2},
    "stages4": {"num_stages": 4},
    "warps8": {"num_warps": 8},
    "tile64": {"tile_tokens": 64},
    "tile128": {"tile_tokens": 128},
    "default (again: noise)": {},
}


def _print_row(name: str, us: float, bench: float, gbs: float, ratio: float) -> None:
    print(f"{name:60s} {us:9.2f} {bench:11.2f} {gbs:7.0f} {ratio:7.2f}", flush=True)


def _time_block_size(bs: int, context: int, budget: int, hq: int, hkv: int, d: int) -> None:
    """Prints rows (name, graph µs, do_bench µs, GB/s, floor/time) for one block size."""
    import triton

    base = ref.random_sparse_decode_inputs(
        bs, [context], hq, hkv, d, bs, budget // bs, dtype=torch.bfloat16, device="cuda", garbage=1.0
    )
    g = torch.Generator(device="cuda").manual_seed(bs)
    id_sets = [  # rotate block lists so consecutive calls miss L2 (cache 512 MB, one list 33.5 MB)
        torch.randperm(context // bs, generator=g, device="cuda")[: budget // bs]
        .view(1, 1, -1).repeat(1, hkv, 1).to(torch.int32).contiguous()
        for _ in range(10)
    ]  # fmt: skip
    nbytes = budget * hkv * d * 2 * 2  # K and V, bf16
    floor_us = nbytes / 4.3e12 * 1e6
    variants = GPU_VARIANTS_BS16 if bs == 16 else {k: GPU_VARIANTS_BS16[k] for k in ("default", "fp32-dot(tf32)")}
    for name, kw in variants.items():
        for per_block in (False, True) if name in ("default", "fp32-dot(tf32)") else (False,):

            def fn(i, kw=kw, per_block=per_block):
                return sd.sparse_decode(base.q, base.k_cache, base.v_cache, id_sets[i % 10], base.block_counts,
                                        base.lengths, bs, base.scale, per_block=per_block, **kw)  # fmt: skip

            label = f"bs{bs} {name}{' per_block' if per_block else ''}"
            try:
                us = _graph_time_us(fn)
                bench = triton.testing.do_bench(lambda fn=fn: fn(0), return_mode="median") * 1000
                _print_row(label, us, bench, nbytes / us / 1e3, floor_us / us)
            except Exception as e:  # a report, not a check: keep timing the other variants
                print(f"{label} FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
    # Baselines in the same run: the same bytes read contiguously by SDPA; eager gather + SDPA.
    q4 = base.q.view(1, hq, 1, d)
    k_contig = base.k_cache[:, :, :budget].contiguous()
    v_contig = base.v_cache[:, :, :budget].contiguous()
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def gather_sdpa(i):
        tok = (id_sets[i % 10].long().unsqueeze(-1) * bs + torch.arange(bs, device="cuda")).view(1, hkv, -1, 1)
        k = torch.gather(base.k_cache, 2, tok.expand(-1, -1, -1, d))
        v = torch.gather(base.v_cache, 2, tok.expand(-1, -1, -1, d))
        return sdpa(q4, k, v, enable_gqa=True)

    baselines = {
        f"bs{bs} SDPA contiguous {budget} tokens (same bytes)": lambda i: sdpa(q4, k_contig, v_contig, enable_gqa=True),
        f"bs{bs} eager gather+SDPA": gather_sdpa,
    }
    for label, fn in baselines.items():
        try:
            us = _graph_time_us(fn)
            _print_row(label, us, math.nan, nbytes / us / 1e3, floor_us / us)
        except Exception as e:
            print(f"{label} FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)


@pytest.mark.gpu
@needs_cuda
@compiled
def test_gpu_timing_report():
    """Prints µs and GB/s at 128K context / 8K-token budget (Llama-8B heads, bf16). Never asserts on time."""
    import triton

    context, budget, hkv, hq, d = 131072, 8192, 8, 32, 128
    splits = sd.sparse_decode_num_splits(budget // 16, 1, hkv, 16, device="cuda", head_dim=d, cache_dtype=torch.bfloat16)
    print(f"\n{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; "
          f"{context} context, {budget}-token budget, default splits at bs16: {splits}")  # fmt: skip
    print(f"{'variant':60s} {'graph µs':>9s} {'do_bench µs':>11s} {'GB/s':>7s} {'floor/t':>7s}", flush=True)
    for bs in (16, 64):
        _time_block_size(bs, context, budget, hq, hkv, d)
        torch.cuda.empty_cache()
    for n in (64, 512):
        out, lse, keep = ref.random_partials(n, (1, hq), n, d, device="cuda")
        for name, k in (("", None), (" keep", keep)):
            us = _graph_time_us(lambda i, out=out, lse=lse, k=k: sd.merge_partials(out, lse, k))
            _print_row(f"merge [1,{hq},{n},{d}]{name}", us, math.nan, out.numel() * 4 / us / 1e3, math.nan)
    for kernel in (sd.sparse_decode_split_kernel, sd.sparse_decode_per_block_kernel, sd.merge_partials_kernel):
        try:  # registers and spills of each compiled specialisation (Triton-version dependent: best effort)
            for cache in kernel.device_caches.values():
                for compiled in cache[0].values():
                    meta = compiled.metadata
                    print(f"{kernel.__name__}: regs {compiled.n_regs} spills {compiled.n_spills} "
                          f"warps {meta.num_warps} stages {meta.num_stages} shared {meta.shared}")  # fmt: skip
        except Exception as e:
            print(f"{kernel.__name__}: no compile info ({type(e).__name__}: {e})")
