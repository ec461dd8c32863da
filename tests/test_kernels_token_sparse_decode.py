"""Triton token-list decode attention (kernels/token_sparse_decode.py) vs its float64 torch reference,
and vs the block kernel over the same tokens.

CPU: the Triton interpreter (conftest sets TRITON_INTERPRET=1), fp32 / fp16 / bf16 at small odd
sizes. GPU (`-m gpu`, needs CUDA and TRITON_INTERPRET=0 so the kernels are compiled): bf16 at the
8B shape (Hq 32, Hkv 8, D 128), 2,048 tokens of a 32K context.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from prr.kernels import reference_sparse_decode as block_ref
from prr.kernels import reference_token_sparse_decode as ref
from prr.kernels import sparse_decode as sd
from prr.kernels import token_sparse_decode as tsd
from prr.kernels.reference_merge import lse_merge_many

BOUNDS = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
FAST = settings(max_examples=5, deadline=None, derandomize=True)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, bound: float, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {list(actual.shape)} vs {list(expected.shape)}"
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    err = block_ref.relative_error(actual, expected)
    assert err <= bound, f"{what}: relative error {err:.3g} > {bound:g}"


def check_against_reference(inputs: ref.TokenSparseDecodeInputs, dtype: torch.dtype, **kwargs) -> None:
    out, lse = tsd.token_sparse_decode(*inputs.args(), **kwargs)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    ref_out, ref_lse = ref.token_sparse_decode_reference(*inputs.args())
    assert_close(out, ref_out, BOUNDS[dtype], "out")
    assert_close(lse, ref_lse, BOUNDS[dtype], "lse")


# lengths (ragged batch), Hq, Hkv, D, tokens listed, capacity C, dtype, input options, kernel kwargs
CASES = [
    pytest.param([27], 1, 1, 64, 27, None, torch.float32, {}, {}, id="27tok-all-G1"),
    pytest.param([61, 27], 4, 1, 64, 19, 23, torch.float16, {}, {"tokens_per_split": 16}, id="ragged-pad-G4-fp16"),
    pytest.param([113, 61], 8, 2, 128, 37, 41, torch.bfloat16, {"beyond_length": 3}, {"tokens_per_split": 32},
                 id="beyond-length-G4-D128-bf16"),
    pytest.param([200, 113], 3, 3, 64, 45, 53, torch.float32, {"shared": True, "beyond_length": 2},
                 {"tokens_per_split": 16}, id="shared-G1"),
    pytest.param([300], 8, 2, 128, 129, 131, torch.float32, {}, {}, id="odd-C-default-plan-G4"),
    pytest.param([113, 200], 2, 2, 64, 33, 35, torch.bfloat16, {"shared": True}, {"tile_tokens": 16},
                 id="shared-bf16-tile16-G1"),
    pytest.param([61, 113], 4, 1, 128, 40, 47, torch.float16, {}, {"native_dot": False, "tokens_per_split": 32},
                 id="fp16-fp32-dot"),
    pytest.param([113], 2, 1, 256, 21, 25, torch.float32, {"ids_dtype": torch.int64}, {}, id="D256-int64-ids"),
]


@pytest.mark.parametrize("lengths, hq, hkv, d, topk, capacity, dtype, options, kwargs", CASES)
def test_token_sparse_decode_matches_reference(lengths, hq, hkv, d, topk, capacity, dtype, options, kwargs):
    inputs = ref.random_token_sparse_decode_inputs(len(lengths) * 100 + hq + d, lengths, hq, hkv, d, topk, capacity,
                                                   dtype=dtype, **options)
    check_against_reference(inputs, dtype, **kwargs)


def test_generator_lists_distinct_tokens_and_the_asked_dead_ones():
    """The inputs the tests rely on: distinct listed ids, the newest token listed, `beyond_length`
    ids past the row's length, padding that names live tokens."""
    inputs = ref.random_token_sparse_decode_inputs(3, [61, 27], 4, 2, 64, 19, 23, beyond_length=3)
    for b, length in enumerate((61, 27)):
        for h in range(2):
            count = int(inputs.token_counts[b, h])
            listed = inputs.token_ids[b, h, :count]
            assert count == 19 and len(set(listed.tolist())) == count and (length - 1) in listed.tolist()
            assert int((listed >= length).sum()) == 3
            assert bool((inputs.token_ids[b, h, count:] < length).all())


