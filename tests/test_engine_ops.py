"""The graph engine's torch backend (prr/runtime/engine_ops.py: TorchOps, the kernels' torch
references) computes what its Triton backend (TritonOps, the kernels) computes, on fresh random
inputs at odd sizes (the kernels under TRITON_INTERPRET=1): the same attention states, A \\ P
and keep, merges, counters and cache writes. The torch backend needs no triton."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from prr.kernels.reference_sparse_decode import random_sparse_decode_inputs

from prr.runtime.engine_ops import EngineOps, TorchOps, TritonOps, engine_ops
from tests.test_kernels_append_newest import random_lists as random_newest_lists
from tests.test_kernels_keep_selection import random_selection, stale_buffers
from tests.test_kernels_prr_merge import random_lists

torch_ops, triton_ops = TorchOps(), TritonOps()


def aligned(inputs):
    """The cache padded to whole blocks (the engine's caches are block-aligned)."""
    t, bs = inputs.k_cache.shape[2], inputs.block_size
    pad = -t % bs
    if pad:
        def grow(c):
            return torch.cat([c, torch.zeros(*c.shape[:2], pad, c.shape[3], dtype=c.dtype)], 2)
        inputs.k_cache, inputs.v_cache = grow(inputs.k_cache), grow(inputs.v_cache)
    return inputs


@pytest.mark.parametrize("lengths,hq,hkv,d,bs,k,seed", [([37], 4, 2, 64, 16, 3, 0), ([130, 77], 6, 3, 64, 16, 5, 1),
                                                        ([90, 33, 129], 4, 2, 128, 32, 3, 2)])
def test_sparse_decode_torch_equals_the_kernel(lengths, hq, hkv, d, bs, k, seed):
    x = aligned(random_sparse_decode_inputs(seed, lengths, hq, hkv, d, bs, k, capacity=k + 2))
    for per_block in (False, True):
        want = triton_ops.sparse_decode(*x.args(), per_block=per_block)
        got = torch_ops.sparse_decode(*x.args(), per_block=per_block)
        assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
        finite = torch.isfinite(want[1])
        assert torch.equal(finite, torch.isfinite(got[1]))
        torch.testing.assert_close(got[1][finite], want[1][finite], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    splits = torch_ops.sparse_decode(*x.args(), merge_splits=False)  # one split: the merged state
    merged = triton_ops.sparse_decode(*x.args())
    torch.testing.assert_close(splits[0][:, :, 0], merged[0], rtol=1e-4, atol=1e-4)
    half = torch_ops.sparse_decode(*x.args(), out_dtype=torch.bfloat16)[0]
    assert half.dtype == torch.bfloat16


@pytest.mark.parametrize("batch,heads,max_blocks,sel_cap,pred_cap,seed", [(1, 1, 5, 3, 4, 0), (2, 3, 37, 11, 17, 1),
                                                                          (3, 2, 300, 41, 61, 2)])
def test_repair_plan_and_counters_torch_equal_the_kernels(batch, heads, max_blocks, sel_cap, pred_cap, seed):
    g = torch.Generator().manual_seed(seed)
    a, na = random_lists(batch, heads, max_blocks, sel_cap, g)
    p, npred = random_lists(batch, heads, max_blocks, pred_cap, g)
    half = min(sel_cap, pred_cap) // 2  # some of A in P
    p[..., :half] = torch.where(torch.arange(half) < na[..., None], a[..., :half], p[..., :half])
    for b in range(batch):
        for h in range(heads):
            row = p[b, h, : int(npred[b, h])].unique()
            npred[b, h] = len(row)
            p[b, h, : len(row)] = row
    want = triton_ops.repair_plan(a, na, p, npred, triton_ops.repair_scratch(batch, heads, max_blocks, "cpu"))
    got = torch_ops.repair_plan(a, na, p, npred, torch_ops.repair_scratch(batch, heads, max_blocks, "cpu"))
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    for b in range(batch):
        for h in range(heads):
            n = int(want[1][b, h])
            assert got[0][b, h, :n].tolist() == want[0][b, h, :n].tolist()

    prev, nprev = random_lists(batch, heads, max_blocks, sel_cap, g)
    outs = []
    for ops in (triton_ops, torch_ops):
        out = torch.zeros(4, batch * heads, dtype=torch.int64)
        prev_i, prev_n = prev.clone(), nprev.clone()
        ops.step_counters(a, na, p, npred, prev_i, prev_n, ops.counter_scratch(batch, heads, max_blocks, "cpu"), out)
        outs.append((out, prev_i, prev_n))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][2], outs[1][2])
    valid = torch.arange(sel_cap) < na.unsqueeze(-1)
    assert torch.equal(outs[0][1][valid], outs[1][1][valid])  # A_t is the next step's A_{t-1}
    layers = []  # the same over two layers in one call ([L, ...]: the engine's end-of-step count)
    for ops in (triton_ops, torch_ops):
        out = torch.zeros(2, 4, batch * heads, dtype=torch.int64)
        prev_i, prev_n = torch.stack([prev, a]), torch.stack([nprev, na])
        ops.step_counters_layers(torch.stack([a, a]), torch.stack([na, na]), torch.stack([p, p]),
                                 torch.stack([npred, npred]), prev_i, prev_n,
                                 ops.layer_counter_scratch(2, batch, heads, max_blocks, "cpu"), out)
        layers.append(out)
    assert torch.equal(layers[0], layers[1]) and torch.equal(layers[0][0], outs[0][0])


