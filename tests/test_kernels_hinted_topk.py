"""Hinted exact top-k (`prr.kernels.hinted_topk.hinted_topk_select`) against its step-by-step torch
reference (`hinted_topk_reference`: indices, counts, next hint and the rounds each row ran),
against the unhinted kernel `topk_select` bit for bit, and against `topk_select_reference`, on fresh
random inputs at odd sizes, with hints exact, too high, too low and garbage (±inf, NaN, ±FLT_MAX).
CPU: TRITON_INTERPRET=1 (set in conftest; sizes kept small). The GPU variants (-m gpu) run at real
sizes with TRITON_INTERPRET=0."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from prr.kernels import hinted_topk as hinted_launcher
from prr.kernels.hinted_topk import DEFAULT_ROUNDS, hint_candidate_cap, hinted_topk_select
from prr.kernels.reference_hinted_topk import (
    hinted_top_k_blocks,
    hinted_topk_reference,
    hinted_topk_select_reference,
    key_scores,
    kth_scores,
    make_hinted_scores,
    score_keys,
    topk_overlap,
)
from prr.kernels.reference_selection import (
    forced_scores,
    make_topk_scores,
    top_k_blocks,
    topk_select_reference,
)
from prr.kernels.topk import MAX_ROW_BLOCK, topk_select

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="needs a CUDA device and TRITON_INTERPRET=0",
)
FLT_MAX = 3.4028234663852886e38


def hints_of(kind: str, previous: torch.Tensor, current: torch.Tensor, k: int) -> torch.Tensor:
    """[B, Hkv] fp32 hints: exact (the current k-th score), previous (the previous step's k-th
    score), high / low (10x past the current k-th score either way), or one garbage value per row,
    cycling through +inf, -inf, NaN, FLT_MAX, -FLT_MAX, 0."""
    kth = kth_scores(current, k)
    if kind == "exact":
        return kth
    if kind == "previous":
        return kth_scores(previous, k)
    if kind == "high":
        return kth.abs() * 10.0 + 1.0
    if kind == "low":
        return -kth.abs() * 10.0 - 1.0
    pool = torch.tensor([float("inf"), float("-inf"), float("nan"), FLT_MAX, -FLT_MAX, 0.0])
    return pool[torch.arange(kth.numel()) % len(pool)].view_as(kth).contiguous()


def check_hinted(scores, k, num_blocks, hint, sink, recent, *, rounds=DEFAULT_ROUNDS, cap=None, tiled=False):
    """Kernel == step-by-step reference (all four outputs) == unhinted kernel == torch reference.
    -> the path [B, Hkv] (rounds run; -1: full-row fallback)."""
    guess = hint.clone()
    path = torch.full(hint.shape, -7, dtype=torch.int32)
    idx, cnt = hinted_topk_select(scores, k, num_blocks, hint, sink, recent, rounds=rounds, candidate_cap=cap,
                                  path=path)
    used_cap = min(cap or hint_candidate_cap(min(k, scores.shape[-1]), scores.shape[-1]),
                   1 << max(scores.shape[-1] - 1, 0).bit_length())
    ref_idx, ref_cnt, ref_hint, ref_path = hinted_topk_reference(scores, k, num_blocks, guess, sink, recent,
                                                                 rounds=rounds, candidate_cap=used_cap, tiled=tiled)
    plain_idx, plain_cnt = topk_select(scores, k, num_blocks, sink, recent)
    torch_idx, torch_cnt = topk_select_reference(scores, k, num_blocks, sink, recent)
    assert idx.dtype == torch.int32 and cnt.dtype == torch.int32 and idx.shape == plain_idx.shape
    assert torch.equal(ref_idx, torch_idx) and torch.equal(ref_cnt, torch_cnt)  # the algorithm is exact
    assert torch.equal(idx, plain_idx) and torch.equal(cnt, plain_cnt)  # = the unhinted kernel, bit for bit
    assert torch.equal(idx, ref_idx) and torch.equal(cnt, ref_cnt)
    assert torch.equal(path, ref_path), (path, ref_path)  # same rounds, same fallbacks
    assert torch.equal(hint, ref_hint), (hint, ref_hint)  # the next step's hint: the k-th score
    return path


@pytest.mark.parametrize(
    "batch,heads,n,k,kind,hint_kind,cap",
    [
        (1, 1, 27, 3, "randn", "exact", 16),
        (1, 3, 61, 7, "randn", "previous", 16),
        (7, 1, 113, 5, "randn", "garbage", 16),  # one garbage value per row: ±inf, NaN, ±FLT_MAX, 0
        (1, 3, 113, 9, "randn", "high", 16),
        (1, 3, 113, 9, "randn", "low", 16),
        (1, 1, 1110, 20, "randn", "previous", None),  # the launcher's cap (64)
        (3, 1, 1110, 33, "randn", "low", None),
        (1, 1, 2777, 100, "randn", "previous", None),  # a few thousand blocks, cap 256
        (1, 3, 113, 40, "ties", "previous", 64),  # three values: ties at the k-th key
        (1, 3, 61, 1, "integers", "exact", 16),  # k = 1; ±0.0 mixed
        (3, 1, 61, 12, "extremes", "previous", 16),  # ±inf, ±FLT_MAX, denormals, ±0
        (1, 3, 27, 40, "randn", "exact", 16),  # k > N: K_out = N, every valid block taken
    ],
)
def test_hinted_topk_matches_references(batch, heads, n, k, kind, hint_kind, cap):
    nb = torch.tensor([n - 3 * i for i in range(batch)], dtype=torch.int32)  # shorter contexts past row 0
    if kind == "randn":  # two steps' scores whose top-k overlap at 0.7
        previous, scores = make_hinted_scores(batch, heads, n, k, 0.7, seed=n + k)
    else:
        scores, _ = make_topk_scores(batch, heads, n, None, kind, seed=n + k + batch)
        previous, _ = make_topk_scores(batch, heads, n, None, kind, seed=n + k + batch + 1)
    path = check_hinted(scores, k, nb, hints_of(hint_kind, previous, scores, k), 1, 2, cap=cap)
    if kind == "randn" and hint_kind in ("exact", "previous") and k <= (cap or hint_candidate_cap(k, n)):
        assert (path >= 0).all(), path  # a good hint's candidates fit the buffer (no full-row fallback)


def test_hinted_topk_paths():
    """Each path is taken where it should be: the exact hint's candidates fit after round 0 (path
    1); hints ±inf and NaN miss and the rows fall back (-1); a context of at most CAP valid
    blocks needs no round (0); rounds=0 sends every longer row to the fallback."""
    previous, scores = make_hinted_scores(1, 3, 113, 6, 0.7, seed=5)
    nb = torch.tensor([113], dtype=torch.int32)
    assert (check_hinted(scores, 6, nb, kth_scores(scores, 6), 0, 1, cap=16) == 1).all()
    garbage = torch.tensor([[float("inf"), float("-inf"), float("nan")]])
    assert (check_hinted(scores, 6, nb, garbage, 0, 1, cap=16) == -1).all()
    short = torch.tensor([14], dtype=torch.int32)
    assert (check_hinted(scores, 6, short, garbage.clone(), 0, 1, cap=16) == 0).all()
    assert (check_hinted(scores, 6, nb, kth_scores(scores, 6), 0, 1, cap=16, rounds=0) == -1).all()
    guess, written = torch.full((1, 3), float("inf")), torch.zeros(1, 3)  # next_hint: the guess stays
    idx, _ = hinted_topk_select(scores, 6, nb, guess, 0, 0, candidate_cap=16, next_hint=written)  # no forced block
    assert (guess == float("inf")).all() and torch.equal(written, kth_scores(scores, 6))
    assert torch.equal(idx, topk_select(scores, 6, nb, 0, 0)[0])


def test_hinted_topk_chain_of_steps():
    """A decode step's written hint is the next step's guess: from -inf (a fresh cache) the first
    step falls back, the later ones take the previous k-th score; every step's set is exact."""
    n, k, steps = 113, 8, 3
    g = torch.Generator().manual_seed(11)
    scores = torch.randn(1, 3, n, generator=g) * 10.0
    nb = torch.tensor([n], dtype=torch.int32)
    hint = torch.full((1, 3), float("-inf"))
    paths = []
    for _ in range(steps):
        paths.append(check_hinted(scores, k, nb, hint, 1, 1, cap=16))
        scores = 0.95 * scores + 0.3 * torch.randn(1, 3, n, generator=g) * 10.0
    assert (paths[0] == -1).all() and all((p >= 1).all() for p in paths[1:])


