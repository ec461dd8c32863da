"""LESS's compensation kernel (prr.kernels.less) against its fp64 torch reference and prr's own
`LessSelector.compensation` torch path, on fresh random state at odd sizes. CPU:
TRITON_INTERPRET=1 (set in conftest). GPU variants (-m gpu) at the 8B shape; run them with
TRITON_INTERPRET=0."""

from __future__ import annotations

import math
import os

import pytest
import torch
from prr.kernels.less import less_compensate_merge, less_compensation
from prr.kernels.reference_less import (
    less_compensate_merge_reference,
    less_compensation_reference,
    make_less_inputs,
    make_partials,
    query_log_features,
)

from prr.blocks import BlockSet
from prr.cache import PagedKVCache
from prr.selectors import LessSelector
from prr.selectors.base import Selection

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="needs a CUDA device and TRITON_INTERPRET=0",
)


def check_state(out, lse, ref_out, ref_lse, tol: float = 1e-5) -> None:
    """out [B, Hkv, G, D], lse [B, Hkv, G] against the reference: the same -inf pattern (dropped
    compensations), out exactly 0 there, relative-norm error of out per (row, KV head) and absolute
    error of lse below tol elsewhere."""
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert not out.isnan().any() and not lse.isnan().any()
    used = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), used), "dropped / used pattern differs"
    assert torch.all(out[~used] == 0)
    if used.any():
        assert (lse[used].double() - ref_lse[used].double()).abs().max() < tol
        err = (out.double() - ref_out.double()).flatten(2).norm(dim=-1) / ref_out.double().flatten(2).norm(dim=-1)
        assert err[used.any(-1)].max() < tol


@pytest.mark.parametrize(
    "group,head_dim,num_features,block_size,max_blocks,lengths,counts,capacity,q_dtype",
    [
        (1, 64, 13, 16, 7, [27, 100], None, 3, torch.float32),
        (3, 128, 24, 16, 8, [113, 61], None, 5, torch.float16),
        (4, 64, 64, 16, 70, [1110, 27], None, 32, torch.float32),
        (8, 64, 17, 64, 19, [1110, 1], None, 8, torch.bfloat16),
        (4, 64, 16, 16, 9, [61, 130], [2, 9], 9, torch.float32),  # row 1: every block selected -> dropped
        (2, 64, 16, 16, 9, [61, 130], [0, 2], 4, torch.float32),  # row 0: nothing selected: all of it
        (3, 64, 16, 32, 5, [0, 150], None, 4, torch.float32),  # an empty row: no compensation
    ],
)
def test_less_compensation_matches_reference(group, head_dim, num_features, block_size, max_blocks, lengths, counts,
                                             capacity, q_dtype):
    x = make_less_inputs(len(lengths), 2, group, head_dim, num_features, block_size, max_blocks, lengths, counts,
                         capacity, q_dtype, seed=group + num_features)
    out, lse = less_compensation(**x)
    check_state(out, lse, *less_compensation_reference(**x))
    if counts is not None and counts[0] == 0:  # no block selected: the totals themselves
        assert torch.isfinite(lse[0]).all()


def test_dropped_and_used_cases_occur():
    """The cases above exercise both outcomes: a row whose blocks are all selected is dropped."""
    x = make_less_inputs(2, 2, 4, 64, 16, 16, 9, [61, 130], [2, 9], 9, seed=20)
    _, lse = less_compensation(**x)
    assert torch.isfinite(lse[0]).all() and torch.isinf(lse[1]).all()


@pytest.mark.parametrize("m_block,d_block,c_block", [(16, 16, 1), (16, 64, 2), (32, 8, 16), (64, 64, 32)])
def test_tilings_give_the_same_state(m_block, d_block, c_block):
    x = make_less_inputs(2, 2, 3, 64, 40, 16, 21, [330, 200], None, 10, seed=4)
    out, lse = less_compensation(**x, m_block=m_block, d_block=d_block, c_block=c_block)
    check_state(out, lse, *less_compensation_reference(**x))


def test_given_query_log_features():
    """A trained map's log-features of q handed in (w=None) give the state the reference gives from them."""
    x = make_less_inputs(2, 2, 4, 64, 24, 16, 13, [200, 97], None, 6, seed=8)
    gen = torch.Generator().manual_seed(1)
    q_logits = (query_log_features(x["q"], x["w"], x["scale"]) + 0.3 * torch.randn(2, 2, 4, 24, generator=gen,
                                                                                     dtype=torch.float64)).float()
    w = x.pop("w")
    out, lse = less_compensation(**x, w=None, q_logits=q_logits)
    check_state(out, lse, *less_compensation_reference(**x, w=None, q_logits=q_logits))
    # and they are used: the random features give another state
    _, lse_random = less_compensation(**x, w=w)
    assert (lse_random - lse).abs().max() > 1e-3


def check_merged(out, lse, ref_out, ref_lse, tol: float) -> None:
    """The layer output [B, Hq, D] and its lse [B, Hq] against the reference: same -inf pattern,
    lse within tol, relative-norm error of out per (row, head) within tol."""
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert not out.float().isnan().any() and not lse.isnan().any()
    live = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), live)
    assert torch.all(out[~live] == 0)
    if live.any():
        assert (lse[live].double() - ref_lse[live].double()).abs().max() < tol
        err = (out.double() - ref_out.double()).norm(dim=-1) / ref_out.double().norm(dim=-1).clamp(min=1e-30)
        assert err[live].max() < tol


