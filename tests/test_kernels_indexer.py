"""The lightning indexer's kernels (issue 52): the index-key append (prr.kernels.indexer_keys) stores
the bytes and scales of the torch reference, bf16 or fp8 e4m3 quantized per token; the scores
(prr.kernels.indexer_score) equal Σ_h w_h · ReLU(scale · q_h · k) of the float64 reference at odd
sizes (T not a multiple of the tile, ragged lengths, empty rows, H_I = 5), -inf past each row's
length. The interpreter runs both fp8 kernels too (its fp8 loads and stores of e4m3 values are
exact). GPU tests (marked gpu) run the DeepSeek shape (H_I = 64, d_I = 128) and a CUDA-graph replay."""

from __future__ import annotations

import math
import os
from fractions import Fraction

import pytest
import torch
from prr.kernels.indexer_keys import index_key_append
from prr.kernels.indexer_score import indexer_scores
from prr.kernels.reference_indexer import (
    FP8_MAX,
    dequantize_index_keys_reference,
    empty_index_cache,
    index_key_append_reference,
    indexer_scores_reference,
    quantize_index_keys_reference,
    random_indexer_inputs,
)
from prr.kernels.reference_sparse_decode import relative_error

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="needs a CUDA device and TRITON_INTERPRET=0",
)

SCORE_TOL = 1e-5  # fp32 accumulation of exact products (fp32 q: split into two bf16 parts, ~2^-17)


def _bytes(keys: torch.Tensor) -> torch.Tensor:
    return keys.view(torch.uint8) if keys.dtype == torch.float8_e4m3fn else keys


def _wide_keys(rows: int, dim: int, seed: int) -> torch.Tensor:
    """Keys over a wide dynamic range (scales 2^-12 .. 2^12) with planted values: entry 3 the absmax
    448 · scale (scale a power of two, so k / scale is exact), entries 2, 4, 5 exact ties
    (8.5 -> 8, 9.5 -> 10, 1.5 · 2^-9 -> 2^-8: to even), entry 1 in e4m3's subnormal range, entries 6, 7
    bf16 ties; row 0 zero."""
    g = torch.Generator().manual_seed(seed)
    scale = 2.0 ** torch.randint(-12, 13, (rows, 1), generator=g).float()
    k = (torch.randn(rows, dim, generator=g) * 60).clamp(-440, 440) * scale
    k[:, 1] = torch.randn(rows, generator=g) * 2**-8 * scale[:, 0]
    k[:, 2], k[:, 3], k[:, 4] = 8.5 * scale[:, 0], -448.0 * scale[:, 0], 9.5 * scale[:, 0]
    k[:, 5] = 1.5 * 2**-9 * scale[:, 0]
    # bf16 ties (8 significand bits): 1 + 2^-8 -> 1, -(1 + 3 · 2^-8) -> -(1 + 2^-6)
    k[:, 6], k[:, 7] = (1 + 2**-8) * scale[:, 0], -(1 + 3 * 2**-8) * scale[:, 0]
    k[0] = 0.0
    return k


# --- the fp8 quantization (torch reference, CPU) -------------------------------------------------