def test_hinted_topk_neg_inf_padding_and_empty_rows():
    """A third of the scores -inf below nb (fewer selectable blocks than k in some rows), an
    empty row (nb = 0: count 0, next hint -inf), fp16 scores, non-contiguous scores."""
    scores, _ = make_topk_scores(4, 1, 113, None, "ties", seed=4)
    g = torch.Generator().manual_seed(4)
    scores = scores.masked_fill(torch.rand(scores.shape, generator=g) < 0.35, float("-inf"))
    scores[3] = float("-inf")  # a long context with nothing selectable but its forced blocks
    nb = torch.tensor([113, 0, 40, 113], dtype=torch.int32)
    hint = torch.tensor([[0.25], [1.0], [float("-inf")], [0.0]])
    check_hinted(scores, 30, nb, hint, 1, 2, cap=16)
    assert hint[1, 0] == float("-inf") and hint[3, 0] == float("inf")  # empty: -inf; only forced: +inf
    hint = torch.zeros(4, 1)
    check_hinted(scores, 30, nb, hint, 0, 0, cap=16)  # no forced block: row 3 has nothing to select
    assert hint[3, 0] == float("-inf")
    wide = (torch.randn(1, 61, 3, generator=g) * 4).round().transpose(1, 2)  # [1, 3, 61] strided
    check_hinted(wide, 10, torch.tensor([61], dtype=torch.int32), torch.zeros(1, 3), 0, 1, cap=16)
    check_hinted(wide.half(), 10, torch.tensor([50], dtype=torch.int32), torch.ones(1, 3), 2, 1, cap=16)