@pytest.mark.parametrize(
    "group,head_dim,num_features,block_size,max_blocks,lengths,counts,capacity,splits,empty,out_dtype",
    [
        (1, 64, 13, 16, 7, [27, 100], None, 3, 1, 0, torch.float32),  # a merged state (S = 1)
        (3, 128, 24, 16, 8, [113, 61], None, 5, 3, 1, torch.float32),
        (4, 64, 40, 32, 37, [1110, 27], None, 32, 5, 2, torch.float32),
        (8, 64, 17, 64, 19, [1110, 1], None, 8, 7, 0, torch.float32),
        (4, 64, 16, 16, 9, [61, 130], [2, 9], 9, 2, 1, torch.float32),  # row 1: dropped -> A's partials alone
        (2, 64, 16, 16, 9, [61, 130], [0, 2], 4, 3, 3, torch.float32),  # A empty (every split -inf): the estimate
        (3, 64, 16, 32, 5, [0, 150], None, 4, 2, 2, torch.float32),  # an empty row: -inf, out 0
        (4, 64, 24, 16, 21, [330, 113], None, 8, 4, 1, torch.float16),  # the model's dtype written
    ],
)
def test_less_compensate_merge_matches_reference(group, head_dim, num_features, block_size, max_blocks, lengths,
                                                 counts, capacity, splits, empty, out_dtype):
    """The one-launch layer output: A's split partials ⊕ the compensation, against merge_many + merge
    of the fp64 references."""
    x = make_less_inputs(len(lengths), 2, group, head_dim, num_features, block_size, max_blocks, lengths, counts,
                         capacity, seed=3 * group + num_features)
    part_out, part_lse = make_partials(len(lengths), 2 * group, splits, head_dim, empty, seed=splits)
    if splits == 1:
        part_out, part_lse = part_out.squeeze(2), part_lse.squeeze(2)  # [B, Hq, D]: a merged attention
    out, lse = less_compensate_merge(**x, part_out=part_out, part_lse=part_lse, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    ref_out, ref_lse = less_compensate_merge_reference(**x, part_out=part_out, part_lse=part_lse)
    check_merged(out, lse, ref_out, ref_lse, 1e-5 if out_dtype == torch.float32 else 2e-3)
    comp_lse = less_compensation_reference(**x)[1]
    if counts is not None and counts[1] == 9:  # the dropped compensation leaves A's merged partials
        assert torch.isinf(comp_lse[1]).all()
    if counts is not None and counts[0] == 0:  # nothing attended: the output is the estimate itself
        comp_out = less_compensation_reference(**x)[0]
        assert torch.allclose(out[0], comp_out[0].reshape(2 * group, head_dim), atol=1e-5)


def test_less_compensate_merge_given_query_log_features_and_errors():
    x = make_less_inputs(2, 2, 4, 64, 24, 16, 13, [200, 97], None, 6, seed=8)
    gen = torch.Generator().manual_seed(1)
    q_logits = (query_log_features(x["q"], x["w"], x["scale"]) + 0.3 * torch.randn(2, 2, 4, 24, generator=gen,
                                                                                     dtype=torch.float64)).float()
    x.pop("w")
    part_out, part_lse = make_partials(2, 8, 3, 64, 1, seed=2)
    out, lse = less_compensate_merge(**x, w=None, q_logits=q_logits, part_out=part_out, part_lse=part_lse)
    check_merged(out, lse, *less_compensate_merge_reference(**x, w=None, q_logits=q_logits, part_out=part_out,
                                                            part_lse=part_lse), 1e-5)
    with pytest.raises(ValueError, match="part_out must be fp32"):
        less_compensate_merge(**x, w=None, q_logits=q_logits, part_out=part_out[:, :4], part_lse=part_lse)
    with pytest.raises(ValueError, match="part_lse"):
        less_compensate_merge(**x, w=None, q_logits=q_logits, part_out=part_out, part_lse=part_lse[..., :2])
    with pytest.raises(ValueError, match="out_dtype"):
        less_compensate_merge(**x, w=None, q_logits=q_logits, part_out=part_out, part_lse=part_lse,
                              out_dtype=torch.int32)


def test_less_kernel_errors():
    x = make_less_inputs(1, 2, 2, 64, 8, 16, 4, None, None, 2)
    with pytest.raises(ValueError, match="exactly one of w"):
        less_compensation(**x, q_logits=torch.zeros(1, 2, 2, 8))
    with pytest.raises(ValueError, match="indices must be int32"):
        less_compensation(**{**x, "indices": x["indices"].long()})
    with pytest.raises(ValueError, match="offset_tot"):
        less_compensation(**{**x, "offset_tot": x["offset_tot"][..., :5]})
    with pytest.raises(ValueError, match="small \\(s_b\\)"):
        less_compensation(**{**x, "small": x["small"].half()})
    with pytest.raises(ValueError, match="block_size=12"):
        less_compensation(**{**x, "block_size": 12})
    with pytest.raises(ValueError, match="m_block=8"):
        less_compensation(**x, m_block=8)


def less_cache(batch: int, hkv: int, d: int, bs: int, tokens: int, appended: int, selector: LessSelector,
               seed: int) -> PagedKVCache:
    """A cache of `tokens` prefilled tokens and `appended` decode tokens, its LESS metadata built by
    the selector's own update_metadata / append_metadata (torch under both backends)."""
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, batch, hkv, d, bs, tokens + appended + 8)
    cache.append(0, torch.randn(batch, hkv, tokens, d, generator=gen) * 2, torch.randn(batch, hkv, tokens, d, generator=gen))
    selector.update_metadata(cache, 0, 0, tokens)
    for pos in range(tokens, tokens + appended):
        cache.append(0, torch.randn(batch, hkv, 1, d, generator=gen) * 2, torch.randn(batch, hkv, 1, d, generator=gen))
        selector.append_metadata(cache, 0, torch.full((batch,), pos, dtype=torch.int64))
    return cache