def test_empty_lists_and_zero_capacity():
    inputs = ref.random_token_sparse_decode_inputs(7, [113, 61], 4, 2, 64, 9, 11, empty_rows=((0, 1), (1, 0)))
    check_against_reference(inputs, torch.float32, tokens_per_split=16)
    out, lse = tsd.token_sparse_decode(*inputs.args())
    assert torch.isneginf(lse[0, 2:4]).all() and torch.isneginf(lse[1, 0:2]).all()
    assert (out[0, 2:4] == 0).all() and (out[1, 0:2] == 0).all()
    assert torch.isfinite(lse[0, 0:2]).all() and torch.isfinite(lse[1, 2:4]).all()
    zero = ref.random_token_sparse_decode_inputs(3, [27, 61], 3, 1, 64, 0, dtype=torch.float16)
    assert zero.token_ids.shape[-1] == 0
    out, lse = tsd.token_sparse_decode(*zero.args())
    assert out.shape == (2, 3, 64) and lse.shape == (2, 3)
    assert torch.isneginf(lse).all() and (out == 0).all()


def test_counts_beyond_capacity_are_clamped():
    inputs = ref.random_token_sparse_decode_inputs(5, [113], 2, 1, 64, 17)
    big = ref.TokenSparseDecodeInputs(**{**vars(inputs), "token_counts": inputs.token_counts + 100})
    check_against_reference(big, torch.float32)


def test_shared_list_equals_the_list_copied_to_every_head():
    """[B, 1, C] (head stride 0), its stride-0 expansion and a real per-head copy: one result."""
    inputs = ref.random_token_sparse_decode_inputs(9, [113, 61], 8, 4, 64, 29, 31, shared=True, beyond_length=1)
    shared = tsd.token_sparse_decode(*inputs.args(), tokens_per_split=16)
    expanded_ids = inputs.token_ids.expand(2, 4, 31)
    expanded_counts = inputs.token_counts.expand(2, 4)
    for ids, counts in ((expanded_ids, expanded_counts), (expanded_ids.contiguous(), expanded_counts.contiguous())):
        args = (inputs.q, inputs.k_cache, inputs.v_cache, ids, counts, inputs.lengths, inputs.scale)
        other = tsd.token_sparse_decode(*args, tokens_per_split=16)
        assert torch.equal(shared[0], other[0]) and torch.equal(shared[1], other[1])
    check_against_reference(inputs, torch.float32, tokens_per_split=16)


