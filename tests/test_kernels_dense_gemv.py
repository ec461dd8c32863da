"""The fused decode projections (prr.kernels.dense_gemv) equal the torch layer math they
replace (prr.model.layer_math): plain, RMSNorm-first, SwiGLU and residual-add forms, at odd
sizes, with and without bias, with K tiles that do and do not divide K, one row (the GEMV) and
several (tensor-core tiles); bad input is refused before launch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from prr.kernels.dense_gemv import dense_gemv

from prr.model.layer_math import rms_norm

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="needs a CUDA device and TRITON_INTERPRET=0",
)


def _reference(x, weight, bias, norm_weight, eps, residual, swiglu):
    """prr.model.layer_math's math in x's dtype (what the graph engine computed before)."""
    h = rms_norm(x, norm_weight, eps) if norm_weight is not None else x
    y = F.linear(h, weight, bias)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return residual + y if residual is not None else y


def _inputs(M, N_w, K, dtype, device, bias, norm, residual, swiglu, seed):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dtype).to(device)  # noqa: E731
    x = rnd(M, K, scale=3.0)
    weight = rnd(N_w, K, scale=K ** -0.5)
    n = N_w // 2 if swiglu else N_w
    return (x, weight, rnd(N_w) if bias else None, (1 + rnd(K, scale=0.2)) if norm else None,
            rnd(M, n) if residual else None)


def _check(device, M, N_w, K, dtype, bias=False, norm=False, residual=False, swiglu=False, tiles=None, seed=0):
    x, weight, b, nw, res = _inputs(M, N_w, K, dtype, device, bias, norm, residual, swiglu, seed)
    eps = 1e-5
    ref = _reference(x.double(), weight.double(), None if b is None else b.double(),
                     None if nw is None else nw.double(), eps, None if res is None else res.double(), swiglu)
    ref_own = _reference(x, weight, b, nw, eps, None if res is None else res.clone(), swiglu)  # in x's dtype
    before = None if res is None else res.clone()
    out = dense_gemv(x, weight, b, norm_weight=nw, eps=eps, residual=res, swiglu=swiglu, tiles=tiles)
    assert out.shape == (M, N_w // 2 if swiglu else N_w) and out.dtype == dtype
    if res is not None:
        assert out.data_ptr() == res.data_ptr()  # updated in place
        assert not torch.equal(res, before)
    err = (out.double() - ref).abs().max().item()
    # The layer math in this dtype is the yardstick: the kernel may round differently (its
    # 1/rms scales the dot products; SwiGLU rounds gate, silu, up and product: a few ulps),
    # never by much more than the torch path's own error.
    own = (ref_own.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    tol = 1e-5 * scale if dtype == torch.float32 else 2 * own + 2 ** -6 * scale
    assert err <= tol, (err, own, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N_w,K,tiles", [
    (1, 37, 70, (4, 32, 4)),  # GEMV: K tile does not divide K, N not a multiple of the row tile
    (1, 50, 64, (8, 16, 2)),  # GEMV: K tile divides K (no masks along K)
    (1, 19, 13, None),  # GEMV, default tiles: one K tile wider than K
    (3, 50, 64, (16, 16, 2)),  # several rows (tensor-core tiles), K tile divides K
    (17, 40, 70, (16, 32, 4)),  # rows over two row tiles, K and N tails
    (2, 19, 13, None),  # several rows, default tiles
])
@pytest.mark.parametrize("form", ["plain", "bias", "norm", "norm_bias", "residual", "residual_bias", "swiglu_norm",
                                  "swiglu_norm_bias"])
def test_dense_gemv_equals_layer_math(dtype, M, N_w, K, tiles, form):
    kw = dict(bias="bias" in form, norm="norm" in form, residual="residual" in form, swiglu="swiglu" in form)
    if kw["swiglu"] and N_w % 2:
        N_w += 1
    _check("cpu", M, N_w, K, dtype, tiles=tiles, seed=M * 100 + N_w, **kw)


@pytest.mark.parametrize("M,tiles", [(1, (4, 16, 2)), (2, (16, 16, 2))])
def test_dense_gemv_norm_is_scale_invariant_in_x(M, tiles):
    """RMSNorm's defining property survives the one-pass form: scaling x changes nothing
    (up to rounding)."""
    x, weight, _, nw, _ = _inputs(M, 33, 48, torch.float32, "cpu", False, True, False, False, 3)
    a = dense_gemv(x, weight, norm_weight=nw, eps=0.0, tiles=tiles)
    b = dense_gemv(x * 7.5, weight, norm_weight=nw, eps=0.0, tiles=tiles)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_dense_gemv_writes_into_out():
    """out= is written (every entry, the returned tensor itself) with what a new y would hold, at M = 1
    (the GEMV) and M = 3 (row tiles), with the norm inside; out beside residual or overlapping x is refused."""
    for m in (1, 3):
        x, weight, _, nw, _ = _inputs(m, 37, 40, torch.float32, "cpu", False, True, False, False, 5)
        out = torch.full((m, 37), float("nan"))
        y = dense_gemv(x, weight, norm_weight=nw, out=out)
        assert y.data_ptr() == out.data_ptr()
        torch.testing.assert_close(out, dense_gemv(x, weight, norm_weight=nw), rtol=0, atol=0)
    x = torch.randn(1, 8)
    with pytest.raises(ValueError, match="residual .* or out .*, not both"):
        dense_gemv(x, torch.randn(6, 8), residual=torch.randn(1, 6), out=torch.empty(1, 6))
    with pytest.raises(ValueError, match=r"out must be \[M, N\]=\[1, 6\]"):
        dense_gemv(x, torch.randn(6, 8), out=torch.empty(1, 5))
    both = torch.randn(1, 16)
    with pytest.raises(ValueError, match="out must not overlap x"):
        dense_gemv(both[:, :8], torch.randn(6, 8), out=both[:, 2:8])


def test_dense_gemv_refuses_bad_input():
    x = torch.randn(2, 8)
    w = torch.randn(6, 8)
    with pytest.raises(ValueError, match="one K"):
        dense_gemv(x, torch.randn(6, 9))
    with pytest.raises(ValueError, match="share one of"):
        dense_gemv(x, w.double())
    with pytest.raises(ValueError, match="even number of rows"):
        dense_gemv(x, torch.randn(5, 8), swiglu=True)
    with pytest.raises(ValueError, match="bias must have shape"):
        dense_gemv(x, w, torch.randn(5))
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        dense_gemv(x, w, norm_weight=torch.randn(7))
    with pytest.raises(ValueError, match="residual must have shape"):
        dense_gemv(x, w, residual=torch.randn(2, 3))
    r = torch.randn(2, 6)
    with pytest.raises(ValueError, match="must not overlap x"):
        dense_gemv(r, torch.randn(6, 6), residual=r)
    both = torch.randn(2, 12)  # x and residual: two views of one buffer
    with pytest.raises(ValueError, match="must not overlap x"):
        dense_gemv(both[:, :6], torch.randn(6, 6), residual=both[:, 6:])
    dense_gemv(both[:1, :6], torch.randn(6, 6), residual=both[1:, 6:])  # disjoint rows: fine
    with pytest.raises(ValueError, match="powers of two >= 16"):
        dense_gemv(x, w, tiles=(8, 16, 2))  # M = 2 rows: tensor-core tiles
    with pytest.raises(ValueError, match="contiguous last dim"):
        dense_gemv(torch.randn(8, 2).t(), w)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("form", ["plain", "bias", "norm", "residual", "swiglu_norm", "swiglu_norm_bias"])
def test_dense_gemv_on_the_gpu(form):
    """Llama-like and odd shapes in bf16 on the GPU, default tiles and a masked K tail; N = 1
    (Triton turns an int argument equal to 1 into a constant: the kernels must compile so)."""
    kw = dict(bias="bias" in form, norm="norm" in form, residual=form == "residual", swiglu="swiglu" in form)
    n_one = 2 if kw["swiglu"] else 1
    for M, N_w, K, tiles in ((1, 6144, 4096, None), (1, 1002, 1000, None), (3, 1026, 4096, (16, 64, 4)),
                             (8, 4096, 14336, None), (20, 1002, 1000, None), (1, n_one, 256, None),
                             (2, n_one, 256, None)):
        _check("cuda", M, N_w, K, torch.bfloat16, tiles=tiles, seed=N_w, **kw)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("swiglu", [False, True])
def test_dense_rows_default_tiles_fit_shared_memory_in_fp32_on_the_gpu(swiglu):
    """fp32 at several rows with the default row tiles: bf16's (64, 256) SwiGLU tiles need 306 KiB
    of shared memory in fp32 (the H200 has 227); default_row_tiles halves BLOCK_K there."""
    _check("cuda", 4, 2 * 500 if swiglu else 1000, 4096, torch.float32, tiles=None, seed=5,
           bias=True, norm=True, residual=not swiglu, swiglu=swiglu)