def test_quantization_round_trip_properties():
    """scale = absmax / 448; each token's largest entry maps to ±448; every entry is the nearest e4m3
    value to k / scale (ties to even); dequantized keys are within half an e4m3 step of k (relative
    2^-4, or 2^-10 · scale in the subnormal range); an all-zero key gives scale 0 and zeros, no NaN."""
    k = _wide_keys(64, 32, seed=3)
    fp8, scale = quantize_index_keys_reference(k)
    assert fp8.dtype == torch.float8_e4m3fn and fp8.shape == k.shape and scale.shape == (64,)
    assert scale.dtype == torch.float32 and torch.equal(scale, k.abs().amax(-1) / FP8_MAX)
    values = fp8.float()
    assert not torch.isnan(values).any()
    assert scale[0] == 0 and values[0].abs().sum() == 0
    assert torch.equal(values[1:].abs().amax(-1), torch.full((63,), FP8_MAX))
    # nearest of all finite e4m3 values, ties to even (an even code)
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[~torch.isnan(codes)]
    target = k[1:] / scale[1:, None]
    distance = (target.unsqueeze(-1) - codes).abs()  # [63, 32, 254]
    assert torch.all((target - values[1:]).abs() <= distance.amin(-1))
    ties = (distance == distance.amin(-1, keepdim=True)).sum(-1) > 1
    assert ties.any() and torch.all(fp8[1:][ties].view(torch.uint8) % 2 == 0)
    assert torch.all(values[1:, 2] == 8.0) and torch.all(values[1:, 4] == 10.0)  # the planted ties
    assert torch.all(values[1:, 5] == 2**-8) and torch.all(values[1:, 3] == -FP8_MAX)
    deq = dequantize_index_keys_reference(fp8, scale)
    bound = torch.maximum(k.abs() * 2**-4, scale[:, None] * 2**-10) * (1 + 1e-6)
    assert torch.all((deq - k).abs() <= bound)
    assert ((deq - k).abs() > 0).any()  # it is a lossy format: the bound is not vacuous
    assert fp8.element_size() * 128 + scale.element_size() == 132  # DeepSeek's bytes a token at d_I = 128


def _nearest_binary(x: Fraction, significant_bits: int, min_exponent: int) -> Fraction:
    """x rounded to the nearest binary float of `significant_bits` bits whose exponent is at least
    min_exponent (evenly spaced subnormals below it), ties to the even significand; exact rationals."""
    if x == 0:
        return x
    magnitude = abs(x)
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()  # floor(log2) or one above
    exponent -= Fraction(2) ** exponent > magnitude
    spacing = Fraction(2) ** (max(exponent, min_exponent) - significant_bits + 1)
    steps = math.floor(magnitude / spacing)
    past_half = magnitude / spacing - steps - Fraction(1, 2)
    steps += past_half > 0 or (past_half == 0 and steps % 2 == 1)
    return (-1 if x < 0 else 1) * steps * spacing


def _fp32(x: Fraction) -> Fraction:
    return _nearest_binary(x, 24, -126)


def _e4m3_code(x: Fraction, negative: bool) -> int:
    """The float8_e4m3fn byte of x (clamped to ±448 first), -0.0 (0x80) where a negative x rounds to 0."""
    value = _nearest_binary(min(max(x, Fraction(-448)), Fraction(448)), 4, -6)
    return E4M3_CODES[(float(value), negative)]


E4M3_CODES = {(v, math.copysign(1, v) < 0): code for code, v in
              enumerate(torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist())
              if not math.isnan(v)}


def _quantize_exactly(key: list[float], reciprocal_scale: bool = False) -> tuple[list[int], float]:
    """The defined quantization of one fp32 key in exact rational arithmetic, rounded to fp32 where fp32
    rounds: scale = fp32(absmax / 448), code = e4m3(fp32(k / scale)) -> (the bytes, the scale).
    reciprocal_scale: scale = fp32(absmax · fp32(1 / 448)) instead (torch's CUDA `tensor / 448.0`)."""
    absmax = max(abs(Fraction(v)) for v in key)
    scale = _fp32(absmax * _fp32(Fraction(1, 448))) if reciprocal_scale else _fp32(absmax / 448)
    if scale == 0:
        return [0] * len(key), 0.0
    return [_e4m3_code(_fp32(Fraction(v) / scale), math.copysign(1, v) < 0) for v in key], float(scale)


