"""The PRR-step glue kernels (prr.kernels.prr_merge) against their torch references, on fresh
random selections at odd sizes (CPU: TRITON_INTERPRET=1 from conftest; GPU: -m gpu)."""

from __future__ import annotations

import os

import pytest
import torch
from prr.kernels import prr_merge as pm
from prr.kernels.reference_prr_merge import merge_speculation_reference, repair_plan_reference

from prr.attention_state import merge_many

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"


def random_lists(batch, heads, max_blocks, cap, generator):
    """-> (ids [B, H, cap] int32 distinct ascending then junk, counts [B, H] int32)."""
    ids = torch.full((batch, heads, cap), 7, dtype=torch.int32)  # junk padding, never read
    counts = torch.randint(0, cap + 1, (batch, heads), generator=generator, dtype=torch.int32)
    for b in range(batch):
        for h in range(heads):
            n = int(counts[b, h])
            ids[b, h, :n] = torch.randperm(max_blocks, generator=generator)[:n].sort().values.int()
    return ids, counts


@pytest.mark.parametrize("batch,heads,max_blocks,sel_cap,pred_cap,seed", [
    (1, 1, 5, 3, 4, 0), (2, 3, 37, 11, 17, 1), (3, 2, 300, 41, 61, 2), (1, 8, 1000, 64, 96, 3),
])
def test_repair_plan_is_a_minus_p_and_p_and_a(batch, heads, max_blocks, sel_cap, pred_cap, seed):
    g = torch.Generator().manual_seed(seed)
    a, na = random_lists(batch, heads, max_blocks, sel_cap, g)
    p, npred = random_lists(batch, heads, max_blocks, pred_cap, g)
    # Overlap P with A on purpose, as a predictor would.
    p[..., : sel_cap // 2] = torch.where(torch.arange(sel_cap // 2) < na[..., None], a[..., : sel_cap // 2],
                                         p[..., : sel_cap // 2])
    for b in range(batch):
        for h in range(heads):
            n = int(npred[b, h])
            row = p[b, h, :n].unique()
            npred[b, h] = len(row)
            p[b, h, : len(row)] = row
    scratch = pm.repair_scratch(batch, heads, max_blocks, torch.device(DEVICE))
    args = [t.to(DEVICE) for t in (a, na, p, npred)]
    miss, nmiss, keep = pm.repair_plan(*args, scratch)
    want_miss, want_nmiss, want_keep = repair_plan_reference(a, na, p, npred, max_blocks)
    assert torch.equal(nmiss.cpu(), want_nmiss)
    for b in range(batch):
        for h in range(heads):
            n = int(want_nmiss[b, h])
            assert miss[b, h, :n].tolist() == want_miss[b, h, :n].tolist(), (b, h)
            a_row, p_row = a[b, h, : int(na[b, h])].tolist(), set(p[b, h, : int(npred[b, h])].tolist())
            assert want_miss[b, h, :n].tolist() == [x for x in a_row if x not in p_row]  # A \ P in A's order
    assert torch.equal(keep.cpu(), want_keep)
    assert int(scratch.abs().sum()) == 0, "the scratch bitmap must be left zeroed"


@pytest.mark.parametrize("batch,hq,hkv,parts,d,seed", [(1, 1, 1, 1, 64, 0), (2, 6, 2, 13, 64, 1),
                                                       (1, 8, 2, 200, 128, 2)])
def test_merge_speculation_equals_merge_many_then_merge(batch, hq, hkv, parts, d, seed):
    g = torch.Generator().manual_seed(seed)
    part_out = torch.randn(batch, hq, parts, d, generator=g)
    part_lse = torch.randn(batch, hq, parts, generator=g) * 4
    part_lse[..., ::5] = float("-inf")  # empty partials (padding, blocks without live tokens)
    part_out[..., ::5, :] = float("nan")  # ... whose out must never be read
    keep = torch.rand(batch, hkv, parts, generator=g) < 0.6
    rep_out = torch.randn(batch, hq, d, generator=g)
    rep_lse = torch.randn(batch, hq, generator=g) * 4
    rep_lse[0, 0] = float("-inf")  # nothing missed for this head
    rep_out[0, 0] = float("nan")
    out, lse = pm.merge_speculation(*(t.to(DEVICE) for t in (part_out, part_lse, keep, rep_out, rep_lse)))
    want_out, want_lse = merge_speculation_reference(part_out.nan_to_num(), part_lse, keep, rep_out.nan_to_num(),
                                                     rep_lse)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.cpu().double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.cpu().double(), want_lse, rtol=1e-5, atol=1e-5)


def test_merge_speculation_with_nothing_kept_is_the_repair_state():
    rep_out, rep_lse = torch.randn(1, 4, 64), torch.randn(1, 4)
    part_out, part_lse = torch.randn(1, 4, 3, 64), torch.randn(1, 4, 3)
    on = lambda *ts: [t.to(DEVICE) for t in ts]  # noqa: E731
    out, lse = pm.merge_speculation(*on(part_out, part_lse, torch.zeros(1, 2, 3, dtype=torch.bool), rep_out, rep_lse))
    torch.testing.assert_close(out.cpu(), rep_out)
    torch.testing.assert_close(lse.cpu(), rep_lse)
    spec = merge_many(part_out, part_lse)
    out2, lse2 = pm.merge_speculation(*on(part_out, part_lse, torch.ones(1, 2, 3, dtype=torch.bool), rep_out,
                                          torch.full((1, 4), float("-inf"))))
    torch.testing.assert_close(out2.cpu(), spec.out)
    torch.testing.assert_close(lse2.cpu(), spec.lse)


def test_merge_speculation_folds_in_the_unmerged_repair_splits():
    from prr.kernels.sparse_decode import sparse_decode

    g = torch.Generator().manual_seed(11)
    batch, hq, hkv, d, block, length = 2, 6, 2, 64, 16, 517
    k = torch.randn(batch, hkv, 544, d, generator=g)
    v = torch.randn(batch, hkv, 544, d, generator=g)
    q = torch.randn(batch, hq, d, generator=g)
    lengths = torch.full((batch,), length, dtype=torch.int32)
    ids = torch.stack([torch.randperm(33, generator=g)[:20] for _ in range(batch * hkv)]).view(batch, hkv, 20).int()
    counts = torch.tensor([[20, 13], [7, 0]], dtype=torch.int32)
    on = lambda *ts: [t.to(DEVICE) for t in ts]  # noqa: E731
    args = on(q, k, v, ids, counts, lengths)
    split_out, split_lse = sparse_decode(*args, block, d ** -0.5, merge_splits=False, tokens_per_split=64)
    assert split_out.dim() == 4 and split_out.shape[2] > 1  # several splits, left unmerged
    merged_out, merged_lse = sparse_decode(*args, block, d ** -0.5, tokens_per_split=64)
    part_out, part_lse = torch.randn(batch, hq, 5, d, generator=g), torch.randn(batch, hq, 5, generator=g)
    keep = torch.rand(batch, hkv, 5, generator=g) < 0.5
    out, lse = pm.merge_speculation(*on(part_out, part_lse, keep), split_out, split_lse)
    want_out, want_lse = merge_speculation_reference(part_out, part_lse, keep, merged_out.cpu(), merged_lse.cpu())
    torch.testing.assert_close(out.cpu().double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.cpu().double(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_merge_speculation_out_dtype_rounds_the_fp32_output_once(out_dtype):
    g = torch.Generator().manual_seed(5)
    batch, hq, hkv, parts, splits, d = 2, 6, 2, 5, 3, 64
    part_out, part_lse = torch.randn(batch, hq, parts, d, generator=g), torch.randn(batch, hq, parts, generator=g)
    rep_out, rep_lse = torch.randn(batch, hq, splits, d, generator=g), torch.randn(batch, hq, splits, generator=g)
    keep = torch.rand(batch, hkv, parts, generator=g) < 0.5
    args = [t.to(DEVICE) for t in (part_out, part_lse, keep, rep_out, rep_lse)]
    want_out, want_lse = pm.merge_speculation(*args)
    out, lse = pm.merge_speculation(*args, out_dtype=out_dtype)
    assert out.dtype == out_dtype and torch.equal(lse, want_lse)
    assert ((out.float() - want_out).abs() <= torch.finfo(out_dtype).eps * want_out.abs() + 1e-30).all()
    with pytest.raises(ValueError, match="out_dtype"):
        pm.merge_speculation(*args, out_dtype=torch.int32)
