"""Exact-mode PRR over token lists with token states: the speculation writes scale · q·k per token of
P (prr.kernels.token_sparse_decode.token_scores: K only), and the one-launch repair
(prr.kernels.prr_repair.repair_and_merge, part_out=None, block size 1) folds each kept token's
stored score with its value row read from the cache. Against the float64 references, against the
per-token-state path it replaces, and against attention over A itself, on fresh random caches and
token lists at odd sizes (CPU: TRITON_INTERPRET=1 from conftest; GPU: -m gpu)."""

from __future__ import annotations

import os

import pytest
import torch
from prr.kernels import prr_repair as pr
from prr.kernels import reference_sparse_decode as ref
from prr.kernels import token_sparse_decode as tsd
from prr.kernels.reference_prr_repair import repair_and_merge_reference
from prr.kernels.reference_token_sparse_decode import (
    random_token_sparse_decode_inputs,
    token_scores_reference,
    token_sparse_decode_reference,
    token_states_reference,
)

from tests.test_kernels_prr_repair import lists_with_hit_rate

GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


@pytest.mark.parametrize("seed,lengths,hq,hkv,d,topk,capacity,shared,dtype", [
    (0, [301, 77], 6, 2, 64, 45, 53, False, torch.float32),
    (1, [1000], 4, 1, 128, 130, 130, True, torch.float32),
    (2, [150, 151, 9], 8, 4, 64, 33, 40, False, torch.float16),
])
def test_token_scores_match_the_reference(seed, lengths, hq, hkv, d, topk, capacity, shared, dtype):
    inputs = random_token_sparse_decode_inputs(seed, lengths, hq, hkv, d, topk, capacity, dtype=dtype, device=DEVICE,
                                               shared=shared, empty_rows=((len(lengths) - 1, 0),), beyond_length=3)
    args = (inputs.q, inputs.k_cache, inputs.token_ids, inputs.token_counts, inputs.lengths, inputs.scale)
    got = tsd.token_scores(*args)
    want = token_scores_reference(*args)
    assert got.shape == (len(lengths), hq, capacity) and got.dtype == torch.float32
    dead = torch.isinf(want)
    assert torch.equal(torch.isinf(got).cpu(), dead.cpu())  # padding, dead ids and the empty row: -inf
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.double().cpu()[~dead.cpu()], want.cpu()[~dead.cpu()], rtol=tol, atol=tol)
    # a few entries per program: the same scores
    again = tsd.token_scores(*args, tokens_per_program=7)
    torch.testing.assert_close(again[~dead], got[~dead], rtol=1e-6, atol=1e-6)


def token_case(seed, lengths, hq, hkv, d, topk, sel_cap, pred_cap, hit, dtype=torch.float32, empty_rows=()):
    """A [B, Hkv, sel_cap] and P [B, Hkv, pred_cap] token lists (P holds round(hit * |A|) of A), and
    P's token states as the speculation writes them (token_scores)."""
    inputs = random_token_sparse_decode_inputs(seed, lengths, hq, hkv, d, topk, sel_cap, dtype=dtype, device=DEVICE,
                                               empty_rows=empty_rows)
    g = torch.Generator().manual_seed(seed + 7)
    a, na = inputs.token_ids.int().cpu(), inputs.token_counts.int().cpu()
    p, npred = lists_with_hit_rate(a, na, lengths, pred_cap, hit, g)
    a, na, p, npred = (t.to(DEVICE).contiguous() for t in (a, na, p, npred))
    scores = tsd.token_scores(inputs.q, inputs.k_cache, p, npred, inputs.lengths, inputs.scale)
    return inputs, (a, na, p, npred), scores