def _hard_keys() -> torch.Tensor:
    """[5, 16] fp32 keys on the edges of the quantization: row 0 scale 2^-3 (exact) with e4m3 ties
    (8.5 -> 8, 9.5 -> 10, 432 -> 448, the subnormal 1.5 · 2^-9 -> 2^-8 and 15 · 2^-10 -> 2^-6), values near
    448 (440 -> 448, 420 -> 416), the smallest and largest subnormals, ties to zero and negatives that
    round to -0.0; rows 1 and 2 absmax 1 and 3, whose scales absmax / 448 are not fp32 numbers, with
    an entry that is an exact tie in real numbers (448 · k / absmax = 7 · 2^-10) but not in fp32; row 3
    zero; row 4 a negative absmax with tiny negative entries."""
    s = 2.0**-3
    edge = [448, 8.5, 9.5, -8.5, 432, -440, 420, 1.5 * 2**-9, 0.5 * 2**-9, -0.5 * 2**-9, -(2**-12), 7 * 2**-9,
            15 * 2**-10, -15 * 2**-10, -0.0, 2**-9]
    inexact_1 = [1.0, 2**-16, -(2**-16), -1.0, 0.5, 0.3, -0.7, 1e-3, -1e-3, 0.1, 2**-20, -(2**-20), 0.999,
                 0.0045, -0.0, 0.0]
    inexact_3 = [3.0, 3 * 2**-16, -3 * 2**-16, 2.9, -1.5, 0.3, 1e-4, -1e-4, 2.0, -2.0, 3 * 2**-20, 0.0137, 0.75,
                 -0.1, 1.0, 3 * 2**-10]
    tiny_negatives = [-5.0, -1e-9, -1e-6, -2e-3, 5 * 2**-10, -0.0, 1.25, -4.99, 0.01, -0.01, 3.3, 2e-2, -2e-2,
                      4e-3, -4e-3, 0.0]
    return torch.tensor([[v * s for v in edge], inexact_1, inexact_3, [0.0] * 16, tiny_negatives])


def test_quantization_of_hard_values_is_the_defined_fp32_arithmetic():
    """The reference's bytes and scales are those of the defined arithmetic (scale = fp32(absmax / 448),
    code = e4m3(fp32(k / scale)), ties to even, the sign of zero kept) computed in exact rationals, on
    ties, values near 448, subnormals, scales that are not fp32 numbers and negatives rounding to -0.0.
    The fp32 roundings decide: row 1's tie goes down where the real-number result goes up, row 2's goes
    up where torch's CUDA `absmax / 448.0` (a multiplication by fp32(1 / 448)) sends it down."""
    k = _hard_keys()
    fp8, scale = quantize_index_keys_reference(k)
    for row in range(k.shape[0]):
        codes, want_scale = _quantize_exactly(k[row].tolist())
        assert fp8[row].view(torch.uint8).tolist() == codes, row
        assert scale[row].item() == want_scale, row
    codes = fp8.view(torch.uint8)
    assert codes[0, :7].tolist() == [0x7E, 0x50, 0x52, 0xD0, 0x7E, 0xFE, 0x7D]  # 448, 8, 10, -8, 448, -448, 416
    assert codes[0, 7:14].tolist() == [0x02, 0x00, 0x80, 0x80, 0x07, 0x08, 0x88]  # 2^-8, +0, -0, -0, 7·2^-9, ±2^-6
    assert codes[0, 14:].tolist() == [0x80, 0x01] and codes[4, 1:3].tolist() == [0x80, 0x80]  # -0.0 stays -0.0
    assert codes[1, 1] == 0x03 and codes[2, 1] == 0x04  # 3 · 2^-9 and 2^-7 (from the same real-number tie)
    assert codes[1, 0] == codes[2, 0] == 0x7E and codes[1, 3] == 0xFE  # ±absmax -> ±448 (the clamp)
    assert _e4m3_code(Fraction(7, 2**10), False) == 0x04  # the real-number answer of row 1 (not the fp32 one)
    assert _quantize_exactly(k[2].tolist(), reciprocal_scale=True)[0][1] == 0x03  # the reciprocal's answer
    assert scale[3] == 0 and codes[3].sum() == 0


# --- the append kernel against the reference (interpreter) ---------------------------------------


@pytest.mark.parametrize("index_dtype,new_dtype", [("bf16", torch.float32), ("bf16", torch.bfloat16),
                                                   ("fp8", torch.float32), ("fp8", torch.float16)])