@pytest.mark.parametrize("fp", ["exact_three", "exact_fused"])
def test_merges_torch_equal_the_kernels(fp):
    x = aligned(random_sparse_decode_inputs(3, [200, 97], 6, 2, 64, 16, 6, capacity=6))
    g = torch.Generator().manual_seed(4)
    nb = x.k_cache.shape[2] // 16
    p, npred = random_lists(2, 2, 7, 5, g)  # P among the first blocks: some of it in A
    spec = triton_ops.sparse_decode(x.q, x.k_cache, x.v_cache, p, npred, x.lengths, 16, x.scale, per_block=True)
    sel = x.block_ids.int().sort(-1).values.contiguous()  # (the engine's A is ascending)
    args = (x.q, x.k_cache, x.v_cache, sel, x.block_counts.int(), p, npred, x.lengths, *spec, 16, x.scale)
    if fp == "exact_fused":
        want, got = triton_ops.repair_and_merge(*args), torch_ops.repair_and_merge(*args)
    else:
        plan = triton_ops.repair_plan(sel, x.block_counts.int(), p, npred, triton_ops.repair_scratch(2, 2, nb, "cpu"))
        rep = triton_ops.sparse_decode(x.q, x.k_cache, x.v_cache, plan[0], plan[1], x.lengths, 16, x.scale,
                                          merge_splits=False)
        want = triton_ops.merge_speculation(*spec, plan[2], *rep)
        got = torch_ops.merge_speculation(*spec, plan[2], *rep)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)


def test_append_token_torch_equals_the_kernel_with_rope():
    g = torch.Generator().manual_seed(5)
    b, hq, hkv, t, d = 2, 6, 3, 48, 64
    caches = [torch.randn(b, hkv, t, d, generator=g) for _ in range(2)]
    k, v, q = torch.randn(b, hkv, d, generator=g), torch.randn(b, hkv, d, generator=g), torch.randn(b, hq, d, generator=g)
    cos, sin = torch.randn(t, d, generator=g), torch.randn(t, d, generator=g)
    pos = torch.tensor([5, 31], dtype=torch.int32)
    results = []
    for ops in (triton_ops, torch_ops):
        kc, vc = (c.clone() for c in caches)
        q_rot = ops.append_token(kc, vc, k, v, pos, None, None, 16, rope=(cos, sin, q))
        results.append((kc, vc, q_rot))
    for want, got in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="append_metadata"):
        torch_ops.append_token(*caches, k, v, pos, caches[0], caches[1])


@pytest.mark.parametrize("batch,heads,capacity,width,seed", [(1, 1, 3, 3, 0), (3, 2, 7, 8, 1), (1, 5, 9, 12, 2)])
def test_append_newest_block_torch_equals_the_kernel(batch, heads, capacity, width, seed):
    """reuse=steps between selections: A ∪ {newest}, from ascending and best-first lists."""
    g = torch.Generator().manual_seed(seed)
    for best_first in (False, True):
        idx, cnt, nb = random_newest_lists(g, batch, heads, capacity, 37, best_first)
        want = triton_ops.append_newest_block(idx, cnt, nb, width)
        got = torch_ops.append_newest_block(idx, cnt, nb, width)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        for ops in (torch_ops, triton_ops):  # in place into buffers of the width (between=last)
            kept = (torch.zeros(batch, heads, width, dtype=torch.int32), cnt.clone())
            kept[0][..., :capacity] = idx
            ops.append_newest_block(*kept, nb, width, out=kept)
            assert torch.equal(kept[0], want[0]) and torch.equal(kept[1], want[1]), ops.name


@pytest.mark.parametrize("batch,heads,capacity,width,seed", [(1, 1, 3, 3, 0), (3, 5, 9, 12, 1)])
def test_keep_selection_torch_equals_the_kernel(batch, heads, capacity, width, seed):
    """reuse=steps' selecting step: A, its count and scores (or not) into stale buffers of the width."""
    g = torch.Generator().manual_seed(seed)
    for scores_kept in (True, False):
        inputs = random_selection(g, batch, heads, capacity, 37, torch.int64, torch.float32 if scores_kept else None)
        buffers = stale_buffers(g, batch, heads, width, 37)
        results = []
        for ops in (triton_ops, torch_ops):
            out = [b.clone() for b in buffers]
            ops.keep_selection(*inputs, *out)
            results.append(out)
        for want, got in zip(*results, strict=True):
            assert torch.equal(got, want)


def test_the_factory_gives_each_backend_its_class_and_refuses_others():
    assert isinstance(engine_ops("torch"), TorchOps) and isinstance(engine_ops("triton"), TritonOps)
    assert {TorchOps.name, TritonOps.name} == {"torch", "triton"}
    with pytest.raises(ValueError, match="not one of"):
        engine_ops("cuda")
    with pytest.raises(TypeError):  # the protocol is abstract: a backend implements every op
        EngineOps()


@pytest.mark.parametrize("op,args", [("dense_gemv", (torch.zeros(1, 4), torch.zeros(3, 4))),
                                     ("rope_pair_permutation", (2, 1, 4)),
                                     ("qkv_rope_append", (None,) * 15)])
def test_torch_refuses_the_projection_ops_naming_backend_triton(op, args):
    with pytest.raises(ValueError, match="needs backend=triton"):
        getattr(torch_ops, op)(*args)


def test_the_torch_backend_runs_without_triton():
    """engine_ops and the references it runs import no triton (machines without it use backend=torch)."""
    code = """
import sys
from pathlib import Path
sys.modules["triton"] = None  # any import of triton now raises ImportError
import torch
from prr.kernels.reference_sparse_decode import random_sparse_decode_inputs
from prr.runtime.engine_ops import engine_ops
ops = engine_ops("torch")
x = random_sparse_decode_inputs(0, [40], 4, 2, 64, 16, 2, capacity=3)
out, lse = ops.sparse_decode(*x.args())
assert out.shape == (1, 4, 64) and torch.isfinite(lse).all()
try:
    engine_ops("triton")
except ImportError:
    print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