@pytest.mark.parametrize("group,center_keys,orthogonal", [(1, True, True), (3, False, True), (4, True, False)])
def test_less_selector_triton_compensation_equals_torch(group, center_keys, orthogonal):
    """LessSelector.compensation on both backends over a ragged batch, for the selector's own A
    (Quest's kernels on the Triton side): the same A, states within fp32 tolerance."""
    hkv, d, bs = 2, 64, 16
    kw = dict(topk_blocks=4, num_features=24, center_keys=center_keys, orthogonal=orthogonal, seed=3)
    torch_sel, triton_sel = LessSelector(**kw), LessSelector(**kw)
    assert triton_sel.set_backend("triton") == "triton"
    cache = less_cache(2, hkv, d, bs, 150, 3, torch_sel, seed=group)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, hkv, group, d, generator=gen)
    lengths = torch.tensor([153, 90], dtype=torch.int32)
    want_sel = torch_sel.select(q, cache, 0, lengths)
    got_sel = triton_sel.select(q, cache, 0, lengths, num_blocks=(lengths + bs - 1) // bs)
    assert torch.equal(got_sel.blocks.indices, want_sel.blocks.indices)
    want = torch_sel.compensation(q, cache, 0, want_sel, lengths)
    for length in (lengths, lengths.long()):
        got = triton_sel.compensation(q, cache, 0, got_sel, length)
        check_state(got.out, got.lse, want.out, want.lse)
    assert torch.isfinite(want.lse).all()  # a compensation that is used
    # every block selected: dropped on both
    full = BlockSet(torch.arange(10, dtype=torch.int32).expand(2, hkv, 10).contiguous(),
                    torch.tensor([[10, 10], [6, 6]], dtype=torch.int32))
    want = torch_sel.compensation(q, cache, 0, Selection(full, want_sel.scores), lengths)
    got = triton_sel.compensation(q, cache, 0, Selection(full, want_sel.scores), lengths)
    check_state(got.out, got.lse, want.out, want.lse)
    assert torch.isinf(got.lse).all()


def test_less_trained_map_compensation_equals_torch(monkeypatch):
    """feature_map=trained under backend triton: the map's query branch (a torch op) hands its
    log-features to the kernel; the state equals the torch path's (an untrained map of the real
    class stands in for `make train-less`'s file)."""
    import prr.selectors.less_training as training

    fmap = training.TrainedFeatureMap(1, 64, 24, hidden=16, seed=4)
    monkeypatch.setattr(training, "load_trained_map", lambda model, m: fmap)
    kw = dict(topk_blocks=4, num_features=24, feature_map="trained")
    torch_sel, triton_sel = LessSelector(**kw), LessSelector(**kw)
    assert triton_sel.set_backend("triton") == "triton"
    cache = less_cache(2, 2, 64, 16, 150, 2, torch_sel, seed=9)
    q = torch.randn(2, 2, 3, 64, generator=torch.Generator().manual_seed(2))
    lengths = torch.tensor([152, 77], dtype=torch.int32)
    selection = torch_sel.select(q, cache, 0, lengths)
    with torch.no_grad():
        want = torch_sel.compensation(q, cache, 0, selection, lengths)
        got = triton_sel.compensation(q, cache, 0, selection, lengths)
    assert torch.isfinite(want.lse).any()
    check_state(got.out, got.lse, want.out, want.lse)


def test_less_backends():
    assert LessSelector(topk_blocks=4).triton_problems() == []
    assert LessSelector(topk_blocks=4, scores="features").triton_problems() is None
    assert LessSelector(topk_blocks=4, scores="features").set_backend("triton") == "torch"
    union = LessSelector(topk_blocks=4, gqa_reduce="union")
    assert union.triton_problems() and union.set_backend("triton") == "torch"


@pytest.mark.slow  # 35-80 s under the interpreter (make test-full); the kernels vs torch run in make test
def test_less_triton_in_the_engine_equals_eager(tmp_path, monkeypatch):
    """The graph engine with backend=triton (Quest's selection and the compensation kernel under
    the interpreter) decodes the eager runtime's tokens with the same hit rate and overlap
    (tests/test_one_engine.py's check), both runtimes compensating through the kernel."""
    import prr.kernels.less as launcher

    from tests.test_one_engine import check_same_algorithm

    calls = []
    kernel = launcher.less_compensate_merge  # both runtimes merge through the engine's `compensated`
    monkeypatch.setattr(launcher, "less_compensate_merge", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    check_same_algorithm(tmp_path, ("less", "ema_calibrated", "runtime.repair_mode=superset", "backend=triton"), [])
    assert len(calls) >= 2 * 16


# --- the decode token's metadata update (less_append) ---------------------------------------------

STATE = ("less_S", "less_s", "less_c", "less_S_tot", "less_s_tot", "less_c_tot")


def check_slots(got: dict, want: dict, tol: float) -> None:
    """The LESS state tensors: same dtype, shape and -inf pattern; relative-norm error below tol."""
    for name in STATE:
        x, y = got[name], want[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(torch.isfinite(x), torch.isfinite(y)), name
        finite = torch.isfinite(y)
        assert rel_err(x[finite], y[finite]) < tol, name


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("group_heads,block_size,num_features,summary_dtype",
                         [(2, 16, 24, "float32"), (3, 32, 16, "float32"), (2, 16, 40, "bfloat16"),
                          (3, 64, 33, "float32"), (2, 64, 32, "bfloat16")])
def test_less_append_matches_reference(group_heads, block_size, num_features, summary_dtype):
    """One token per row at ragged positions (one starts a block, one lands mid-block): the kernel's
    totals and rewritten block summaries equal the fp64 reference's."""
    from prr.kernels.less import less_append
    from prr.kernels.reference_less import less_append_reference

    sel = LessSelector(topk_blocks=4, num_features=num_features, summary_dtype=summary_dtype, seed=2)
    gen = torch.Generator().manual_seed(group_heads)
    cache = PagedKVCache(1, 2, group_heads, 64, block_size, 160 + block_size)
    cache.append(0, torch.randn(2, group_heads, 150, 64, generator=gen) * 2,
                 torch.randn(2, group_heads, 150, 64, generator=gen))
    sel.update_metadata(cache, 0, 0, 150)
    start = 4 * block_size if block_size < 64 else 2 * block_size
    positions = torch.tensor([150, start], dtype=torch.int32)  # row 1 overwrites the token starting a block
    for b, p in enumerate(positions.tolist()):
        cache.keys[0][b, :, p] = torch.randn(group_heads, 64, generator=gen) * 2
        cache.values[0][b, :, p] = torch.randn(group_heads, 64, generator=gen)
    slots = cache.metadata[0]
    args = (cache.keys[0], cache.values[0], positions, block_size, slots["less_w"], slots["less_center"])
    want = less_append_reference(*args, *(slots[n] for n in STATE), 1 / 8)
    got = {n: slots[n].clone() for n in STATE}
    less_append(*args, *(got[n] for n in STATE), 1 / 8)
    check_slots(got, {n: want[k] for n, k in zip(STATE, ("big", "small", "offset", "big_tot", "small_tot",
                                                           "offset_tot"), strict=True)},
                1e-5 if summary_dtype == "float32" else 1e-2)


def check_incremental_append(batch: int, hkv: int, d: int, block_size: int, num_features: int, summary_dtype: str,
                             prefills: tuple[int, ...], steps: int, device: str) -> float:
    """`steps` decode tokens per row (ragged prefills, crossing block boundaries) through less_append's
    incremental mode (with the open block's slots) against the fp64 re-read reference after every
    token: the stored state within 1e-5 (fp32 summaries; bf16: the same value rounded once, within a
    bf16 ulp: 1e-2), and the open block's fp32 sums within 1e-5 of the reference's fp32 summaries of
    the block (so bf16 storage rounds once, never accumulates). -> the largest fp32 error seen."""
    from prr.kernels.less import less_append
    from prr.kernels.reference_less import less_append_reference

    sel = LessSelector(topk_blocks=4, num_features=num_features, summary_dtype=summary_dtype, seed=2)
    gen = torch.Generator().manual_seed(block_size + num_features)
    tokens = max(prefills) + steps
    cache = PagedKVCache(1, batch, hkv, d, block_size, tokens + block_size, device=device)
    cache.append(0, (torch.randn(batch, hkv, max(prefills), d, generator=gen) * 2).to(device),
                 torch.randn(batch, hkv, max(prefills), d, generator=gen).to(device))
    for row, length in enumerate(prefills):
        sel.update_metadata(cache.row(row), 0, 0, length)
    slots, scale = cache.metadata[0], d ** -0.5
    want = {n: slots[n].cpu().clone() for n in STATE}
    want32 = {n: want[n].float() for n in ("less_S", "less_s")}  # the reference's block sums before rounding
    worst = 0.0
    for step in range(steps):
        positions = torch.tensor([n + step for n in prefills], dtype=torch.int32)
        for b, p in enumerate(positions.tolist()):
            cache.keys[0][b, :, p] = (torch.randn(hkv, d, generator=gen) * 2).to(device)
            cache.values[0][b, :, p] = torch.randn(hkv, d, generator=gen).to(device)
        args = (cache.keys[0], cache.values[0], positions.to(device), block_size, slots["less_w"], slots["less_center"])
        less_append(*args, *(slots[n] for n in STATE), scale, big_open=slots["less_S_open"],
                    small_open=slots["less_s_open"])
        cpu = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
        ref = less_append_reference(*cpu, *(want[n] for n in STATE), scale)
        ref32 = less_append_reference(*cpu, want32["less_S"], want32["less_s"], *(want[n] for n in STATE[2:]), scale)
        want = {n: ref[k] for n, k in zip(STATE, ("big", "small", "offset", "big_tot", "small_tot", "offset_tot"),
                                          strict=True)}
        want32 = {"less_S": ref32["big"], "less_s": ref32["small"]}
        check_slots({n: slots[n].cpu() for n in STATE}, want, 1e-5 if summary_dtype == "float32" else 1e-2)
        rows = torch.arange(batch)
        blocks = positions.long() // block_size
        for name, open_name in (("less_S", "less_S_open"), ("less_s", "less_s_open")):
            err = rel_err(slots[open_name].cpu(), want32[name][rows, :, blocks])
            assert err < 1e-5, (step, name, err)
            worst = max(worst, err)
    return worst


@pytest.mark.parametrize("block_size,num_features,summary_dtype,hkv,prefills,steps", [
    pytest.param(16, 32, "float32", 3, (150, 61), 20, marks=pytest.mark.slow), (16, 32, "bfloat16", 1, (77, 32), 18), (64, 32, "bfloat16", 3, (120, 64), 10),
    (64, 17, "float32", 1, (191, 1), 3)])
def test_less_append_incremental_matches_the_reread(block_size, num_features, summary_dtype, hkv, prefills, steps):
    """The incremental summary update (O(m·D) per token) equals the fp64 re-read of the block within
    fp32 rounding at odd sizes (odd KV head counts and m, a row starting a block, ragged rows)."""
    assert check_incremental_append(2, hkv, 64, block_size, num_features, summary_dtype, prefills, steps, "cpu") < 1e-5


def test_less_append_open_slots_come_together():
    from prr.kernels.less import less_append

    sel = LessSelector(topk_blocks=4, num_features=16)
    cache = PagedKVCache(1, 1, 1, 64, 16, 64)
    cache.append(0, torch.randn(1, 1, 20, 64), torch.randn(1, 1, 20, 64))
    sel.update_metadata(cache, 0, 0, 20)
    s = cache.metadata[0]
    args = (cache.keys[0], cache.values[0], torch.tensor([19]), 16, s["less_w"], s["less_center"],
            *(s[n] for n in STATE), 0.125)
    with pytest.raises(ValueError, match="big_open and small_open together"):
        less_append(*args, big_open=s["less_S_open"])
    with pytest.raises(ValueError, match="small_open"):
        less_append(*args, big_open=s["less_S_open"], small_open=s["less_s_open"][..., :3])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size,summary_dtype", [(16, "bfloat16"), (64, "bfloat16"), (64, "float32")])
def test_gpu_less_append_incremental_matches_the_reread(block_size, summary_dtype):
    """The 8B shape's KV heads and head (8, 128), m = 32, 4K-token ragged prefills, 2 blocks of steps."""
    check_incremental_append(2, 8, 128, block_size, 32, summary_dtype, (4000, 3 * block_size - 1), 2 * block_size + 3,
                             "cuda")


@pytest.mark.parametrize("summary_dtype", ["float32", "bfloat16"])
def test_less_selector_appends_alike_on_both_backends(summary_dtype):
    """20 decode tokens (crossing block boundaries, ragged rows: prefills of 120 and 97 tokens) through
    append_metadata on both backends: the same LESS state (bf16 storage: within a bf16 ulp). The
    kernel's summaries are incremental (from the open block's fp32 sums), the torch path's re-read
    the block: fp32 rounding apart."""
    kw = dict(topk_blocks=4, num_features=24, summary_dtype=summary_dtype, seed=1)
    torch_sel, triton_sel = LessSelector(**kw), LessSelector(**kw)
    triton_sel.set_backend("triton")
    caches = []
    for sel in (torch_sel, triton_sel):
        gen = torch.Generator().manual_seed(5)
        cache = PagedKVCache(1, 2, 2, 64, 16, 160)
        cache.append(0, torch.randn(2, 2, 120, 64, generator=gen) * 2, torch.randn(2, 2, 120, 64, generator=gen))
        for row, length in enumerate((120, 97)):  # each row's prefill ends where its decode starts
            sel.update_metadata(cache.row(row), 0, 0, length)
        caches.append(cache)
    gen = torch.Generator().manual_seed(6)
    for step in range(20):
        k, v = torch.randn(2, 2, 64, generator=gen) * 2, torch.randn(2, 2, 64, generator=gen)
        positions = torch.tensor([120 + step, 97 + step], dtype=torch.int64)
        for cache, sel in zip(caches, (torch_sel, triton_sel), strict=True):
            for b in range(2):
                cache.keys[0][b, :, positions[b]] = k[b]
                cache.values[0][b, :, positions[b]] = v[b]
            sel.append_metadata(cache, 0, positions)
    check_slots(caches[1].metadata[0], caches[0].metadata[0], 1e-5 if summary_dtype == "float32" else 1e-2)
    for name in ("quest_key_max", "quest_key_min"):  # updated in less_append's launch: exact
        assert torch.equal(caches[1].metadata[0][name], caches[0].metadata[0][name]), name


@pytest.mark.parametrize("block_size", [16, 64])
def test_less_append_updates_quest_metadata(block_size):
    """key_max / key_min handed to less_append: its block's running max / min take the token (the
    first token of a block replaces stale contents), as Quest's update; the LESS state equals a
    launch without them."""
    from prr.kernels.less import less_append

    sel = LessSelector(topk_blocks=4, num_features=20, seed=4)
    gen = torch.Generator().manual_seed(block_size)
    cache = PagedKVCache(1, 3, 2, 32, block_size, 6 * block_size)
    cache.append(0, torch.randn(3, 2, 3 * block_size + 5, 32, generator=gen), torch.randn(3, 2, 3 * block_size + 5, 32,
                                                                                        generator=gen))
    sel.update_metadata(cache, 0, 0, 3 * block_size + 5)
    positions = torch.tensor([3 * block_size + 5, 3 * block_size, 2], dtype=torch.int64)  # mid, first of a block, early
    key_max, key_min = sel.metadata(cache, 0)
    key_max[1, :, 3], key_min[1, :, 3] = 50.0, -50.0  # stale contents of the block row 1 starts
    for b, p in enumerate(positions.tolist()):
        cache.keys[0][b, :, p] = torch.randn(2, 32, generator=gen) * 3
        cache.values[0][b, :, p] = torch.randn(2, 32, generator=gen)
    slots = cache.metadata[0]
    args = (cache.keys[0], cache.values[0], positions, block_size, slots["less_w"], slots["less_center"])
    alone = {n: slots[n].clone() for n in STATE}
    less_append(*args, *(alone[n] for n in STATE), 32 ** -0.5)
    got = {n: slots[n].clone() for n in STATE}
    got_max, got_min = key_max.clone(), key_min.clone()
    less_append(*args, *(got[n] for n in STATE), 32 ** -0.5, got_max, got_min)
    for name in STATE:
        assert torch.equal(got[name], alone[name]), name
    # Quest's update (prr.kernels.quest.quest_update): the running max / min with the token, the token
    # alone when it starts its block (row 1: the stale ±50 dropped)
    for b, p in enumerate(positions.tolist()):
        blk, k_new = p // block_size, cache.keys[0][b, :, p]
        first = p % block_size == 0
        assert torch.equal(got_max[b, :, blk], k_new if first else torch.maximum(key_max[b, :, blk], k_new)), b
        assert torch.equal(got_min[b, :, blk], k_new if first else torch.minimum(key_min[b, :, blk], k_new)), b
    other = torch.ones_like(got_max, dtype=torch.bool)
    other[torch.arange(3), :, positions // block_size] = False
    assert torch.equal(got_max[other], key_max[other]) and torch.equal(got_min[other], key_min[other])
    with pytest.raises(ValueError, match="together"):
        less_append(*args, *(got[n] for n in STATE), 32 ** -0.5, got_max, None)
    with pytest.raises(ValueError, match="d_block=8"):
        less_append(*args, *(got[n] for n in STATE), 32 ** -0.5, d_block=8)


# --- compact state (bf16 summaries) and memory ---------------------------------------------------


def test_bf16_summaries_match_reference():
    """The kernel reads bf16 S_b, s_b (fp32 arithmetic): equal to the reference over the same values."""
    x = make_less_inputs(2, 2, 4, 64, 24, 16, 21, [330, 113], None, 8, seed=12)
    x = {**x, "big": x["big"].bfloat16(), "small": x["small"].bfloat16()}
    out, lse = less_compensation(**x)
    check_state(out, lse, *less_compensation_reference(**x))


@pytest.mark.parametrize("group", [1, 4])
def test_bf16_summaries_both_backends_and_their_cost(group):
    """summary_dtype=bfloat16: the torch path and the kernel agree (same stored values); against
    fp32 summaries the state moves by bf16 rounding only (measured here: lse within 1e-2, out
    within 1e-2 relative; LESS's own estimation error is far larger)."""
    hkv, d, bs = 2, 64, 16
    kw = dict(topk_blocks=4, num_features=24, seed=3)
    fp32_sel = LessSelector(**kw)
    bf16_torch, bf16_triton = LessSelector(**kw, summary_dtype="bfloat16"), LessSelector(**kw, summary_dtype="bfloat16")
    bf16_triton.set_backend("triton")
    cache32 = less_cache(2, hkv, d, bs, 150, 3, fp32_sel, seed=group)
    cache16 = less_cache(2, hkv, d, bs, 150, 3, bf16_torch, seed=group)
    assert cache16.metadata[0]["less_S"].dtype == torch.bfloat16 and cache16.metadata[0]["less_c"].dtype == torch.float32
    q = torch.randn(2, hkv, group, d, generator=torch.Generator().manual_seed(7))
    lengths = torch.tensor([153, 90], dtype=torch.int32)
    selection = fp32_sel.select(q, cache32, 0, lengths)
    want16 = bf16_torch.compensation(q, cache16, 0, selection, lengths)
    got16 = bf16_triton.compensation(q, cache16, 0, selection, lengths)
    check_state(got16.out, got16.lse, want16.out, want16.lse)
    want32 = fp32_sel.compensation(q, cache32, 0, selection, lengths)
    used = torch.isfinite(want32.lse)
    assert used.all() and torch.equal(torch.isfinite(want16.lse), used)
    assert (want16.lse - want32.lse).abs().max() < 1e-2
    assert ((want16.out - want32.out).norm() / want32.out.norm()) < 1e-2


def test_bad_summary_dtype():
    with pytest.raises(ValueError, match="summary_dtype='float16' is not one of"):
        LessSelector(topk_blocks=4, summary_dtype="float16")


@pytest.mark.parametrize("summary_dtype", ["float32", "bfloat16"])
def test_state_bytes_is_what_the_cache_holds(summary_dtype):
    sel = LessSelector(topk_blocks=4, num_features=24, summary_dtype=summary_dtype, dense_layers=[1])
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(3, 2, 2, 64, 16, 100)
    for layer in range(3):
        cache.append(layer, torch.randn(2, 2, 70, 64, generator=gen), torch.randn(2, 2, 70, 64, generator=gen))
        sel.update_metadata(cache, layer, 0, 70)
    held = sum(t.numel() * t.element_size() for name, t in cache.metadata[0].items() if name != "less_w")
    assert held == sel.state_bytes(2, 2, 64, cache.max_blocks, cache.dtype)
    assert not cache.metadata[1]  # a dense layer keeps nothing
    report = sel.memory_report(cache)
    assert report["sparse_layers"] == 2 and report["less_state_gib"] * 2**30 == 2 * held
    assert report["less_over_kv"] == pytest.approx(2 * held / (2 * 3 * cache.keys[0].numel() * 4))
    # the 8B shape at 32K, block 16, bf16 cache, m = 64: fp32 summaries ~4.1x the KV cache, bf16 ~2.1x
    big = LessSelector(topk_blocks=4, num_features=64, summary_dtype=summary_dtype)
    ratio = big.state_bytes(1, 8, 128, 2048, torch.bfloat16) / (2 * 8 * 32768 * 128 * 2)
    assert ratio == pytest.approx(4.12 if summary_dtype == "float32" else 2.11, abs=0.01)


def test_conf_default_state_fits_in_one_and_a_half_kv_caches():
    """conf/selector/less.yaml's m and summary dtype at the 8B shape (32 layers, layers 0-1 dense, 8 KV
    heads, head 128, bf16 cache, batch 1), 32K and 128K, blocks 16 and 64: the state is at most 1.5x
    the KV cache (issue 33); m = 32 in bf16 is 1.02x at 32K / block 16."""
    from pathlib import Path

    from omegaconf import OmegaConf

    conf = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf/selector/less.yaml")
    sel = LessSelector(topk_blocks=4, num_features=conf.num_features, summary_dtype=conf.summary_dtype)
    for context in (32768, 131072):
        for block in (16, 64):
            state = 30 * sel.state_bytes(1, 8, 128, context // block, torch.bfloat16)
            assert state / (2 * 32 * 8 * context * 128 * 2) <= 1.5, (context, block)
    assert 30 * sel.state_bytes(1, 8, 128, 2048, torch.bfloat16) / (2 * 32 * 8 * 32768 * 128 * 2) == pytest.approx(
        1.02, abs=0.01)


def test_a_state_that_cannot_fit_is_refused_with_the_numbers(monkeypatch):
    import prr.selectors.less as less_module

    monkeypatch.setattr(less_module, "free_device_memory", lambda device: 10_000)
    sel = LessSelector(topk_blocks=4, num_features=24)
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(2, 1, 2, 64, 16, 100)
    cache.append(0, torch.randn(1, 2, 70, 64, generator=gen), torch.randn(1, 2, 70, 64, generator=gen))
    with pytest.raises(MemoryError, match=r"selector=less needs 0\.00 GiB for its state over 2 sparse layers "
                                          r"\(num_features=24, summary_dtype=float32.*GiB is free.*summary_dtype=bfloat16"):
        sel.update_metadata(cache, 0, 0, 70)
    assert "less_S" not in cache.metadata[0]  # refused before any of the state is allocated
    monkeypatch.setattr(less_module, "free_device_memory", lambda device: 1 << 40)
    sel.update_metadata(cache, 0, 0, 70)
    assert "less_S" in cache.metadata[0]


# --- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size,capacity", [(16, 128), (64, 32)])
def test_gpu_less_compensation_8b_shape(block_size, capacity):
    """8 KV heads of 4 query heads, head 128, m = 64, bf16 q, 8K tokens, ragged batch of 2."""
    x = make_less_inputs(2, 8, 4, 128, 64, block_size, 8192 // block_size, [8192, 3001], None, capacity,
                         torch.bfloat16, seed=5, device="cuda")
    out, lse = less_compensation(**x)
    ref = less_compensation_reference(**{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in x.items()})
    check_state(out.cpu(), lse.cpu(), *ref)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size,capacity,num_features,splits,out_dtype",
                         [(16, 32, 32, 8, torch.bfloat16), (64, 32, 64, 5, torch.float32), (16, 128, 32, 16, torch.float32)])
def test_gpu_less_compensate_merge_8b_shape(block_size, capacity, num_features, splits, out_dtype):
    """The one-launch layer output at the 8B shape (8 KV heads of 4, head 128), bf16 q and summaries."""
    x = make_less_inputs(2, 8, 4, 128, num_features, block_size, 8192 // block_size, [8192, 3001], None, capacity,
                         torch.bfloat16, seed=6, device="cuda")
    x = {**x, "big": x["big"].bfloat16(), "small": x["small"].bfloat16()}
    part_out, part_lse = make_partials(2, 32, splits, 128, 1, seed=splits)
    out, lse = less_compensate_merge(**x, part_out=part_out.cuda(), part_lse=part_lse.cuda(), out_dtype=out_dtype)
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in x.items()}
    ref_out, ref_lse = less_compensate_merge_reference(**cpu, part_out=part_out, part_lse=part_lse)
    check_merged(out.cpu(), lse.cpu(), ref_out, ref_lse, 1e-5 if out_dtype == torch.float32 else 1e-2)


def check_engine_ops(hkv: int, group: int, d: int, block_size: int, num_features: int, tokens: int, topk: int,
                     device: str, capture: bool) -> None:
    """The decode step's LESS ops as the engine runs them under backend triton (append_metadata: one
    launch with Quest's max / min; selection; compensated: one launch, A's split partials merged),
    optionally replayed from a CUDA graph, against the torch backend's: identical A, identical
    Quest metadata, fp32 output within 1e-5."""
    kw = dict(topk_blocks=topk, num_features=num_features, seed=1)
    torch_sel, triton_sel = LessSelector(**kw), LessSelector(**kw)
    triton_sel.set_backend("triton")
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(1, hkv, tokens + 1, d, generator=gen) * 2
    values = torch.randn(1, hkv, tokens + 1, d, generator=gen)
    caches = []
    for sel in (torch_sel, triton_sel, triton_sel):  # the third: the kernels' warm-up (compile) before capture
        cache = PagedKVCache(1, 1, hkv, d, block_size, tokens + block_size, device=device)
        cache.append(0, keys[:, :, :tokens].to(device), values[:, :, :tokens].to(device))
        sel.update_metadata(cache, 0, 0, tokens)
        cache.append(0, keys[:, :, tokens:].to(device), values[:, :, tokens:].to(device))
        caches.append(cache)
    q = torch.randn(1, hkv, group, d, generator=gen).to(device)
    pos = torch.tensor([tokens], dtype=torch.int32, device=device)
    lengths = pos + 1
    nb = ((lengths + block_size - 1) // block_size).to(torch.int32)
    parts = tuple(t.to(device) for t in make_partials(1, hkv * group, 3, d, 1, seed=2))

    def step(sel, cache, **select_kw):
        sel.append_metadata(cache, 0, pos)
        selection = sel.select(q, cache, 0, lengths, **select_kw)
        return selection, sel.compensated(q, cache, 0, selection, lengths, *parts, torch.float32)

    want_sel, want = step(torch_sel, caches[0])
    if capture:
        step(triton_sel, caches[2], num_blocks=nb)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got_sel, got = step(triton_sel, caches[1], num_blocks=nb)
        graph.replay()
        torch.cuda.synchronize()
    else:
        got_sel, got = step(triton_sel, caches[1], num_blocks=nb)
    assert torch.equal(got_sel.blocks.indices, want_sel.blocks.indices)
    assert torch.equal(got_sel.blocks.count, want_sel.blocks.count)
    for name in ("quest_key_max", "quest_key_min"):
        assert torch.equal(caches[1].metadata[0][name], caches[0].metadata[0][name]), name
    err = ((got.double() - want.double()).norm(dim=-1) / want.double().norm(dim=-1)).max()
    assert got.dtype == torch.float32 and err < 1e-5, float(err)


@pytest.mark.parametrize("group,block_size,num_features,tokens", [(3, 16, 24, 250), (4, 32, 17, 301), (1, 64, 16, 300)])
def test_less_engine_ops_equal_torch(group, block_size, num_features, tokens):
    check_engine_ops(2, group, 64, block_size, num_features, tokens, 4, "cpu", capture=False)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size,num_features", [(16, 32), (64, 32), (64, 64)])
def test_gpu_less_engine_ops_captured_equal_torch(block_size, num_features):
    """At the 8B shape (8 KV heads of 4, head 128), 4K tokens, top-K 32, from a CUDA graph."""
    check_engine_ops(8, 4, 128, block_size, num_features, 4000, 32, "cuda", capture=True)


@pytest.mark.gpu
@gpu
def test_gpu_less_selector_captured_equals_torch():
    """Selection and compensation replayed from a CUDA graph equal the torch path's, fp32."""
    hkv, group, d, bs = 8, 4, 128, 16
    kw = dict(topk_blocks=32, num_features=64, seed=1)
    torch_sel, triton_sel = LessSelector(**kw), LessSelector(**kw)
    triton_sel.set_backend("triton")
    gen = torch.Generator().manual_seed(3)
    cache = PagedKVCache(1, 1, hkv, d, bs, 4096, device="cuda")
    cache.append(0, (torch.randn(1, hkv, 4000, d, generator=gen) * 2).cuda(), torch.randn(1, hkv, 4000, d, generator=gen).cuda())
    torch_sel.update_metadata(cache, 0, 0, 4000)
    q = torch.randn(1, hkv, group, d, generator=gen).cuda()
    lengths = torch.tensor([4000], dtype=torch.int32, device="cuda")
    nb = ((lengths + bs - 1) // bs).to(torch.int32)
    want_sel = torch_sel.select(q, cache, 0, lengths)
    want = torch_sel.compensation(q, cache, 0, want_sel, lengths)
    triton_sel.compensation(q, cache, 0, triton_sel.select(q, cache, 0, lengths, num_blocks=nb), lengths)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got_sel = triton_sel.select(q, cache, 0, lengths, num_blocks=nb)
        got = triton_sel.compensation(q, cache, 0, got_sel, lengths)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got_sel.blocks.indices, want_sel.blocks.indices)
    check_state(got.out.cpu(), got.lse.cpu(), want.out.cpu(), want.lse.cpu())
    assert math.isfinite(float(got.lse.min()))


@pytest.mark.slow  # the kernels under TRITON_INTERPRET=1
def test_less_ragged_batch_on_the_triton_backend():
    """The graph engine on a ragged batch with LESS's kernels (Quest's selection, the compensation)
    decodes what each row decodes alone (tests/test_ragged_batch.py's check; fp32 summaries: its
    end-of-run metadata tolerance is for fp32, bf16 storage turns the batched projections' rounding
    into whole bf16 ulps there)."""
    from prr.runtime.graph_decode import StaticPlan
    from tests.test_ragged_batch import CONFIG64, LENGTHS, check_rows, decode

    plan = StaticPlan(variant="prr", predicted_blocks=2, block_size=16, count_hits=True)

    def run(rows):
        return decode(plan, rows, lambda: LessSelector(topk_blocks=3, sink_blocks=1, dense_layers=(0,), num_features=16),
                      "ema_membership", backend="triton", config=CONFIG64)

    check_rows(run([0, 1, 2]), [run([b]) for b in range(len(LENGTHS))])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size,summary_dtype,num_features",
                         [(16, "float32", 64), (64, "bfloat16", 64), (64, "float32", 32), (16, "bfloat16", 32)])
def test_gpu_less_append_matches_reference(block_size, summary_dtype, num_features):
    """8 KV heads, head 128, bf16 cache, 4K tokens then one token per row (ragged)."""
    from prr.kernels.less import less_append
    from prr.kernels.reference_less import less_append_reference

    sel = LessSelector(topk_blocks=8, num_features=num_features, summary_dtype=summary_dtype)
    gen = torch.Generator().manual_seed(4)
    cache = PagedKVCache(1, 2, 8, 128, block_size, 4096 + block_size, dtype=torch.bfloat16, device="cuda")
    cache.append(0, (torch.randn(2, 8, 4000, 128, generator=gen) * 2).cuda(), torch.randn(2, 8, 4000, 128, generator=gen).cuda())
    sel.update_metadata(cache, 0, 0, 4000)
    positions = torch.tensor([4000, 3 * block_size], dtype=torch.int32, device="cuda")
    slots = cache.metadata[0]
    args = (cache.keys[0], cache.values[0], positions, block_size, slots["less_w"], slots["less_center"])
    want = less_append_reference(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args),
                                 *(slots[n].cpu() for n in STATE), 128 ** -0.5)
    got = {n: slots[n].clone() for n in STATE}
    less_append(*args, *(got[n] for n in STATE), 128 ** -0.5)
    check_slots({n: t.cpu() for n, t in got.items()},
                {n: want[k] for n, k in zip(STATE, ("big", "small", "offset", "big_tot", "small_tot", "offset_tot"),
                                            strict=True)}, 1e-5 if summary_dtype == "float32" else 1e-2)
