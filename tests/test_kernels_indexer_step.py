"""A decode step's indexer inputs in one launch (prr.kernels.indexer_step): from one projection
x [W_q; W_k; W_w]ᵀ per row, the query heads RoPE'd, the head weights, and the index key
LayerNorm'd, RoPE'd and appended (bf16 or fp8), against the fp32 torch reference
(reference_indexer.indexer_step_reference) at odd sizes (H_I = 5, d_I = 16, rope_dim 0 / 6 / 16,
rows at different positions, some far), under the interpreter; the 8B shape on a GPU (marked gpu)."""

from __future__ import annotations

import os

import pytest
import torch
from prr.kernels.indexer_step import indexer_step_inputs
from prr.kernels.reference_indexer import (
    dequantize_index_keys_reference,
    empty_index_cache,
    index_key_append_reference,
    indexer_step_reference,
)

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="needs a CUDA device and TRITON_INTERPRET=0",
)


def _inputs(batch: int, heads: int, dim: int, rope_dim: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    projection = (torch.randn(batch, heads * dim + dim + heads, generator=g) * 2).to(dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope_dim, 2).float() / max(rope_dim, 1)))  # [rope_dim // 2]
    norm_weight = (1 + 0.3 * torch.randn(dim, generator=g)).to(dtype)
    norm_bias = (0.2 * torch.randn(dim, generator=g)).to(dtype)
    return [t.to(device) for t in (projection, inv_freq, norm_weight, norm_bias)]


def _run(device: str, batch: int, heads: int, dim: int, rope_dim: int, dtype: torch.dtype, index_dtype: str,
         max_tokens: int, positions: list[int], seed: int = 0):
    """Kernel and reference from the same inputs -> (kernel's (query, weights, keys, scales), reference's)."""
    projection, inv_freq, weight, bias = _inputs(batch, heads, dim, rope_dim, dtype, seed)
    pos = torch.tensor(positions, dtype=torch.int32)
    keys, scales = empty_index_cache(batch, max_tokens, dim, index_dtype, device)
    query = torch.full((batch, heads, dim), float("nan"), device=device)
    head_weights = torch.full((batch, heads), float("nan"), device=device)
    indexer_step_inputs(projection.to(device), pos.to(device), inv_freq.to(device), weight.to(device),
                        bias.to(device), 1e-6, rope_dim, query, head_weights, keys, scales)
    q, w, k = indexer_step_reference(projection, pos, inv_freq, weight, bias, 1e-6, heads, dim, rope_dim)
    ref_keys, ref_scales = empty_index_cache(batch, max_tokens, dim, index_dtype)
    index_key_append_reference(ref_keys, ref_scales, k, pos.clamp(0, max_tokens - 1))
    got = (query.cpu(), head_weights.cpu(), keys.cpu(), None if scales is None else scales.cpu())
    return got, (q, w, ref_keys, ref_scales)


def _assert_keys_close(got_keys, got_scales, ref_keys, ref_scales, index_dtype: str, rows) -> None:
    """The stored keys of `rows` (index tuples) equal the reference's up to one step of the stored
    format where the fp32 key sits on a rounding boundary (the kernel's cos / LayerNorm may differ
    from torch's in the last fp32 bit); nearly all are equal."""
    got = dequantize_index_keys_reference(got_keys, got_scales)[rows]
    ref = dequantize_index_keys_reference(ref_keys, ref_scales)[rows]
    if index_dtype == "bf16":
        step = ref.abs() * 2**-7 + 1e-30
    else:
        step = ref_scales[rows].unsqueeze(-1) * 32 + 1e-30  # one e4m3 step at the top of its range, x scale
        torch.testing.assert_close(got_scales[rows], ref_scales[rows], rtol=1e-6, atol=0)
    assert ((got - ref).abs() <= step).all()
    same = got == ref if index_dtype == "bf16" else got_keys[rows].view(torch.uint8) == ref_keys[rows].view(torch.uint8)
    assert same.float().mean() > 0.97  # (fp8: the bytes; a scale one fp32 ulp off moves every dequantized value)


@pytest.mark.parametrize("rope_dim", [0, 6, 16])
@pytest.mark.parametrize("dtype,index_dtype", [(torch.float32, "bf16"), (torch.bfloat16, "bf16"),
                                               (torch.bfloat16, "fp8"), (torch.float16, "fp8")])
def test_step_inputs_equal_reference(rope_dim, dtype, index_dtype):
    batch, heads, dim, max_tokens = 3, 5, 16, 40
    positions = [0, 17, max_tokens - 1]
    (query, weights, keys, scales), (q, w, ref_keys, ref_scales) = _run(
        "cpu", batch, heads, dim, rope_dim, dtype, index_dtype, max_tokens, positions, seed=rope_dim)
    torch.testing.assert_close(query, q, rtol=2e-6, atol=2e-6)
    assert torch.equal(weights, w)  # a cast
    rows = (torch.arange(batch), torch.tensor(positions))
    _assert_keys_close(keys, scales, ref_keys, ref_scales, index_dtype, rows)
    others = torch.ones(batch, max_tokens, dtype=torch.bool)
    others[rows] = False
    assert (keys.float()[others] == 0).all()  # nothing else written


