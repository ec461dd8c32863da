"""PRR's one-launch repair + merge (prr.kernels.prr_repair) against the three launches' float64
references and against attention over A itself (exact-mode PRR), on fresh random caches and
block lists at odd sizes (CPU: TRITON_INTERPRET=1 from conftest; GPU: -m gpu)."""

from __future__ import annotations

import os

import pytest
import torch
from prr.kernels import prr_merge as pm
from prr.kernels import prr_repair as pr
from prr.kernels import reference_sparse_decode as ref
from prr.kernels import sparse_decode as sd
from prr.kernels.reference_prr_repair import repair_and_merge_reference

GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def lists_with_hit_rate(a: torch.Tensor, na: torch.Tensor, num_blocks: list[int], pred_cap: int, hit: float,
                        g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """P per (b, h): round(hit * |A|) blocks of A plus blocks outside A, up to pred_cap, in random
    order, then junk padding (valid-looking block ids)."""
    batch, heads, _ = a.shape
    p = torch.zeros(batch, heads, pred_cap, dtype=torch.int32)
    npred = torch.zeros(batch, heads, dtype=torch.int32)
    for b in range(batch):
        for h in range(heads):
            sel = a[b, h, : int(na[b, h])]
            hits = sel[torch.randperm(len(sel), generator=g)[: round(hit * len(sel))]]
            outside = torch.tensor([x for x in torch.randperm(num_blocks[b], generator=g).tolist()
                                    if x not in set(sel.tolist())], dtype=torch.int32)
            row = torch.cat([hits, outside])[:pred_cap]
            row = row[torch.randperm(len(row), generator=g)]
            p[b, h, : len(row)] = row
            p[b, h, len(row):] = torch.randint(max(1, num_blocks[b]), (pred_cap - len(row),), generator=g)
            npred[b, h] = len(row)
    return p, npred


def case(seed, lengths, hq, hkv, d, bs, topk, sel_cap, pred_cap, hit, dtype=torch.float32, empty_rows=()):
    inputs = ref.random_sparse_decode_inputs(seed, lengths, hq, hkv, d, bs, topk, sel_cap, dtype=dtype,
                                             device=DEVICE, empty_rows=empty_rows)
    g = torch.Generator().manual_seed(seed + 7)
    a, na = inputs.block_ids.int().cpu(), inputs.block_counts.int().cpu()
    p, npred = lists_with_hit_rate(a, na, [-(-n // bs) for n in lengths], pred_cap, hit, g)
    p, npred = p.to(DEVICE), npred.to(DEVICE)
    part_out, part_lse = sd.sparse_decode(inputs.q, inputs.k_cache, inputs.v_cache, p, npred, inputs.lengths, bs,
                                          inputs.scale, per_block=True)
    return inputs, (a.to(DEVICE).contiguous(), na.to(DEVICE).contiguous(), p, npred), (part_out, part_lse)


@pytest.mark.parametrize("seed,lengths,hq,hkv,d,bs,topk,sel_cap,pred_cap,hit", [
    (0, [1110, 577], 6, 2, 64, 16, 9, 11, 13, 0.7),
    (1, [333], 4, 1, 64, 16, 5, 5, 5, 1.0),
    (2, [2049, 900, 65], 8, 2, 128, 32, 17, 19, 23, 0.0),
    (3, [3000], 12, 3, 64, 16, 40, 40, 29, 0.9),  # |P| < |A|: some of A is always repaired
])
def test_repair_and_merge_equals_the_three_launches_and_attention_over_a(seed, lengths, hq, hkv, d, bs, topk,
                                                                         sel_cap, pred_cap, hit):
    inputs, (a, na, p, npred), (part_out, part_lse) = case(seed, lengths, hq, hkv, d, bs, topk, sel_cap, pred_cap, hit)
    args = (inputs.q, inputs.k_cache, inputs.v_cache, a, na, p, npred, inputs.lengths, part_out, part_lse, bs,
            inputs.scale)
    arrivals = torch.zeros(len(lengths) * hkv, dtype=torch.int32, device=DEVICE)
    out, lse, keep = pr.repair_and_merge(*args, arrivals=arrivals)
    want_out, want_lse, want_keep = repair_and_merge_reference(*args)
    assert torch.equal(keep.cpu(), want_keep.cpu())
    torch.testing.assert_close(out.double().cpu(), want_out.cpu(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse.double().cpu(), want_lse.cpu(), rtol=1e-5, atol=1e-5)
    # exact-mode PRR: attention over A whatever P was
    serial_out, serial_lse = ref.sparse_decode_reference(inputs.q, inputs.k_cache, inputs.v_cache, a, na,
                                                         inputs.lengths, bs, inputs.scale)
    torch.testing.assert_close(out.double().cpu(), serial_out.double().cpu(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse.double().cpu(), serial_lse.double().cpu(), rtol=1e-5, atol=1e-5)
    assert int(arrivals.abs().sum()) == 0  # re-armed for the next launch
    again = pr.repair_and_merge(*args, arrivals=arrivals)
    assert torch.equal(again[0], out) and torch.equal(again[2], keep)


def test_repair_and_merge_equals_the_three_launches_bitwise_in_mask_and_closely_in_value():
    """Against the kernels it replaces (repair_plan, sparse_decode over A \\ P, merge_speculation),
    with more splits than entries per split and a 16-bit output."""
    inputs, (a, na, p, npred), (part_out, part_lse) = case(5, [5000, 1234], 8, 2, 64, 16, 60, 64, 64, 0.8)
    scratch = pm.repair_scratch(2, 2, 5000 // 16 + 1, torch.device(DEVICE))
    miss, nmiss, keep3 = pm.repair_plan(a, na, p, npred, scratch)
    rep_out, rep_lse = sd.sparse_decode(inputs.q, inputs.k_cache, inputs.v_cache, miss, nmiss, inputs.lengths, 16,
                                        inputs.scale, merge_splits=False)
    out3, _ = pm.merge_speculation(part_out, part_lse, keep3, rep_out, rep_lse, out_dtype=torch.bfloat16)
    out, _, keep = pr.repair_and_merge(inputs.q, inputs.k_cache, inputs.v_cache, a, na, p, npred, inputs.lengths,
                                       part_out, part_lse, 16, inputs.scale, out_dtype=torch.bfloat16,
                                       tokens_per_split=48)  # 3 entries per split: 22 splits
    assert out.dtype == torch.bfloat16 and torch.equal(keep, keep3)
    torch.testing.assert_close(out.float(), out3.float(), rtol=1e-2, atol=1e-2)


def test_empty_selection_rows_give_no_mass():
    inputs, (a, na, p, npred), (part_out, part_lse) = case(4, [700, 400], 4, 2, 64, 16, 6, 6, 7, 0.5,
                                                           empty_rows=((1, 0),))
    out, lse, keep = pr.repair_and_merge(inputs.q, inputs.k_cache, inputs.v_cache, a, na, p, npred, inputs.lengths,
                                         part_out, part_lse, 16, inputs.scale)
    assert int(na[1, 0]) == 0 and not keep[1, 0].any()
    assert torch.isneginf(lse[1, :2]).all() and int(out[1, :2].abs().sum()) == 0
    assert torch.isfinite(lse[0]).all()


def test_input_checks_name_the_problem():
    inputs, (a, na, p, npred), (part_out, part_lse) = case(6, [300], 4, 2, 64, 16, 4, 4, 4, 0.5)
    args = [inputs.q, inputs.k_cache, inputs.v_cache, a, na, p, npred, inputs.lengths, part_out, part_lse, 16,
            inputs.scale]
    bad = list(args)
    bad[3] = a.long()
    with pytest.raises(ValueError, match="sel_idx must be a contiguous int32"):
        pr.repair_and_merge(*bad)
    bad = list(args)
    bad[8] = part_out[:, :, :2]
    with pytest.raises(ValueError, match="part_out / part_lse"):
        pr.repair_and_merge(*bad)
    with pytest.raises(ValueError, match="block_size=24"):
        pr.repair_and_merge(*args[:10], 24, inputs.scale)


def test_default_plan_bounds_the_states_per_split_and_fills_the_sms():
    """default_splits: a split folds at most MAX_STATES_PER_SPLIT states of P when A has entries
    enough, rows x splits reaches the SM count when A has entries enough, never more splits
    than A entries; fused_tail_pays at the Llama-3.1-8B shape on 132 SMs (the H200's)."""
    sms = sd.DEFAULT_NUM_SMS
    for sel_cap in (1, 5, 32, 128, 512):
        for pred_cap in (1, 7, 32, 128, 512):
            for rows in (1, 8, 64, 200):
                s = pr.default_splits(sel_cap, pred_cap, rows, "cpu")
                assert 1 <= s <= min(sel_cap, sd.MAX_FUSED_MERGE_SPLITS)
                if s < sel_cap:
                    assert -(-pred_cap // s) <= pr.MAX_STATES_PER_SPLIT and rows * s >= sms, (sel_cap, pred_cap, rows)
    def pays(batch, budget, block):
        return pr.fused_tail_pays(budget // block, budget // block, batch * 8, "cpu")
    assert all(pays(1, k, bs) for k in (2048, 8192) for bs in (16, 64))
    assert pays(8, 2048, 16) and pays(8, 2048, 64) and pays(8, 8192, 64)
    assert not pays(8, 8192, 16)  # 32 splits x 64 rows: where the three launches measured faster


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
@pytest.mark.parametrize("batch,bs,budget,hit", [(1, 64, 8192, 1.0), (1, 16, 2048, 0.9), (8, 64, 2048, 0.68),
                                                 (3, 16, 8192, 0.0)])
def test_gpu_llama8b_bf16(batch, bs, budget, hit):
    """The Llama-3.1-8B attention shape in bf16 (32 query / 8 KV heads, D 128) at a 40K context."""
    k = budget // bs
    inputs, lists, (part_out, part_lse) = case(11, [40_000 - 37 * i for i in range(batch)], 32, 8, 128, bs, k, k, k,
                                               hit, dtype=torch.bfloat16)
    args = (inputs.q, inputs.k_cache, inputs.v_cache, *lists, inputs.lengths, part_out, part_lse, bs, inputs.scale)
    out, lse, keep = pr.repair_and_merge(*args)
    want_out, want_lse, want_keep = repair_and_merge_reference(*args)
    assert torch.equal(keep.cpu(), want_keep.cpu())
    err = ref.relative_error(out.double().cpu(), want_out.cpu())
    assert err < 1e-2, err
    torch.testing.assert_close(lse.double().cpu(), want_lse.cpu(), rtol=1e-3, atol=1e-3)