@pytest.mark.parametrize("dtype, bs, kwargs", [
    (torch.float32, 16, {"tokens_per_split": 64, "tile_tokens": 32}),
    (torch.float16, 32, {"tokens_per_split": 64, "tile_tokens": 32}),
    (torch.float32, 16, {}),  # both default plans (block size 1 vs 16: the same token splits here)
])
def test_equals_the_block_kernel_over_the_tokens_of_its_blocks(dtype, bs, kwargs):
    """A block list's tokens, listed in block order, walked in the same splits and tiles: the
    token kernel does the block kernel's arithmetic on the same rows (last, partial block included)."""
    inputs = block_ref.random_sparse_decode_inputs(21, [1110, 577], 8, 2, 64, bs, 9, 11, dtype=dtype,
                                                   empty_rows=((1, 1),))
    tokens = ref.token_inputs_of_blocks(inputs)
    block = sd.sparse_decode(*inputs.args(), **kwargs)
    token = tsd.token_sparse_decode(*tokens.args(), **kwargs)
    torch.testing.assert_close(token[0], block[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(token[1], block[1], rtol=1e-6, atol=1e-6)
    ref_out, ref_lse = ref.token_sparse_decode_reference(*tokens.args())
    block_out, block_lse = block_ref.sparse_decode_reference(*inputs.args())
    assert block_ref.relative_error(ref_out, block_out) < 1e-12 and block_ref.relative_error(ref_lse, block_lse) < 1e-12


@pytest.mark.parametrize("lengths, hq, hkv, d, topk, capacity, dtype, shared", [
    ([1110, 577], 6, 2, 64, 150, 161, torch.float32, False),  # G3, ragged, 11 splits
    ([300], 8, 1, 128, 121, 127, torch.float16, True),  # G8, D 128
])
def test_fused_merge_and_unmerged_splits_equal_the_merge_launch(lengths, hq, hkv, d, topk, capacity, dtype, shared):
    """fuse_merge (the row's last split merges) and merge_splits=False + merge_partials give the
    merge launch's state; the fused workspace is left zeroed; out_dtype rounds the merged out once."""
    inputs = ref.random_token_sparse_decode_inputs(len(lengths) + hq, lengths, hq, hkv, d, topk, capacity,
                                                   dtype=dtype, shared=shared, empty_rows=((0, 0),))
    kw = dict(tokens_per_split=16, tile_tokens=16)
    splits = tsd.token_sparse_decode_plan(capacity, len(lengths), hkv, "cpu", **kw, head_dim=d,
                                          cache_dtype=dtype).num_splits
    assert splits == -(-capacity // 16) > 1
    plan = tsd.token_sparse_decode_plan(capacity, len(lengths), hkv, "cpu", tokens_per_split=16, head_dim=d,
                                        cache_dtype=dtype)
    assert plan == (32, 32, -(-capacity // 32))  # split size rounded up to whole tiles of 32
    want = tsd.token_sparse_decode(*inputs.args(), **kw)
    parts = tsd.token_sparse_decode(*inputs.args(), merge_splits=False, **kw)
    assert parts[0].shape == (len(lengths), hq, splits, d) and parts[1].shape == (len(lengths), hq, splits)
    merged = sd.merge_partials(*parts)
    torch.testing.assert_close(merged, want, rtol=0, atol=0)
    arrivals = torch.zeros(len(lengths) * hkv, dtype=torch.int32)
    for _ in range(2):  # the workspace is re-armed by each launch
        got = tsd.token_sparse_decode(*inputs.args(), fuse_merge=True, arrivals=arrivals, **kw)
        assert torch.equal(arrivals, torch.zeros_like(arrivals))
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    rounded, lse = tsd.token_sparse_decode(*inputs.args(), out_dtype=torch.bfloat16, **kw)
    assert rounded.dtype == torch.bfloat16 and torch.equal(lse, want[1])
    ulp = torch.finfo(torch.bfloat16).eps  # one rounding: within an ulp of the fp32 value (any rounding mode)
    assert ((rounded.float() - want[0]).abs() <= ulp * want[0].abs() + 1e-30).all()
    check_against_reference(inputs, dtype, **kw)
    group = hq // hkv  # row 0's first list is empty: lse = -inf, out = 0
    assert torch.isneginf(want[1][0, :group]).all() and (want[0][0, :group] == 0).all()


@FAST
@given(seed=st.integers(0, 2**16), parts=st.integers(1, 4), group=st.sampled_from([1, 4]))
def test_disjoint_token_sets_merge_to_their_union(seed, parts, group):
    """Split each list into random disjoint parts, attend each, ⊕ the states (prr's merge): equals
    attending the whole list (what PRR's merge of speculative and repair states relies on)."""
    inputs = ref.random_token_sparse_decode_inputs(seed, [113, 90], group * 2, 2, 64, 23, 27)
    whole_out, whole_lse = tsd.token_sparse_decode(*inputs.args())
    g = torch.Generator().manual_seed(seed)
    part_of = torch.randint(parts, inputs.token_ids.shape, generator=g)
    valid = torch.arange(27) < inputs.token_counts.unsqueeze(-1)
    states = []
    for p in range(parts):
        chosen = valid & (part_of == p)
        order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True)  # chosen first
        sub = ref.TokenSparseDecodeInputs(**{**vars(inputs), "token_ids": torch.gather(inputs.token_ids, -1, order),
                                             "token_counts": chosen.sum(-1)})
        states.append(tsd.token_sparse_decode(*sub.args(), tokens_per_split=16))
    out = torch.stack([s[0] for s in states], 2)
    lse = torch.stack([s[1] for s in states], 2)
    merged_out, merged_lse = sd.merge_partials(out, lse)
    assert_close(merged_out, whole_out.double(), 1e-5, "merged parts out")
    assert_close(merged_lse, whole_lse.double(), 1e-5, "merged parts lse")
    torch_out, torch_lse = lse_merge_many(out.double(), lse.double())
    assert_close(merged_out, torch_out, 1e-6, "kernel merge vs torch merge")


def test_input_checks_name_the_problem():
    inputs = ref.random_token_sparse_decode_inputs(0, [61], 4, 2, 64, 9)
    names = ["q", "k", "v", "ids", "counts", "lengths", "scale"]

    def call(**changes):
        a = dict(zip(names, inputs.args(), strict=True)) | changes
        return tsd.token_sparse_decode(*a.values())

    with pytest.raises(ValueError, match=r"head_dim D=96 is not supported by token_sparse_decode.*\(64, 128, 256\)"):
        call(q=torch.zeros(1, 4, 96), k=torch.zeros(1, 2, 64, 96), v=torch.zeros(1, 2, 64, 96))
    with pytest.raises(ValueError, match="Hq=3 must be a positive multiple of Hkv=2"):
        call(q=torch.zeros(1, 3, 64))
    with pytest.raises(ValueError, match=r"token_ids has 3 lists per batch row: give one per KV head \(Hkv=2\)"):
        call(ids=torch.zeros(1, 3, 9, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"token_counts must have shape \[1, 1\]"):
        call(ids=inputs.token_ids[:, :1])  # a shared list with per-head counts
    with pytest.raises(ValueError, match="token_ids must be"):
        call(ids=inputs.token_ids[0])
    with pytest.raises(ValueError, match="token_ids must have dtype"):
        call(ids=inputs.token_ids.float())
    with pytest.raises(ValueError, match="lengths must have shape"):
        call(lengths=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError, match="scale must be a Python number"):
        call(scale=torch.tensor(0.1))
    with pytest.raises(ValueError, match="tile_tokens=24 must be a power of two >= 16"):
        tsd.token_sparse_decode(*inputs.args(), tile_tokens=24)
    with pytest.raises(ValueError, match="merged output only"):
        tsd.token_sparse_decode(*inputs.args(), merge_splits=False, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fuse_merge=True merges the splits"):
        tsd.token_sparse_decode(*inputs.args(), merge_splits=False, fuse_merge=True)
    with pytest.raises(ValueError, match="native_dot=True needs q and the cache in one 16-bit dtype"):
        tsd.token_sparse_decode(*inputs.args(), native_dot=True)


def test_split_plan_is_the_block_kernels_at_block_size_1():
    """Same splits as the block kernel for the same number of tokens (static shapes only): at the
    8B shape, batch 1, 2,048 tokens make 16 splits of 128 tokens per KV head, one tile of 128 each
    (128 programs: one per SM)."""
    for capacity, batch in ((2048, 1), (2048, 8), (4096, 32), (256, 1), (0, 1)):
        tokens = tsd.token_sparse_decode_plan(capacity, batch, 8, "cpu", head_dim=128, cache_dtype=torch.bfloat16)
        blocks = sd.sparse_decode_num_splits(capacity // 16, batch, 8, 16, "cpu", head_dim=128,
                                             cache_dtype=torch.bfloat16)
        assert tokens.num_splits == blocks, (capacity, batch)
    assert tsd.token_sparse_decode_plan(2048, 1, 8, "cpu", head_dim=128, cache_dtype=torch.bfloat16) == (128, 128, 16)
    inputs = ref.random_token_sparse_decode_inputs(2, [300, 200], 4, 2, 64, 150, 157, dtype=torch.float16)
    plan = tsd.token_sparse_decode_plan(157, 2, 2, "cpu", head_dim=64, cache_dtype=torch.float16)
    out, _ = tsd.token_sparse_decode(*inputs.args(), merge_splits=False)  # the launch the plan describes
    assert out.shape[2] == plan.num_splits == -(-157 // plan.tokens_per_split)


# ------------------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
compiled = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="TRITON_INTERPRET=1 (conftest default): run with TRITON_INTERPRET=0 to compile the kernels",
)


@pytest.mark.gpu
@needs_cuda
@compiled
@pytest.mark.parametrize("lengths", [[32768], [32768, 30001, 4097, 20000]])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("native_dot", [None, False])
def test_gpu_8b_shape_bf16(lengths, shared, native_dot):
    inputs = ref.random_token_sparse_decode_inputs(len(lengths) + shared, lengths, 32, 8, 128, 2048, 2051,
                                                   dtype=torch.bfloat16, device="cuda", shared=shared,
                                                   beyond_length=5, empty_rows=((0, 0),) if shared else ((0, 7),))
    ref_out, ref_lse = ref.token_sparse_decode_reference(*inputs.args())
    for kw in ({}, {"fuse_merge": True}, {"tokens_per_split": 512, "tile_tokens": 64}):
        out, lse = tsd.token_sparse_decode(*inputs.args(), native_dot=native_dot, **kw)
        err_out, err_lse = block_ref.relative_error(out, ref_out), block_ref.relative_error(lse, ref_lse)
        print(f"B={len(lengths)} shared={shared} native={native_dot} {kw}: out {err_out:.2e} lse {err_lse:.2e}")
        assert err_out <= 1e-2 and err_lse <= 1e-3


@pytest.mark.gpu
@needs_cuda
@compiled
def test_gpu_equals_the_block_kernel_and_replays_in_a_cuda_graph():
    """The tokens of 128 blocks of 16 (2,048 tokens) at the 8B shape: the token kernel matches
    the block kernel; captured in a CUDA graph (no host sync), a replay gives the eager result."""
    inputs = block_ref.random_sparse_decode_inputs(5, [32768, 30001], 32, 8, 128, 16, 128, 131,
                                                   dtype=torch.bfloat16, device="cuda")
    tokens = ref.token_inputs_of_blocks(inputs)
    block = sd.sparse_decode(*inputs.args())
    eager = tsd.token_sparse_decode(*tokens.args(), out_dtype=torch.bfloat16)
    assert block_ref.relative_error(eager[0].float(), block[0].double()) <= 1e-2
    assert block_ref.relative_error(eager[1], block[1].double()) <= 1e-5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tsd.token_sparse_decode(*tokens.args(), out_dtype=torch.bfloat16)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = tsd.token_sparse_decode(*tokens.args(), out_dtype=torch.bfloat16)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