def test_rope_rotates_only_the_leading_dims_and_keeps_norms():
    """Defining properties without the reference: RoPE leaves the dims past rope_dim as projected
    (queries) and keeps each rotated pair's norm; position 0 is no rotation."""
    batch, heads, dim, rope_dim = 2, 3, 16, 6
    projection, inv_freq, weight, bias = _inputs(batch, heads, dim, rope_dim, torch.float32, seed=4)
    keys, _ = empty_index_cache(batch, 8, dim, "bf16")
    query, head_weights = torch.empty(batch, heads, dim), torch.empty(batch, heads)
    indexer_step_inputs(projection, torch.tensor([0, 5]), inv_freq, weight, bias, 1e-6, rope_dim, query,
                        head_weights, keys, None)
    raw = projection[:, : heads * dim].view(batch, heads, dim)
    assert torch.equal(query[:, :, rope_dim:], raw[:, :, rope_dim:])
    torch.testing.assert_close(query[0], raw[0])  # position 0
    half = rope_dim // 2
    pair = lambda t: t[..., :half] ** 2 + t[..., half:rope_dim] ** 2  # noqa: E731
    torch.testing.assert_close(pair(query[1]), pair(raw[1]), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(query[1, :, :rope_dim], raw[1, :, :rope_dim])


def test_far_positions_and_positions_outside_the_cache():
    """A position near 2^17 (large angles) still matches; positions outside [0, T_max) write no key
    but still write the query and head weights."""
    batch, heads, dim, max_tokens = 4, 5, 16, 9
    got, ref = _run("cpu", batch, heads, dim, 16, torch.bfloat16, "fp8", max_tokens, [-1, max_tokens, 131_000, 3])
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], ref[1])  # head weights written for every row
    assert (got[2][:2].float() == 0).all() and (got[3][:2] == 0).all()  # rows 0, 1: outside
    assert (got[2][2].float() == 0).all()  # row 2: 131_000 is outside too
    _assert_keys_close(got[2], got[3], ref[2], ref[3], "fp8", (torch.tensor([3]), torch.tensor([3])))  # row 3: inside


def test_key_layer_norm_adds_eps_to_the_variance():
    """A key projection of variance ~1e-6, eps 1e-6: the key differs from eps-less LayerNorm by ~1/sqrt(2),
    so the comparison with the reference sees eps (the other tests' keys have variance ~4)."""
    batch, heads, dim, rope_dim = 2, 3, 16, 6
    projection, inv_freq, weight, bias = _inputs(batch, heads, dim, rope_dim, torch.float32, seed=5)
    projection[:, heads * dim : heads * dim + dim] *= 5e-4  # (randn * 2 * 5e-4: std 1e-3)
    pos = torch.tensor([2, 7])
    keys, _ = empty_index_cache(batch, 8, dim, "bf16")
    query, head_weights = torch.empty(batch, heads, dim), torch.empty(batch, heads)
    indexer_step_inputs(projection, pos, inv_freq, weight, bias, 1e-6, rope_dim, query, head_weights, keys, None)
    _, _, k = indexer_step_reference(projection, pos, inv_freq, weight, bias, 1e-6, heads, dim, rope_dim)
    _, _, no_eps = indexer_step_reference(projection, pos, inv_freq, weight, bias, 0.0, heads, dim, rope_dim)
    got = keys[torch.arange(batch), pos].float()
    assert ((got - k).abs() <= k.abs() * 2**-7 + 1e-30).all()
    assert ((got - no_eps).abs() > no_eps.abs() * 2**-5).any()


def test_rejects_bad_input():
    projection, inv_freq, weight, bias = _inputs(2, 5, 16, 6, torch.bfloat16, seed=1)
    keys, _ = empty_index_cache(2, 8, 16, "bf16")
    query, head_weights = torch.empty(2, 5, 16), torch.empty(2, 5)
    pos = torch.tensor([1, 2])
    args = (pos, inv_freq, weight, bias, 1e-6, 6, query, head_weights, keys, None)
    with pytest.raises(ValueError, match=r"projection must be \[B, H_I\*d_I \+ d_I \+ H_I\]=\[2, 101\]"):
        indexer_step_inputs(projection[:, :-1], *args)
    with pytest.raises(ValueError, match="rope_dim=5 must be even"):
        indexer_step_inputs(projection, pos, inv_freq, weight, bias, 1e-6, 5, query, head_weights, keys, None)
    with pytest.raises(ValueError, match="query must be fp32"):
        indexer_step_inputs(projection, pos, inv_freq, weight, bias, 1e-6, 6, query.bfloat16(), head_weights, keys,
                            None)
    with pytest.raises(ValueError, match=r"inv_freq must be fp32 \[rope_dim // 2\]=\[3\]"):
        indexer_step_inputs(projection, pos, inv_freq[:2], weight, bias, 1e-6, 6, query, head_weights, keys, None)
    with pytest.raises(ValueError, match="query and head_weights must have unit stride"):
        indexer_step_inputs(projection, pos, inv_freq, weight, bias, 1e-6, 6, query, torch.empty(5, 2).t(), keys, None)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("index_dtype", ["bf16", "fp8"])
def test_gpu_step_inputs_equal_reference_at_the_8b_shape(index_dtype):
    """DeepSeek's indexer shape (H_I = 64, d_I = 128, RoPE on 64 dims), bf16 projections, 4 rows."""
    positions = [0, 4097, 32_000, 131_000]
    got, ref = _run("cuda", 4, 64, 128, 64, torch.bfloat16, index_dtype, 131_072, positions, seed=7)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], ref[1])
    rows = (torch.arange(4), torch.tensor(positions))
    _assert_keys_close(got[2], got[3], ref[2], ref[3], index_dtype, rows)