def test_hinted_topk_tiled_path(monkeypatch):
    """Rows longer than MAX_ROW_BLOCK go through the tiled kernel (several tiles per row here):
    exact hints take the candidates, garbage ones narrow to the exact k-th key (path -1)."""
    monkeypatch.setattr(hinted_launcher, "MAX_ROW_BLOCK", 16)
    monkeypatch.setattr(hinted_launcher, "TILE", 32)
    previous, scores = make_hinted_scores(1, 3, 113, 6, 0.7, seed=8)
    nb = torch.tensor([100], dtype=torch.int32)
    paths = check_hinted(scores, 6, nb, hints_of("previous", previous, scores, 6), 1, 1, cap=16, tiled=True)
    assert (paths >= 1).all()
    garbage = torch.tensor([[float("inf"), float("-inf"), float("nan")]])
    assert (check_hinted(scores, 6, nb, garbage, 1, 1, cap=16, tiled=True) != 0).all()
    ties, _ = make_topk_scores(1, 1, 113, None, "ties", seed=8)  # ties: more equal keys than CAP
    assert (check_hinted(ties, 20, nb, torch.zeros(1, 1), 0, 1, cap=16, tiled=True) == -1).all()


def test_hinted_torch_form_matches_top_k_blocks():
    """The selectors' torch form: the same set and order as top_k_blocks and the kernels' next
    hint, for every hint kind, on many rows at once (no kernel: fast)."""
    for seed, (n, k, kind) in enumerate([(27, 3, "randn"), (113, 40, "ties"), (61, 61, "integers"),
                                         (1110, 100, "randn"), (61, 7, "extremes"), (27, 0, "randn")]):
        scores, _ = make_topk_scores(7, 3, n, None, kind, seed=seed)
        nb = torch.tensor([n, n - 1, 0, 5, n // 2, 1, n], dtype=torch.int32)
        forced = forced_scores(scores, nb, 1, 2)
        for hint_kind in ("exact", "previous", "high", "low", "garbage"):
            hint = hints_of(hint_kind, scores.flip(-1), scores, max(k, 1)).clone()
            guess = hint.clone()
            idx, cnt = hinted_top_k_blocks(forced, k, hint)
            want_idx, want_cnt = top_k_blocks(forced, k)
            assert torch.equal(idx, want_idx) and torch.equal(cnt, want_cnt)
            if k:
                _, _, ref_hint, _ = hinted_topk_reference(scores, k, nb, guess, 1, 2, rounds=0, candidate_cap=16)
                assert torch.equal(hint, ref_hint)
            kernel_contract, _ = hinted_topk_select_reference(scores, k, nb, guess, 1, 2)
            assert torch.equal(kernel_contract, topk_select_reference(scores, k, nb, 1, 2)[0])


def test_keys_round_trip_and_generator():
    values = torch.tensor([float("-inf"), -FLT_MAX, -1.5, -1e-45, -0.0, 0.0, 1e-45, 2.0, FLT_MAX, float("inf")])
    keys = score_keys(values)
    assert (keys[1:] >= keys[:-1]).all() and keys[4] == keys[5]  # order kept; -0.0 and +0.0 one key
    assert torch.equal(key_scores(keys), torch.where(values == 0, 0.0, values))
    for rate in (0.6, 0.8):
        previous, current = make_hinted_scores(4, 2, 2000, 64, rate, seed=3)
        assert abs(topk_overlap(previous, current, 64).mean().item() - rate) < 0.03


def test_hinted_topk_errors():
    scores, nb = make_topk_scores(1, 2, 27)
    hint = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"hint must be a torch.float32 tensor of shape \[B, Hkv\]=\[1, 2\]"):
        hinted_topk_select(scores, 3, nb, torch.zeros(2, 1))
    with pytest.raises(ValueError, match="hint must be a torch.float32"):
        hinted_topk_select(scores, 3, nb, torch.zeros(1, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="hint must be contiguous"):
        hinted_topk_select(scores, 3, nb, torch.zeros(1, 4)[:, ::2])
    with pytest.raises(ValueError, match=r"next_hint must be a torch.float32 tensor of shape \[B, Hkv\]=\[1, 2\]"):
        hinted_topk_select(scores, 3, nb, hint, next_hint=torch.zeros(1, 3))
    with pytest.raises(ValueError, match="path must be a torch.int32"):
        hinted_topk_select(scores, 3, nb, hint, path=torch.zeros(1, 2))
    for bad in (-1, 9, True, 1.0):
        with pytest.raises(ValueError, match=f"rounds={bad!r}"):
            hinted_topk_select(scores, 3, nb, hint, rounds=bad)
    for bad in (8, 100, 1 << 20):
        with pytest.raises(ValueError, match=f"candidate_cap={bad}"):
            hinted_topk_select(scores, 3, nb, hint, candidate_cap=bad)
    with pytest.raises(ValueError, match="k=-1"):  # topk_select's own checks
        hinted_topk_select(scores, -1, nb, hint)
    idx, cnt = hinted_topk_select(scores, 0, nb, hint)  # k = 0: nothing launched, counts 0, hint -inf
    assert idx.shape == (1, 2, 0) and torch.equal(cnt, torch.zeros(1, 2, dtype=torch.int32))
    assert (hint == float("-inf")).all()


# --- GPU, real sizes ----------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n", [2048, 8192, 40000])  # 40000: the multi-program path, and the tiled kernel
@pytest.mark.parametrize("k", [32, 256, 2048])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_gpu_hinted_topk(n, k, rows):
    if k >= n:
        pytest.skip("k < candidates only")
    heads = min(rows, 8)
    batch = rows // heads
    nb = torch.tensor([n - 37 * i for i in range(batch)], dtype=torch.int32, device="cuda")
    for rate in (0.6, 0.8):
        previous, current = make_hinted_scores(batch, heads, n, k, rate, seed=n + k + rows, device="cuda")
        forced = forced_scores(current, nb, 1, 2)
        k_eff = torch.minimum(nb.long(), torch.tensor(k, device="cuda")).view(batch, 1, 1).expand(batch, heads, 1)
        kth = torch.gather(forced.topk(k, dim=-1).values, -1, k_eff - 1).squeeze(-1)  # every row has >= 1 block
        for kind, multi_program in itertools.product(("previous", "exact", "high", "low", "garbage"),
                                                     (None, False) if n > MAX_ROW_BLOCK else (None,)):
            hint = hints_of(kind, previous.cpu(), current.cpu(), k).cuda()
            idx, cnt = hinted_topk_select(current, k, nb, hint, 1, 2, multi_program=multi_program)
            plain_idx, plain_cnt = topk_select(current, k, nb, 1, 2)
            assert torch.equal(idx, plain_idx) and torch.equal(cnt, plain_cnt)
            torch_idx, torch_cnt = topk_select_reference(current, k, nb, 1, 2)
            assert torch.equal(idx, torch_idx) and torch.equal(cnt, torch_cnt)
            assert torch.equal(hint, kth)  # the next step's hint
        ties, _ = make_topk_scores(batch, heads, n, nb.tolist(), "ties", seed=n, device="cuda")
        hint = torch.zeros(batch, heads, device="cuda")
        assert torch.equal(hinted_topk_select(ties.bfloat16(), k, nb, hint, 0, 1)[0],
                           topk_select(ties.bfloat16(), k, nb, 0, 1)[0])