def test_append_equals_reference(index_dtype, new_dtype):
    """Rows at different positions over several steps; the stored bytes and scales equal the
    reference's exactly; positions outside [0, T_max) write nothing."""
    _run_append("cpu", index_dtype, new_dtype, head_dim=32, batch=3, max_tokens=11)


def _run_append(device: str, index_dtype: str, new_dtype: torch.dtype, head_dim: int, batch: int,
                max_tokens: int) -> None:
    g = torch.Generator().manual_seed(head_dim + batch)
    keys, scales = empty_index_cache(batch, max_tokens, head_dim, index_dtype, device)
    ref_keys, ref_scales = empty_index_cache(batch, max_tokens, head_dim, index_dtype, "cpu")
    starts = [0, 4, max_tokens - 5][:batch] + list(range(batch - 3))
    for step in range(5):
        k = (torch.randn(batch, head_dim, generator=g) * 3 ** (step - 2)).to(new_dtype)
        if step == 1:
            k[0] = 0.0  # an all-zero key
        pos = torch.tensor([s + step for s in starts], dtype=torch.int32)
        index_key_append(keys, scales, k.to(device), pos.to(device))
        index_key_append_reference(ref_keys, ref_scales, k, pos)
    assert torch.equal(_bytes(keys).cpu(), _bytes(ref_keys))
    if scales is not None:
        assert torch.equal(scales.cpu(), ref_scales)
    before = _bytes(keys).clone()
    k = torch.randn(batch, head_dim, generator=g).to(new_dtype).to(device)
    outside = torch.tensor([-1, max_tokens] + [max_tokens + 7] * (batch - 2), dtype=torch.int64, device=device)
    index_key_append(keys, scales, k, outside)
    assert torch.equal(_bytes(keys), before)


@pytest.mark.parametrize("index_dtype", ["bf16", "fp8"])
def test_append_bytes_equal_reference_over_a_wide_range(index_dtype):
    """The kernel's rounding (its own round-to-nearest-even onto the bf16 / e4m3 grid, so that the
    conversion after it is exact: Triton's interpreter truncates fp32 -> bf16 and mis-rounds fp32 -> fp8
    where the mantissa carries, the GPU rounds to nearest even) equals torch's bytes and scales over a
    wide dynamic range, subnormals, exact ties and a zero key."""
    k = _wide_keys(96, 16, seed=11)
    keys, scales = empty_index_cache(96, 1, 16, index_dtype)
    index_key_append(keys, scales, k, torch.zeros(96, dtype=torch.int32))
    ref_keys, ref_scales = empty_index_cache(96, 1, 16, index_dtype)
    index_key_append_reference(ref_keys, ref_scales, k, torch.zeros(96, dtype=torch.int32))
    assert torch.equal(_bytes(keys), _bytes(ref_keys))
    assert scales is None or torch.equal(scales, ref_scales)
    if index_dtype == "bf16":  # the planted ties went to even
        assert torch.equal(keys[1:, 0, 6].float(), k[1:, 6] / (1 + 2**-8))
        assert torch.equal(keys[1:, 0, 7].float(), k[1:, 7] / (1 + 3 * 2**-8) * (1 + 2**-6))


def test_append_of_hard_values_equals_reference():
    """The kernel on the hard keys (ties, near 448, subnormals, inexact scales, negatives rounding to
    -0.0: Triton <= 3.6's `-x` = 0 - x stored +0.0 there) stores the reference's bytes and scales."""
    k = _hard_keys()
    keys, scales = empty_index_cache(5, 2, 16, "fp8")
    index_key_append(keys, scales, k, torch.ones(5, dtype=torch.int32))
    ref_keys, ref_scales = empty_index_cache(5, 2, 16, "fp8")
    index_key_append_reference(ref_keys, ref_scales, k, torch.ones(5, dtype=torch.int32))
    assert torch.equal(_bytes(keys), _bytes(ref_keys)) and torch.equal(scales, ref_scales)


# --- the score kernel against the reference (interpreter) ----------------------------------------


