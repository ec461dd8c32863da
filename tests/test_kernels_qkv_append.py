"""The batch-1 q|k|v projection with RoPE and the cache append in one launch
(prr.kernels.qkv_append) equals the math of the two launches it replaces (dense_gemv, then
cache_append.append_token(rope=...)): at odd sizes (K tails, D = 16 / 32, GQA groups 3 and 2,
one KV head), fp32 and bf16, with and without bias, RMSNorm and Quest metadata, at a block's
start, inside a block, and out of range (nothing written). The row permutation is the one RoPE
needs, and without it the kernel's result is wrong."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from prr.kernels.cache_append import append_token
from prr.kernels.dense_gemv import dense_gemv
from prr.kernels.qkv_append import default_tiles, qkv_rope_append, rope_pair_permutation

from prr.model.layer_math import rms_norm
from prr.model.rope import apply_rope, rope_cos_sin, rope_inv_freq

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="needs a CUDA device and TRITON_INTERPRET=0",
)
EPS = 1e-5


def _reference(x, weight, bias, norm_weight, pos, cos, sin, hq, hkv, head_dim):
    """The unfused path's math in x's dtype: dense_gemv's reference projection (RMSNorm, then
    F.linear), RoPE in fp32 (fp64 for fp64 inputs) from the rounded projection, rounded once.
    x: [1, H], weight: [(Hq + 2 Hkv) D, H] unpermuted -> (q_rot [Hq, D], k_rot [Hkv, D], v [Hkv, D])."""
    h = rms_norm(x, norm_weight, EPS) if norm_weight is not None else x
    q, k, v = F.linear(h, weight, bias).view(hq + 2 * hkv, head_dim).split([hq, hkv, hkv])
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    c, s = cos[pos].to(wide)[None], sin[pos].to(wide)[None]  # the table as the kernel reads it
    return apply_rope(q.to(wide), c, s).to(x.dtype), apply_rope(k.to(wide), c, s).to(x.dtype), v


class Case:
    """Random inputs of one layer and its caches / metadata (on `device`), and the launch."""

    def __init__(self, device, dtype, hidden, hq, hkv, head_dim, bias, norm, meta, block_size=8, max_blocks=4,
                 seed=0, random_tables=False, strided=False):
        g = torch.Generator().manual_seed(seed)
        rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dtype).to(device)  # noqa: E731
        rows = (hq + 2 * hkv) * head_dim
        self.hq, self.hkv, self.d, self.bs, self.dtype = hq, hkv, head_dim, block_size, dtype
        self.x = rnd(1, hidden, scale=3.0)
        self.weight = rnd(rows, hidden, scale=hidden ** -0.5)
        self.bias = rnd(rows) if bias else None
        self.norm = (1 + rnd(hidden, scale=0.2)) if norm else None
        perm = rope_pair_permutation(hq, hkv, head_dim).to(device)
        self.weight_perm = self.weight[perm].contiguous()
        self.bias_perm = None if self.bias is None else self.bias[perm].contiguous()
        t_max = max_blocks * block_size
        if random_tables:  # cos / sin halves differ (a real table repeats them: a mixed-up half would pass)
            self.cos, self.sin = rnd(t_max + 3, head_dim), rnd(t_max + 3, head_dim)
        else:
            cos, sin = rope_cos_sin(torch.arange(t_max + 3), rope_inv_freq(head_dim, 10000.0, None))
            self.cos, self.sin = cos.to(dtype).to(device), sin.to(dtype).to(device)
        # Stale caches and metadata: a block's first token must ignore the old metadata.
        # strided: views into longer buffers (token and block strides that are not T_max D / NB D)
        extra = 5 if strided else 0
        self.keys = rnd(1, hkv, t_max + extra, head_dim)[:, :, :t_max]
        self.values = rnd(1, hkv, t_max + extra, head_dim)[:, :, :t_max]
        big = rnd(1, hkv, max_blocks + extra, head_dim) if meta else None
        self.key_max = big[:, :, :max_blocks] if meta else None
        self.key_min = (big - 1)[:, :, :max_blocks] if meta else None

    def run(self, pos: int, weight=None, tiles=None, pos_dtype=torch.int32):
        positions = torch.tensor([pos], dtype=pos_dtype, device=self.x.device)
        return qkv_rope_append(self.x, self.weight_perm if weight is None else weight, self.bias_perm, self.norm, EPS,
                               self.keys, self.values, positions, self.cos, self.sin, self.key_max, self.key_min,
                               self.bs, self.hq, self.hkv, tiles=tiles)

    def reference(self, pos: int, wide: bool = False):
        cast = (lambda t: None if t is None else t.double()) if wide else (lambda t: t)  # noqa: E731
        return _reference(cast(self.x), cast(self.weight), cast(self.bias), cast(self.norm), pos, self.cos, self.sin,
                          self.hq, self.hkv, self.d)


def _tolerance(got, want_wide, want_own, dtype):
    """dense_gemv's test rule: fp32 within 1e-5 of the fp64 math's scale; 16-bit within twice the
    torch path's own error plus 2^-6 of the scale (the kernel rounds the projection from a
    different fp32 sum)."""
    err = (got.double() - want_wide.double()).abs().max().item()
    own = (want_own.double() - want_wide.double()).abs().max().item()
    scale = want_wide.abs().max().item()
    return err, (1e-5 * scale if dtype == torch.float32 else 2 * own + 2 ** -6 * scale)


def _check_step(case: Case, pos: int, tiles=None, pos_dtype=torch.int32) -> None:
    keys, values = case.keys.clone(), case.values.clone()
    old_max = None if case.key_max is None else case.key_max.clone()
    old_min = None if case.key_min is None else case.key_min.clone()
    q_rot = case.run(pos, tiles=tiles, pos_dtype=pos_dtype)
    want_q, want_k, want_v = case.reference(pos, wide=True)
    own_q, own_k, own_v = case.reference(pos)
    assert q_rot.shape == (1, case.hq, case.d) and q_rot.dtype == case.dtype
    for got, wide, own in ((q_rot[0], want_q, own_q), (case.keys[0, :, pos], want_k, own_k),
                           (case.values[0, :, pos], want_v, own_v)):
        err, tol = _tolerance(got, wide, own, case.dtype)
        assert err <= tol, (err, tol)
    # Nothing but the slot at pos changed.
    keys[0, :, pos], values[0, :, pos] = case.keys[0, :, pos], case.values[0, :, pos]
    assert torch.equal(case.keys, keys) and torch.equal(case.values, values)
    if old_max is None:
        return
    # The metadata of pos's block is of the key as the cache stores it (exact), others unchanged.
    block, stored = pos // case.bs, case.keys[0, :, pos].to(case.key_max.dtype)
    if pos % case.bs:
        old_max[0, :, block], old_min[0, :, block] = old_max[0, :, block].maximum(stored), old_min[0, :, block].minimum(stored)
    else:  # a block's first token: stale contents ignored
        old_max[0, :, block], old_min[0, :, block] = stored, stored
    assert torch.equal(case.key_max, old_max) and torch.equal(case.key_min, old_min)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden,hq,hkv,head_dim,tiles", [
    (100, 3, 1, 16, None),  # one KV head (Triton makes an int 1 a constant), GQA 3, one K tile wider than K
    (72, 4, 2, 32, (8, 32, 4)),  # K tail (72 = 2 x 32 + 8), four tiles per head
])
@pytest.mark.parametrize("bias,meta", [(False, True), (True, False), (True, True)])
def test_qkv_rope_append_equals_projection_rope_and_append(dtype, hidden, hq, hkv, head_dim, tiles, bias, meta):
    case = Case("cpu", dtype, hidden, hq, hkv, head_dim, bias=bias, norm=True, meta=meta, seed=hidden + head_dim)
    for pos in (13, 16, 17):  # inside block 1, the start of block 2, inside block 2 (block_size 8)
        _check_step(case, pos, tiles)


def test_random_rope_tables_strided_caches_two_row_tiles_int64_positions():
    """Tables whose halves differ (each half of a pair reads its own cos / sin), caches and
    metadata as views with longer token / block strides, BLOCK_N = 2 (one pair per tile; what
    default_tiles picks for D = 2 mod 4), int64 positions."""
    case = Case("cpu", torch.float32, 40, 2, 1, 16, bias=True, norm=True, meta=True, seed=11, random_tables=True,
                strided=True)
    for pos in (5, 8):
        _check_step(case, pos, tiles=(2, 16, 1), pos_dtype=torch.int64)


def test_qkv_rope_append_without_norm():
    case = Case("cpu", torch.float32, 40, 2, 2, 16, bias=False, norm=False, meta=True, seed=1)
    _check_step(case, 0)


def test_qkv_rope_append_equals_the_two_launches_it_replaces():
    """fp32: dense_gemv (same K tile) then append_token(rope=...) on the unpermuted weight."""
    case = Case("cpu", torch.float32, 100, 4, 2, 32, bias=True, norm=True, meta=True, seed=7, random_tables=True)
    two = Case("cpu", torch.float32, 100, 4, 2, 32, bias=True, norm=True, meta=True, seed=7, random_tables=True)
    pos = torch.tensor([9], dtype=torch.int32)
    q_rot = case.run(9)
    qkv = dense_gemv(two.x, two.weight, two.bias, norm_weight=two.norm, eps=EPS).view(1, 8, 32)
    q, k, v = qkv.split([4, 2, 2], dim=1)
    want = append_token(two.keys, two.values, k, v, pos, two.key_max, two.key_min, two.bs, rope=(two.cos, two.sin, q))
    for got, ref in ((q_rot, want), (case.keys, two.keys), (case.values, two.values), (case.key_max, two.key_max),
                     (case.key_min, two.key_min)):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("pos", [-1, 32])  # before the cache, and T_max (= 4 blocks of 8): block 4 does not exist
def test_out_of_range_positions_write_nothing(pos):
    case = Case("cpu", torch.float32, 40, 2, 1, 16, bias=True, norm=True, meta=True, seed=3)
    before = [t.clone() for t in (case.keys, case.values, case.key_max, case.key_min)]
    q_rot = case.run(pos)
    for t, old in zip((case.keys, case.values, case.key_max, case.key_min), before, strict=True):
        assert torch.equal(t, old)
    assert torch.equal(q_rot, torch.zeros_like(q_rot))  # as append_token: q = 0 for such a row


def test_rope_pair_permutation_puts_each_pair_on_adjacent_rows():
    hq, hkv, d = 3, 2, 8
    perm = rope_pair_permutation(hq, hkv, d)
    assert perm.dtype == torch.int64 and torch.equal(perm.sort().values, torch.arange((hq + 2 * hkv) * d))
    for head in range(hq + hkv):  # q and k heads: rows (2j, 2j + 1) are dims (j, j + D/2) of that head
        rows = perm[head * d:(head + 1) * d].view(d // 2, 2) - head * d
        assert torch.equal(rows[:, 0], torch.arange(d // 2)) and torch.equal(rows[:, 1], torch.arange(d // 2) + d // 2)
    v = perm[(hq + hkv) * d:]
    assert torch.equal(v, torch.arange((hq + hkv) * d, (hq + 2 * hkv) * d))  # v in order
    # What the kernel relies on: one tile of adjacent rows rotated as pairs equals apply_rope.
    x = torch.randn(d, dtype=torch.float64)
    cos, sin = (t.double() for t in rope_cos_sin(torch.tensor([5]), rope_inv_freq(d, 10000.0, None)))
    a, b = x[perm[:d]].view(d // 2, 2).unbind(1)
    half = d // 2
    rotated = torch.cat([a * cos[0, :half] - b * sin[0, :half], b * cos[0, half:] + a * sin[0, half:]])
    torch.testing.assert_close(rotated, apply_rope(x, cos[0], sin[0]))


def test_an_unpermuted_weight_gives_wrong_queries_and_keys():
    """The kernel pairs adjacent rows: fed the weight in plain dim order it rotates the wrong
    pairs and stores them at the wrong dims (the permutation is load-bearing)."""
    case = Case("cpu", torch.float32, 40, 2, 1, 16, bias=False, norm=True, meta=False, seed=4)
    want_q, want_k, want_v = case.reference(6, wide=True)
    q_rot = case.run(6, weight=case.weight)
    for got, want in ((q_rot[0], want_q), (case.keys[0, :, 6], want_k)):
        err, tol = _tolerance(got, want, want, torch.float32)
        assert err > 100 * tol
    torch.testing.assert_close(case.values[0, :, 6].double(), want_v, rtol=1e-5, atol=1e-6)  # v rows are not permuted


def test_default_tiles():
    assert default_tiles(6144, 4096, 128) == (16, 512, 4)  # Llama-3.1-8B's q|k|v: dense_gemv's tuned tile
    assert default_tiles(640, 100, 32) == (16, 128, 4)
    assert default_tiles(90, 3000, 6) == (2, 512, 4)  # the largest power of two dividing D = 6


def test_bad_input_is_refused():
    case = Case("cpu", torch.float32, 40, 2, 1, 16, bias=False, norm=True, meta=True, seed=5)
    pos = torch.tensor([3], dtype=torch.int32)
    args = lambda **kw: {**dict(x=case.x, weight_perm=case.weight_perm, bias_perm=None, norm_weight=case.norm,  # noqa: E731
                                eps=EPS, k_cache=case.keys, v_cache=case.values, positions=pos, cos=case.cos,
                                sin=case.sin, key_max=case.key_max, key_min=case.key_min, block_size=8,
                                num_q_heads=2, num_kv_heads=1), **kw}
    with pytest.raises(ValueError, match=r"one row \[1, H\] \(batch 1\)"):
        qkv_rope_append(**args(x=case.x.expand(2, 40)))
    with pytest.raises(ValueError, match="weight_perm must be in x's dtype"):
        qkv_rope_append(**args(weight_perm=case.weight_perm.double()))
    with pytest.raises(ValueError, match=r"weight_perm must be \[\(Hq \+ 2 Hkv\) D, H\]=\[80, 40\]"):
        qkv_rope_append(**args(num_q_heads=3))
    with pytest.raises(ValueError, match="head_dim must be even"):
        odd = torch.zeros(1, 1, 32, 15)
        qkv_rope_append(**args(k_cache=odd, v_cache=odd.clone(), weight_perm=torch.zeros(60, 40), key_max=None,
                               key_min=None))
    with pytest.raises(ValueError, match="BLOCK_N=32 must be a power of two >= 2 dividing head_dim=16"):
        qkv_rope_append(**args(), tiles=(32, 64, 4))
    with pytest.raises(ValueError, match="BLOCK_N=6 must be a power of two"):
        qkv_rope_append(**args(), tiles=(6, 64, 4))
    with pytest.raises(ValueError, match="both key_max and key_min"):
        qkv_rope_append(**args(key_min=None))
    with pytest.raises(ValueError, match="positions must be"):
        qkv_rope_append(**args(positions=torch.tensor([3.0])))
    with pytest.raises(ValueError, match="cos and sin must be"):
        qkv_rope_append(**args(cos=case.cos[:5], sin=case.sin[:5]))
    with pytest.raises(ValueError, match="contiguous last dim"):
        qkv_rope_append(**args(weight_perm=torch.zeros(40, 64).t()))
    with pytest.raises(ValueError, match="cos must be one of"):
        qkv_rope_append(**args(cos=case.cos.to(torch.int32), sin=case.sin.to(torch.int32)))
    with pytest.raises(ValueError, match="head_dim must be even"):
        rope_pair_permutation(2, 1, 7)


@pytest.mark.gpu
@gpu
def test_qkv_rope_append_on_the_gpu():
    """bf16: Llama-3.1-8B's shape with the tuned tile; one query and one KV head (ints equal
    to 1 become constants when Triton specialises); a K tail; fp32 metadata."""
    for hidden, hq, hkv, d, meta in ((4096, 32, 8, 128, True), (1000, 1, 1, 64, True), (4096, 32, 8, 128, False)):
        case = Case("cuda", torch.bfloat16, hidden, hq, hkv, d, bias=True, norm=True, meta=meta, block_size=16,
                    max_blocks=8, seed=hidden)
        for pos in (37, 48, 49):
            _check_step(case, pos)
    case = Case("cuda", torch.float32, 1000, 4, 2, 32, bias=True, norm=True, meta=True, seed=2)
    _check_step(case, 9)


@pytest.mark.gpu
@gpu
def test_qkv_rope_append_is_bitwise_the_two_launches_on_the_gpu():
    """bf16 at Llama-3.1-8B's q|k|v shape (the tuned tile, dense_gemv's K tile): the same bits as
    dense_gemv then append_token(rope=...) in q, the cache and the metadata (the bf16 tolerance
    of the other tests could not see a rounding step dropped before the rotation)."""
    for pos in (37, 48, 1234):
        case = Case("cuda", torch.bfloat16, 4096, 32, 8, 128, bias=True, norm=True, meta=True, block_size=16,
                    max_blocks=128, seed=pos)
        two = Case("cuda", torch.bfloat16, 4096, 32, 8, 128, bias=True, norm=True, meta=True, block_size=16,
                   max_blocks=128, seed=pos)
        q_rot = case.run(pos)
        qkv = dense_gemv(two.x, two.weight, two.bias, norm_weight=two.norm, eps=EPS).view(1, 48, 128)
        q, k, v = qkv.split([32, 8, 8], dim=1)
        positions = torch.tensor([pos], dtype=torch.int32, device="cuda")
        want = append_token(two.keys, two.values, k, v, positions, two.key_max, two.key_min, two.bs,
                            rope=(two.cos, two.sin, q))
        for got, ref in ((q_rot, want), (case.keys, two.keys), (case.values, two.values),
                         (case.key_max, two.key_max), (case.key_min, two.key_min)):
            assert torch.equal(got, ref)