@pytest.mark.parametrize("seed,lengths,hq,hkv,d,topk,sel_cap,pred_cap,hit,dtype", [
    (0, [611, 277], 6, 2, 64, 41, 45, 47, 0.7, torch.float32),
    (1, [333], 4, 1, 64, 50, 50, 50, 1.0, torch.float32),
    (2, [700, 300, 65], 8, 2, 128, 97, 100, 61, 0.0, torch.float32),
    (3, [900], 12, 3, 64, 150, 150, 119, 0.85, torch.float32),  # |P| < |A|: some of A is always repaired
    (4, [401, 180], 8, 2, 64, 70, 75, 80, 0.7, torch.float16),  # 16-bit cache: the native dots and P·V split
])
def test_token_states_repair_equals_attention_over_a(seed, lengths, hq, hkv, d, topk, sel_cap, pred_cap, hit, dtype):
    inputs, (a, na, p, npred), scores = token_case(seed, lengths, hq, hkv, d, topk, sel_cap, pred_cap, hit, dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    args = (inputs.q, inputs.k_cache, inputs.v_cache, a, na, p, npred, inputs.lengths, None, scores, 1, inputs.scale)
    arrivals = torch.zeros(len(lengths) * hkv, dtype=torch.int32, device=DEVICE)
    out, lse, keep = pr.repair_and_merge(*args, arrivals=arrivals)
    want_out, want_lse, want_keep = repair_and_merge_reference(*args)
    assert torch.equal(keep.cpu(), want_keep.cpu())
    torch.testing.assert_close(out.double().cpu(), want_out.cpu(), rtol=10 * tol, atol=tol)
    torch.testing.assert_close(lse.double().cpu(), want_lse.cpu(), rtol=tol, atol=tol)
    # exact-mode PRR: attention over A's tokens whatever P was
    serial_out, serial_lse = token_sparse_decode_reference(inputs.q, inputs.k_cache, inputs.v_cache, a, na,
                                                           inputs.lengths, inputs.scale)
    torch.testing.assert_close(out.double().cpu(), serial_out.cpu(), rtol=10 * tol, atol=tol)
    torch.testing.assert_close(lse.double().cpu(), serial_lse.cpu(), rtol=tol, atol=tol)
    assert int(arrivals.abs().sum()) == 0  # re-armed for the next launch
    # the per-token states it replaces ([B, Hq, |P|, D]: the value rows) give the same keep and output
    states = token_states_reference(inputs.v_cache, p, hq)
    old_out, _, old_keep = pr.repair_and_merge(*args[:8], states, scores, 1, inputs.scale)
    assert torch.equal(old_keep, keep)
    torch.testing.assert_close(old_out, out, rtol=1e-5, atol=1e-6)


def test_token_states_with_an_empty_selection_row_and_a_split_plan_of_its_own():
    inputs, (a, na, p, npred), scores = token_case(5, [520, 390], 4, 2, 64, 60, 64, 70, 0.6, empty_rows=((1, 1),))
    args = (inputs.q, inputs.k_cache, inputs.v_cache, a, na, p, npred, inputs.lengths, None, scores, 1, inputs.scale)
    out, lse, keep = pr.repair_and_merge(*args, tokens_per_split=17)  # 17 entries a split: several splits a row
    want_out, want_lse, want_keep = repair_and_merge_reference(*args)
    assert torch.equal(keep.cpu(), want_keep.cpu())
    assert not bool(keep[1, 1].any()) and torch.isinf(lse[1, 2:4]).all()  # nothing selected: no mass
    torch.testing.assert_close(out.double().cpu(), want_out.cpu(), rtol=1e-4, atol=1e-5)


def test_token_states_are_refused_with_blocks():
    inputs = ref.random_sparse_decode_inputs(0, [100], 4, 2, 64, 16, 3, 4, device=DEVICE)
    ids, cnt = inputs.block_ids.int().contiguous(), inputs.block_counts.int().contiguous()
    scores = torch.zeros(1, 4, 4, device=DEVICE)
    with pytest.raises(ValueError, match="part_out=None .* needs block_size 1, got 16"):
        pr.repair_and_merge(inputs.q, inputs.k_cache, inputs.v_cache, ids, cnt, ids, cnt, inputs.lengths, None,
                            scores, 16, inputs.scale)
    with pytest.raises(ValueError, match="part_out=None .* needs block_size 1, got 16"):
        repair_and_merge_reference(inputs.q, inputs.k_cache, inputs.v_cache, ids, cnt, ids, cnt, inputs.lengths, None,
                                   scores, 16, inputs.scale)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and TRITON_INTERPRET=0")
@pytest.mark.parametrize("batch,hit", [(1, 0.8), (1, 0.0), (4, 1.0)])
def test_gpu_llama8b_bf16_top2048(batch, hit):
    """The Llama-3.1-8B attention shape in bf16 (32 query / 8 KV heads, D 128) at a 40K context,
    |A| = |P| = 2,048 tokens (the indexer's default)."""
    inputs, lists, scores = token_case(11, [40_000 - 37 * i for i in range(batch)], 32, 8, 128, 2048, 2048, 2048, hit,
                                       dtype=torch.bfloat16)
    want_scores = token_scores_reference(inputs.q, inputs.k_cache, lists[2], lists[3], inputs.lengths, inputs.scale)
    live = ~torch.isinf(want_scores)
    torch.testing.assert_close(scores.double()[live].cpu(), want_scores[live].cpu(), rtol=2e-2, atol=2e-2)
    args = (inputs.q, inputs.k_cache, inputs.v_cache, *lists, inputs.lengths, None, scores, 1, inputs.scale)
    out, lse, keep = pr.repair_and_merge(*args, out_dtype=torch.bfloat16)
    want_out, want_lse, want_keep = repair_and_merge_reference(*args)
    assert torch.equal(keep.cpu(), want_keep.cpu())
    err = ref.relative_error(out.double().cpu(), want_out.cpu())
    assert err < 1e-2, err
    torch.testing.assert_close(lse.double().cpu(), want_lse.cpu(), rtol=1e-3, atol=1e-3)