@pytest.mark.parametrize("index_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_scores_equal_reference(index_dtype, q_dtype):
    """B = 3 ragged rows (one empty), T_max = 109 (not a multiple of the 16-token tile), H_I = 5
    (padded to the dot's 16), garbage keys past each length; 2 programs a row, so each loops over
    several live tiles and then the dead ones. ReLU and the weights matter at this tolerance: the
    reference without either is far off."""
    x = random_indexer_inputs(7, [37, 100, 0], num_heads=5, head_dim=32, index_dtype=index_dtype,
                              q_dtype=q_dtype, extra_tokens=9)
    got = indexer_scores(*x.args(), block_t=16, splits=2)
    want = indexer_scores_reference(*x.args())
    assert got.shape == (3, 109) and got.dtype == torch.float32
    assert relative_error(got, want) < SCORE_TOL
    live = torch.arange(109) < x.lengths.long().unsqueeze(-1)
    assert torch.isfinite(got[live]).all() and torch.all(got[~live] == float("-inf"))
    # what a kernel that dropped the ReLU, or the weights, would return
    no_relu = _scores_without(x, relu=False)
    unweighted = _scores_without(x, weights=False)
    assert relative_error(no_relu, want) > 0.1 and relative_error(unweighted, want) > 0.1


def _scores_without(x, relu: bool = True, weights: bool = True) -> torch.Tensor:
    keys = dequantize_index_keys_reference(x.keys, x.scales).double()
    dots = torch.einsum("btd,bhd->bth", keys, x.q.double())
    dots = torch.relu(dots) if relu else dots
    w = x.weights.double() if weights else torch.ones_like(x.weights, dtype=torch.float64)
    scores = (dots * w.unsqueeze(1)).sum(-1)
    live = torch.arange(keys.shape[1]) < x.lengths.long().unsqueeze(-1)
    return scores.masked_fill(~live, float("-inf")).float()


@pytest.mark.parametrize("index_dtype", ["bf16", "fp8"])
def test_scores_of_a_hand_computed_case(index_dtype):
    """Two heads, weights 0.5 and -2 (either sign, as DeepSeek's projection gives), three tokens with
    q·k of (2, -3), (-1, 4), (6, 0.5): scores 0.5·2 = 1, -2·4 = -8, 0.5·6 - 2·0.5 = 2; the fourth slot
    is past the length: -inf."""
    d = 16
    q = torch.zeros(1, 2, d)
    q[0, 0, 0], q[0, 1, 1] = 1.0, 1.0  # head 0 reads coordinate 0, head 1 coordinate 1
    k = torch.zeros(4, d)
    k[:, 0] = torch.tensor([2.0, -1.0, 6.0, 5.0])
    k[:, 1] = torch.tensor([-3.0, 4.0, 0.5, 5.0])
    k[:, 2] = 7.0  # read by no head; the absmax: fp8 scale 7 / 448 = 2^-6, so every entry is exact in e4m3
    weights = torch.tensor([[0.5, -2.0]])
    if index_dtype == "bf16":
        keys, scales = k.to(torch.bfloat16).unsqueeze(0), None
    else:
        fp8, scale = quantize_index_keys_reference(k)
        keys, scales = fp8.unsqueeze(0), scale.unsqueeze(0)
    lengths = torch.tensor([3], dtype=torch.int32)
    got = indexer_scores(q, weights, keys, scales, lengths)
    assert torch.equal(got[0, :3], torch.tensor([1.0, -8.0, 2.0]))
    assert got[0, 3] == float("-inf")


def test_scores_do_not_depend_on_splits_tile_or_batch():
    """A row's scores are bit for bit the same whichever program takes its tiles, at another
    T_max, and computed alone or in a batch (no cross-tile reduction: batch-invariant)."""
    x = random_indexer_inputs(4, [50, 70], num_heads=3, head_dim=16, index_dtype="fp8", extra_tokens=3)
    one = indexer_scores(*x.args(), block_t=16, splits=1)
    for splits in (3, None):
        assert torch.equal(indexer_scores(*x.args(), block_t=16, splits=splits), one)
    alone = indexer_scores(x.q[1:], x.weights[1:], x.keys[1:, :71], x.scales[1:, :71], x.lengths[1:], block_t=16)
    assert torch.equal(alone[0], one[1, :71])


def test_scores_out_and_lengths_past_t_max():
    """A preallocated `out` is filled; a length above T_max counts as T_max."""
    x = random_indexer_inputs(5, [20, 13], num_heads=2, head_dim=16)
    out = torch.full((2, 20), 7.0)
    over = torch.tensor([40, 13], dtype=torch.int32)
    assert indexer_scores(x.q, x.weights, x.keys, None, over, out=out, block_t=16) is out
    want = indexer_scores_reference(x.q, x.weights, x.keys, None, x.lengths)
    assert relative_error(out, want) < SCORE_TOL


def test_rejects_bad_input():
    x = random_indexer_inputs(1, [20], num_heads=2, head_dim=16)
    fp8 = random_indexer_inputs(1, [20], num_heads=2, head_dim=16, index_dtype="fp8")
    cases = [
        (dict(keys=torch.zeros(1, 20, 24, dtype=torch.bfloat16)), "d_I=24 must be a power of two"),
        (dict(keys=torch.zeros(1, 20, 16)), "bf16 or torch.float8_e4m3fn; got torch.float32"),
        (dict(keys=fp8.keys), "need their per-token scales"),
        (dict(scales=fp8.scales), "bf16 index keys take no scales"),
        (dict(q=x.q.half()), "q must be bf16 or fp32; got torch.float16"),
        (dict(q=x.q[:, :, :8]), r"q must be \[B, H_I, d_I\]=\[1, H_I, 16\]"),
        (dict(weights=x.weights.bfloat16()), "weights must be fp32"),
        (dict(lengths=x.lengths.float()), "lengths must be an int32 tensor"),
        (dict(block_t=24), "block_t=24 must be a power of two"),
        (dict(out=torch.empty(1, 19)), r"out must be fp32 \[1, 20\]"),
    ]
    for change, needle in cases:
        args = dict(q=x.q, weights=x.weights, keys=x.keys, scales=None, lengths=x.lengths) | change
        out = args.pop("out", None)
        block_t = args.pop("block_t", 16)
        with pytest.raises(ValueError, match=needle):
            indexer_scores(**args, out=out, block_t=block_t)
    with pytest.raises(ValueError, match="all inputs must be on one device; got cpu and meta"):
        indexer_scores(x.q.to("meta"), x.weights, x.keys, None, x.lengths)
    keys, scales = empty_index_cache(2, 8, 16, "fp8")
    with pytest.raises(ValueError, match="all inputs must be on one device; got cpu and meta"):
        index_key_append(keys, scales, torch.zeros(2, 16, device="meta"), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"k_new must be \[B, d_I\]=\[2, 16\]"):
        index_key_append(keys, scales, torch.zeros(2, 8), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"the scales must be fp32 \[B, T_max\]"):
        index_key_append(keys, scales[:, :4], torch.zeros(2, 16), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="positions must be an int32 tensor"):
        index_key_append(keys, scales, torch.zeros(2, 16), torch.zeros(3, dtype=torch.int32))


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    """Without TRITON_INTERPRET a CPU tensor cannot reach a Triton kernel: one error naming the fix."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = random_indexer_inputs(1, [20], num_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="inputs are on cpu: the Triton kernels need CUDA tensors"):
        indexer_scores(*x.args())
    keys, scales = empty_index_cache(1, 8, 16, "bf16")
    with pytest.raises(ValueError, match="inputs are on cpu: the Triton kernels need CUDA tensors"):
        index_key_append(keys, scales, torch.zeros(1, 16), torch.zeros(1, dtype=torch.int32))


# --- GPU: the DeepSeek shape, compiled kernels, a CUDA graph -------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("index_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_gpu_scores_equal_reference(index_dtype, q_dtype):
    x = random_indexer_inputs(2, [5000, 1, 4099], num_heads=64, head_dim=128, index_dtype=index_dtype,
                              q_dtype=q_dtype, extra_tokens=37, device="cuda")
    got = indexer_scores(*x.args())
    want = indexer_scores_reference(*x.args())
    assert relative_error(got, want) < SCORE_TOL
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(indexer_scores(*x.args(), splits=1), got)  # batch- and split-invariant on the GPU too


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("index_dtype", ["bf16", "fp8"])
def test_gpu_append_equals_reference(index_dtype):
    """The compiled kernel's bytes (div_rn, the e4m3 rounding, cvt) equal torch's."""
    _run_append("cuda", index_dtype, torch.bfloat16, head_dim=128, batch=4, max_tokens=300)
    k = _wide_keys(512, 128, seed=5)
    keys, scales = empty_index_cache(512, 2, 128, index_dtype, "cuda")
    index_key_append(keys, scales, k.cuda(), torch.ones(512, dtype=torch.int32, device="cuda"))
    ref_keys, ref_scales = empty_index_cache(512, 2, 128, index_dtype)
    index_key_append_reference(ref_keys, ref_scales, k, torch.ones(512, dtype=torch.int32))
    assert torch.equal(_bytes(keys).cpu(), _bytes(ref_keys))
    assert scales is None or torch.equal(scales.cpu(), ref_scales)


@pytest.mark.gpu
@gpu
def test_gpu_reference_quantization_equals_the_cpu_one():
    """The reference quantizes to the same bytes and scales on the GPU as on the CPU (the CUDA graph test
    checks the kernel against it there): bf16 keys, whose quotients often sit on e4m3 ties, wide keys, hard keys."""
    bf16 = torch.randn(4096, 128, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    for k in (bf16, _wide_keys(512, 128, seed=6), _hard_keys()):
        fp8, scale = quantize_index_keys_reference(k)
        fp8_gpu, scale_gpu = quantize_index_keys_reference(k.cuda())
        assert torch.equal(_bytes(fp8_gpu).cpu(), _bytes(fp8)) and torch.equal(scale_gpu.cpu(), scale)
    keys, scales = empty_index_cache(5, 1, 16, "fp8", "cuda")
    index_key_append(keys, scales, _hard_keys().cuda(), torch.zeros(5, dtype=torch.int32, device="cuda"))
    assert torch.equal(_bytes(keys[:, 0]).cpu(), _bytes(quantize_index_keys_reference(_hard_keys())[0]))


@pytest.mark.gpu
@gpu
def test_gpu_append_and_scores_replay_in_a_cuda_graph():
    """Append then score captured once and replayed with new positions / lengths / keys written in
    place: the replay follows the device values (no host syncs, static shapes)."""
    batch, max_tokens, heads, dim = 2, 4096, 64, 128
    x = random_indexer_inputs(9, [4000, 2000], num_heads=heads, head_dim=dim, index_dtype="fp8",
                              q_dtype=torch.bfloat16, extra_tokens=96, device="cuda")
    positions = x.lengths.clone()
    lengths = x.lengths + 1
    k_new = torch.randn(batch, dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(batch, max_tokens, device="cuda")
    index_key_append(x.keys, x.scales, k_new, positions)  # compile outside the capture
    indexer_scores(x.q, x.weights, x.keys, x.scales, lengths, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        index_key_append(x.keys, x.scales, k_new, positions)
        indexer_scores(x.q, x.weights, x.keys, x.scales, lengths, out=out)
    for step in range(3):
        k_new.copy_(torch.randn(batch, dim, device="cuda"))
        positions += 1
        lengths += 1
        ref_keys, ref_scales = x.keys.clone(), x.scales.clone()
        graph.replay()
        index_key_append_reference(ref_keys, ref_scales, k_new, positions)
        assert torch.equal(x.keys.view(torch.uint8), ref_keys.view(torch.uint8)), step
        want = indexer_scores_reference(x.q, x.weights, ref_keys, ref_scales, lengths)
        assert relative_error(out, want) < SCORE_TOL, step
