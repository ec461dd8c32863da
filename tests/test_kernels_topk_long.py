"""Multi-program top-k for long rows (`topk_select(..., multi_program=...)`,
kernels/topk_radix_jit.py) against the torch reference (`topk_select_reference`: the set of
`top_k_blocks` over the forced / masked scores, ascending, padding 0), bit for bit, at odd sizes.
CPU: TRITON_INTERPRET=1 (conftest), with small chunks and candidate buffers forced through the
arguments so that every way the threshold is found runs at interpreter sizes. The GPU variants
(-m gpu, TRITON_INTERPRET=0) run at 16K-1M candidates with the default chunk and buffer."""

from __future__ import annotations

import os

import pytest
import torch
from prr.kernels.hinted_topk import hinted_topk_select
from prr.kernels.reference_hinted_topk import kth_scores, make_hinted_scores
from prr.kernels.reference_selection import forced_scores, make_topk_scores, topk_select_reference
from prr.kernels.topk import MAX_BLOCKS_PER_ROW, MULTI_PROGRAM_MIN_BLOCKS, topk_select

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="needs a CUDA device and TRITON_INTERPRET=0",
)


def check_long(scores, k, num_blocks, sink, recent, **kw) -> torch.Tensor:
    """topk_select on the multi-program path == the reference; -> the path each row took [B, Hkv]."""
    path = torch.full(scores.shape[:2], -9, dtype=torch.int32, device=scores.device)
    kw.setdefault("multi_program", True)
    idx, cnt = topk_select(scores, k, num_blocks, sink, recent, multi_program_path=path, **kw)
    ref_idx, ref_cnt = topk_select_reference(scores, k, num_blocks, sink, recent)  # on the scores' device
    assert idx.dtype == torch.int32 and cnt.dtype == torch.int32
    assert idx.shape == ref_idx.shape and cnt.shape == ref_cnt.shape
    assert torch.equal(cnt.cpu(), ref_cnt.cpu())
    assert torch.equal(idx.cpu(), ref_idx.cpu())  # same set, ascending, padding 0
    return path.cpu()


def with_neg_inf(scores: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """A copy with about `fraction` of the scores -inf (never taken)."""
    g = torch.Generator().manual_seed(seed)
    return scores.masked_fill(torch.rand(scores.shape, generator=g) < fraction, float("-inf"))


@pytest.mark.parametrize(
    "kind,n,num_blocks,k,sink,recent,chunk,cap",
    [
        ("randn", 20001, [20001, 13001], 100, 1, 2, 1024, 256),  # N not a multiple of the chunk; a short context
        ("randn", 70003, [70003], 2048, 1, 2, 4096, 512),  # k = 2048 of 70K
        ("ties", 20001, [20001, 19999], 333, 2, 1, 1024, 64),  # three values: heavy ties at T
        pytest.param("integers", 20001, [20001, 5000], 1500, 0, 1, 2048, 4096,  # nine values, ±0.0 as one
                     marks=pytest.mark.slow),
        ("extremes", 20001, [20001, 20000], 50, 0, 0, 512, 128),  # ±inf, ±FLT_MAX, denormals, ±0
        ("randn", 20001, [20001, 40], 100, 3, 2, 1024, 256),  # k > the valid blocks of the short row
        ("randn", 20001, [0, 20001], 7, 8, 2, 1024, 16),  # an empty row; more forced blocks than k
    ],
)
def test_multi_program_topk_matches_reference(kind, n, num_blocks, k, sink, recent, chunk, cap):
    scores, nb = make_topk_scores(len(num_blocks), 2 if n < 50000 else 1, n, num_blocks, kind, seed=n + k)
    check_long(scores, k, nb, sink, recent, multi_program_chunk=chunk, multi_program_cap=cap)


def test_multi_program_topk_neg_inf_and_k_past_valid():
    """A third of the scores -inf (below nb too): fewer selectable blocks than k in a row."""
    scores, nb = make_topk_scores(2, 1, 20001, [20001, 9000], "randn", seed=5)
    scores = with_neg_inf(scores, 0.35, seed=5)
    check_long(scores, 3000, nb, 1, 2, multi_program_chunk=1024, multi_program_cap=4096)
    ties = with_neg_inf(make_topk_scores(1, 1, 20001, None, "ties", seed=6)[0], 0.999, seed=6)
    path = check_long(ties, 100, torch.tensor([20001], dtype=torch.int32), 0, 0, multi_program_chunk=1024,
                      multi_program_cap=64)
    assert (ties > float("-inf")).sum() < 100 and path.item() in (2, 3, 4, -1)


def test_multi_program_topk_every_way_to_the_threshold():
    """Inputs built so that T is found among the candidates of level 2, 3 and 4, by all four
    histograms (heavy ties: one program emits), and not at all (nothing selectable)."""
    n, nb = 20001, torch.tensor([20001], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    u = torch.rand(1, 1, n, generator=g)
    spread = torch.exp2(u * 120 - 60)  # over 120 octaves: the top digit's bucket (2 octaves) holds ~n / 60
    assert check_long(spread, 64, nb, 0, 1, multi_program_chunk=1024, multi_program_cap=512).item() == 2
    # a buffer past 512: buckets of <= 512 keys are selected over 512 lanes, larger ones over all
    assert check_long(spread, 64, nb, 0, 1, multi_program_chunk=1024, multi_program_cap=1024).item() == 2
    half_spread = torch.exp2(u * 60 - 30)  # ~n / 30 = 667 keys in the bucket
    assert check_long(half_spread, 64, nb, 0, 1, multi_program_chunk=1024, multi_program_cap=1024).item() == 2
    normal = torch.randn(1, 1, n, generator=g) * 10  # a 2-octave bucket holds too many, 1/128 octave few
    assert check_long(normal, 64, nb, 0, 1, multi_program_chunk=1024, multi_program_cap=256).item() == 3
    narrow = 1.0 + u * 2.0**-7  # one top 16 bits; the third digit splits them into 256 buckets of ~78
    assert check_long(narrow, 64, nb, 0, 1, multi_program_chunk=1024, multi_program_cap=256).item() == 4
    tied = torch.randint(0, 3, (1, 1, n), generator=g).float()
    assert check_long(tied, 64, nb, 0, 1, multi_program_chunk=1024, multi_program_cap=256).item() == -1
    empty = torch.tensor([0], dtype=torch.int32)
    assert check_long(normal, 64, empty, 2, 1, multi_program_chunk=1024, multi_program_cap=256).item() == 0


@pytest.mark.slow  # 13 s under the interpreter: make test-full
def test_multi_program_topk_several_tiles_a_program(monkeypatch):
    """Programs walk their chunk tile by tile (MULTI_PROGRAM_TILE): 4 tiles a chunk here, every
    way to the threshold, and the hint round."""
    from prr.kernels import topk as topk_launcher

    monkeypatch.setattr(topk_launcher, "MULTI_PROGRAM_TILE", 256)
    g = torch.Generator().manual_seed(4)
    n, nb = 9001, torch.tensor([9001, 8000], dtype=torch.int32)
    normal = torch.randn(2, 1, n, generator=g) * 10
    tied = torch.randint(0, 3, (2, 1, n), generator=g).float()
    knobs = dict(multi_program_chunk=1024, multi_program_cap=128)
    assert (check_long(normal, 50, nb, 1, 2, **knobs) >= 2).all()
    assert (check_long(tied, 50, nb, 1, 2, **knobs) == -1).all()
    hint = kth_scores(normal, 50).contiguous()
    assert (check_hinted_long(normal, 50, nb, hint, 0, 0, multi_program_chunk=1024, candidate_cap=128) == 1).all()


def test_multi_program_topk_half_precision_strided_and_default_path():
    scores, nb = make_topk_scores(2, 1, 20001, [20001, 15000], "integers", seed=3)
    check_long(scores.bfloat16(), 700, nb, 1, 1, multi_program_chunk=2048, multi_program_cap=1024)
    wide = torch.randn(2, 3001, 2).transpose(1, 2)  # non-contiguous [B, Hkv, N]
    short_nb = torch.tensor([3001, 2000], dtype=torch.int32)
    check_long(wide, 90, short_nb, 0, 1, multi_program_chunk=256, multi_program_cap=128)
    # the same blocks as the one-program-per-row kernel
    mp = topk_select(wide, 90, short_nb, 0, 1, multi_program=True, multi_program_chunk=256, multi_program_cap=128)
    row = topk_select(wide, 90, short_nb, 0, 1, multi_program=False)
    assert torch.equal(mp[0], row[0]) and torch.equal(mp[1], row[1])


def test_multi_program_rule_takes_rows_past_the_register_row():
    """multi_program=None: rows of MULTI_PROGRAM_MIN_BLOCKS blocks and more take the multi-program
    path (it writes multi_program_path), shorter ones the one-program kernel (it refuses the path)."""
    small = dict(multi_program_chunk=4096, multi_program_cap=64)
    n = MULTI_PROGRAM_MIN_BLOCKS
    scores, nb = make_topk_scores(1, 1, n, None, "randn", seed=1)
    assert check_long(scores, 20, nb, 1, 1, multi_program=None, **small).item() in (2, 3, 4)
    with pytest.raises(ValueError, match="multi_program_path is written by the multi-program path only"):
        topk_select(scores[..., :n - 1], 20, nb - 1, multi_program_path=torch.zeros(1, 1, dtype=torch.int32), **small)


def test_multi_program_errors():
    scores, nb = make_topk_scores(1, 2, 27)
    for bad in (100, 8, 0, 1 << 15, True, 64.0):
        with pytest.raises(ValueError, match=f"multi_program_chunk={bad!r}"):
            topk_select(scores, 3, nb, multi_program=True, multi_program_chunk=bad)
        with pytest.raises(ValueError, match=f"multi_program_cap={bad!r}"):
            topk_select(scores, 3, nb, multi_program=True, multi_program_cap=bad)
    with pytest.raises(ValueError, match="multi_program='yes'"):
        topk_select(scores, 3, nb, multi_program="yes")
    with pytest.raises(ValueError, match="split and multi_program=True"):
        topk_select(scores, 3, nb, multi_program=True, split=16)
    with pytest.raises(ValueError, match="multi_program_path must be a contiguous int32"):
        topk_select(scores, 3, nb, multi_program=True, multi_program_path=torch.zeros(1, 2))
    too_long = torch.zeros(1, 1, MAX_BLOCKS_PER_ROW + 1)
    with pytest.raises(ValueError, match=f"N={MAX_BLOCKS_PER_ROW + 1} blocks exceed"):
        topk_select(too_long, 3, torch.tensor([1], dtype=torch.int32))


def forced_kth(scores, k, num_blocks, sink, recent) -> torch.Tensor:
    """[B, Hkv] the k_eff-th largest forced / masked score (-inf where nothing is selectable):
    the next hint hinted_topk_select writes."""
    forced = forced_scores(scores, num_blocks, sink, recent)
    ordered = forced.sort(-1, descending=True).values
    k_eff = (forced > float("-inf")).sum(-1).clamp(max=k)  # [B, Hkv]
    kth = torch.gather(ordered, -1, (k_eff - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(k_eff > 0, kth, float("-inf")).cpu()


def check_hinted_long(scores, k, num_blocks, hint, sink, recent, **kw) -> torch.Tensor:
    """hinted_topk_select on the multi-program path == the reference, next hint == the k-th
    forced score; -> its path [B, Hkv] (1: the hint round's candidates fit; -1: radix levels)."""
    path = torch.full(hint.shape, -9, dtype=torch.int32, device=scores.device)
    kw.setdefault("multi_program", True)
    idx, cnt = hinted_topk_select(scores, k, num_blocks, hint, sink, recent, path=path, **kw)
    ref_idx, ref_cnt = topk_select_reference(scores, k, num_blocks, sink, recent)
    assert torch.equal(cnt.cpu(), ref_cnt.cpu()) and torch.equal(idx.cpu(), ref_idx.cpu())
    assert torch.equal(hint.cpu(), forced_kth(scores, k, num_blocks, sink, recent))  # written in place
    return path.cpu()


def check_hinted_paths(n: int, k: int, **small) -> None:
    """Hinted top-k over rows of n blocks with the multi-program knobs `small`: a good hint's candidates
    fit (path 1), garbage hints (±inf, NaN, 0) and heavy ties take the radix levels (-1), an empty row
    finds nothing (0); each the reference's set (check_hinted_long)."""
    previous, scores = make_hinted_scores(1, 3, n, k, 0.7, seed=11)
    nb = torch.tensor([n - 5], dtype=torch.int32)
    assert (check_hinted_long(scores, k, nb, kth_scores(previous, k), 1, 2, **small) == 1).all()
    garbage = torch.tensor([[float("inf"), float("nan"), 0.0]])
    assert (check_hinted_long(scores, k, nb, garbage, 1, 2, **small) == -1).all()
    ties, _ = make_topk_scores(2, 1, n, [n, 0], "ties", seed=12)
    ties_path = check_hinted_long(ties, k, torch.tensor([n, 0], dtype=torch.int32), torch.zeros(2, 1), 0, 1, **small)
    assert ties_path.tolist() == [[-1], [0]]


def test_hinted_multi_program_topk():
    """Hinted top-k's multi-program path: a good hint's round fits the buffer (path 1), garbage
    hints (±inf, NaN, 0) and heavy ties leave it to the radix levels (-1); the same set either way,
    and the k-th score written as the next hint; an empty row writes -inf."""
    check_hinted_paths(6001, 60, multi_program_chunk=1024, candidate_cap=256)
    # rows past the register row take it by default (multi_program=None)
    long_scores, _ = make_topk_scores(1, 1, MULTI_PROGRAM_MIN_BLOCKS, None, "randn", seed=13)
    full = torch.tensor([MULTI_PROGRAM_MIN_BLOCKS], dtype=torch.int32)
    hint = kth_scores(long_scores, 20).contiguous()
    assert check_hinted_long(long_scores, 20, full, hint, 0, 1, multi_program=None, multi_program_chunk=4096,
                             candidate_cap=64).item() == 1


# --- finish in level 1 (multi_program_finish=True): 2 launches, the same result --------------------


def check_finish(scores, k, num_blocks, sink, recent, **kw) -> torch.Tensor:
    """topk_select's multi-program path with multi_program_finish False and True: each == the
    reference, and the two found T the same way; -> that path [B, Hkv]."""
    ref_idx, ref_cnt = topk_select_reference(scores, k, num_blocks, sink, recent)
    kw.setdefault("multi_program", True)
    paths = []
    for finish in (False, True):
        path = torch.full(scores.shape[:2], -9, dtype=torch.int32, device=scores.device)
        idx, cnt = topk_select(scores, k, num_blocks, sink, recent, multi_program_path=path,
                               multi_program_finish=finish, **kw)
        assert torch.equal(cnt.cpu(), ref_cnt.cpu()) and torch.equal(idx.cpu(), ref_idx.cpu()), f"finish={finish}"
        paths.append(path.cpu())
    assert torch.equal(paths[0], paths[1])
    return paths[1]


@pytest.mark.parametrize(
    "kind,batch,hkv,n,num_blocks,k,sink,recent,chunk,cap",
    [
        ("randn", 2, 2, 701, [701, 333], 50, 1, 2, 32, 64),  # ragged contexts, B and Hkv > 1
        pytest.param("randn", 1, 1, 1999, [1999], 1, 0, 0, 64, 16, marks=pytest.mark.slow),  # k = 1, nothing forced
        pytest.param("randn", 2, 1, 1501, [1501, 1200], 900, 2, 1, 64, 64, marks=pytest.mark.slow),  # k > N / 2: several histogram levels
        pytest.param("ties", 2, 1, 901, [901, 899], 333, 2, 1, 32, 64, marks=pytest.mark.slow),  # heavy ties: SERIAL
        pytest.param("integers", 2, 1, 1001, [1001, 300], 150, 0, 1, 32, 32, marks=pytest.mark.slow),  # nine values, ±0.0 as one
        pytest.param("extremes", 1, 2, 777, [770], 20, 0, 0, 32, 16, marks=pytest.mark.slow),  # ±inf, ±FLT_MAX, denormals, ±0
        pytest.param("randn", 2, 1, 603, [603, 40], 100, 3, 2, 32, 16, marks=pytest.mark.slow),  # k > the short row's context
        pytest.param("randn", 2, 1, 1001, [0, 1001], 7, 8, 2, 64, 16, marks=pytest.mark.slow),  # an empty row; more forced blocks than k
        pytest.param("randn", 1, 1, 513, [513], 513, 1, 1, 16, 64, marks=pytest.mark.slow),  # k = N: every block
    ],
)
def test_multi_program_finish_matches_reference(kind, batch, hkv, n, num_blocks, k, sink, recent, chunk, cap):
    scores, nb = make_topk_scores(batch, hkv, n, num_blocks, kind, seed=n + k)
    check_finish(scores, k, nb, sink, recent, multi_program_chunk=chunk, multi_program_cap=cap)


def test_multi_program_finish_neg_inf_and_every_way_to_the_threshold():
    """At ~2K blocks, 32-64 programs a row: T among the candidates of level 2, 3 and 4, by all four
    histograms (SERIAL), nothing selectable; -inf scores leaving fewer selectable blocks than k."""
    n, nb = 2001, torch.tensor([2001], dtype=torch.int32)
    small = dict(multi_program_chunk=64, multi_program_cap=64)
    g = torch.Generator().manual_seed(0)
    u = torch.rand(1, 1, n, generator=g)
    assert check_finish(torch.exp2(u * 120 - 60), 64, nb, 0, 1, **small).item() == 2  # ~33 in the bucket
    normal = torch.randn(1, 1, n, generator=g) * 10  # ~110 in the 2-octave bucket, a few per 1/128 octave
    assert check_finish(normal, 64, nb, 0, 1, **small).item() == 3
    assert check_finish(1.0 + u * 2.0**-7, 64, nb, 0, 1, **small).item() == 4  # third digit: ~8 a bucket
    tied = torch.randint(0, 3, (1, 1, n), generator=g).float()
    assert check_finish(tied, 64, nb, 0, 1, **small).item() == -1
    assert check_finish(normal, 64, torch.tensor([0], dtype=torch.int32), 2, 1, **small).item() == 0
    scores, nb2 = make_topk_scores(2, 1, 1203, [1203, 400], "randn", seed=5)
    check_finish(with_neg_inf(scores, 0.35, seed=5), 500, nb2, 1, 2, multi_program_chunk=32,
                 multi_program_cap=128)
    all_neg_inf = torch.full((1, 1, 300), float("-inf"))
    assert check_finish(all_neg_inf, 5, torch.tensor([300], dtype=torch.int32), 0, 0, **small).item() == 0


@pytest.mark.slow  # 40 s under the interpreter: make test-full
def test_multi_program_finish_several_tiles_a_program(monkeypatch):
    """The finishing program walks the row TILE (MULTI_PROGRAM_TILE) blocks at a time: 4 tiles a
    chunk here, so tiles and chunks differ; half precision and strided scores."""
    from prr.kernels import topk as topk_launcher

    monkeypatch.setattr(topk_launcher, "MULTI_PROGRAM_TILE", 16)
    g = torch.Generator().manual_seed(4)
    n, nb = 1001, torch.tensor([1001, 900], dtype=torch.int32)
    knobs = dict(multi_program_chunk=64, multi_program_cap=32)
    assert (check_finish(torch.randn(2, 1, n, generator=g) * 10, 50, nb, 1, 2, **knobs) >= 2).all()
    assert (check_finish(torch.randint(0, 3, (2, 1, n), generator=g).float(), 50, nb, 1, 2, **knobs)
            == -1).all()
    wide = torch.randn(2, n, 2, generator=g).transpose(1, 2)  # non-contiguous [B, Hkv, N]
    check_finish(wide.bfloat16(), 300, nb, 0, 1, **knobs)


@pytest.mark.slow  # (make test: finish's every way to T above; the hinted round's own tests stay in make test)
def test_hinted_multi_program_finish():
    """Hinted top-k with multi_program_finish: the round's candidates fit (path 1), garbage hints and
    heavy ties take the radix levels (-1), an empty row (0); indices, counts and next hint the
    reference's (test_hinted_multi_program_topk: the same without finish)."""
    check_hinted_paths(1201, 40, multi_program_chunk=64, candidate_cap=128, multi_program_finish=True)


def test_multi_program_finish_errors():
    scores, nb = make_topk_scores(1, 2, 27)
    for bad in (1, None, "yes"):
        with pytest.raises(ValueError, match=f"multi_program_finish={bad!r} must be True or False"):
            topk_select(scores, 3, nb, multi_program=True, multi_program_finish=bad)
        with pytest.raises(ValueError, match=f"multi_program_finish={bad!r} must be True or False"):
            hinted_topk_select(scores, 3, nb, torch.zeros(1, 2), multi_program=True, multi_program_finish=bad)


# --- GPU, real sizes: 16K-1M candidates, k 32-4096, 1-64 rows, default chunk and buffer --------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n", [MULTI_PROGRAM_MIN_BLOCKS, 32768, 131072 + 5, 1 << 20])
@pytest.mark.parametrize("k", [32, 256, 2048, 4096])
def test_gpu_multi_program_topk(n, k):
    for batch, hkv, kind in ((1, 1, "randn"), (2, 4, "ties"), (8, 8, "randn")):
        nbs = [n] + [n - 1000 * i - 7 for i in range(1, batch)]
        scores, nb = make_topk_scores(batch, hkv, n, nbs, kind, seed=n + k, device="cuda")
        check_long(scores, k, nb, 1, 2, multi_program=None)
        check_long(scores.bfloat16(), k, nb, 0, 1, multi_program=None)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n", [MULTI_PROGRAM_MIN_BLOCKS, 32768, 131072 + 5, 1 << 20])
@pytest.mark.parametrize("k", [32, 2048, 4096])
def test_gpu_multi_program_finish(n, k):
    """multi_program_finish=True at real sizes (default chunk and buffer): the 6-launch path's
    indices, counts and threshold paths, and the reference's; every way to T; a CUDA graph."""
    for batch, hkv, kind in ((1, 1, "randn"), (2, 4, "ties"), (8, 8, "randn")):
        nbs = [n] + [n - 1000 * i - 7 for i in range(1, batch)]
        scores, nb = make_topk_scores(batch, hkv, n, nbs, kind, seed=n + k, device="cuda")
        check_finish(scores, k, nb, 1, 2, multi_program=None)
        check_finish(scores.bfloat16(), k, nb, 0, 1, multi_program=None)
    full = torch.tensor([n], dtype=torch.int32, device="cuda")
    u = torch.rand(1, 1, n, generator=torch.Generator(device="cuda").manual_seed(0), device="cuda")
    for scores in (torch.exp2(u * 120 - 60), 1.0 + u * 2.0**-7, (u * 3).floor()):  # level 2, 4; SERIAL
        check_finish(scores, k, full, 0, 1)
    check_finish(with_neg_inf(u.cpu(), 0.99, seed=3).cuda(), k, full, 1, 2)  # fewer valid than k
    graph_scores, nb = make_topk_scores(2, 4, n, [n, n - 999], "randn", seed=0, device="cuda")
    topk_select(graph_scores, k, nb, 1, 2, multi_program=True, multi_program_finish=True)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        idx, cnt = topk_select(graph_scores, k, nb, 1, 2, multi_program=True, multi_program_finish=True)
    for seed in (1, 2):
        graph_scores.copy_(make_topk_scores(2, 4, n, None, "randn", seed=seed, device="cuda")[0])
        graph.replay()
        ref_idx, ref_cnt = topk_select_reference(graph_scores, k, nb, 1, 2)
        assert torch.equal(idx, ref_idx) and torch.equal(cnt, ref_cnt)


@pytest.mark.gpu
@gpu
def test_gpu_multi_program_topk_every_way_and_neg_inf():
    n = 131072
    nb = torch.tensor([n], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    u = torch.rand(1, 1, n, generator=g, device="cuda")
    # as test_multi_program_topk_every_way_to_the_threshold, at the default chunk and buffer (4096)
    assert check_long(torch.exp2(u * 120 - 60), 2048, nb, 0, 1).item() == 2  # ~n / 60 = 2184 in the bucket
    assert check_long(1.0 + u * 2.0**-7, 2048, nb, 0, 1).item() == 4  # level-3 buckets of ~512
    tied = torch.randint(0, 3, (1, 1, n), generator=g, device="cuda").float()
    assert check_long(tied, 2048, nb, 0, 1).item() == -1
    scores, nb8 = make_topk_scores(8, 8, n, None, "randn", seed=3, device="cuda")
    check_long(with_neg_inf(scores.cpu(), 0.99, seed=3).cuda(), 2048, nb8, 1, 2)  # ~1300 valid < k


@pytest.mark.gpu
@gpu
def test_gpu_multi_program_topk_cuda_graph():
    """Captured once, replayed on new scores in place: static shapes, no host synchronisation."""
    n, k = 131072, 2048
    scores, nb = make_topk_scores(2, 4, n, [n, n - 999], "randn", seed=0, device="cuda")
    topk_select(scores, k, nb, 1, 2)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        idx, cnt = topk_select(scores, k, nb, 1, 2)
    for seed in (1, 2):
        scores.copy_(make_topk_scores(2, 4, n, None, "randn", seed=seed, device="cuda")[0])
        graph.replay()
        ref_idx, ref_cnt = topk_select_reference(scores, k, nb, 1, 2)
        assert torch.equal(idx, ref_idx) and torch.equal(cnt, ref_cnt)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n", [32768, 131072 + 5, 1 << 20])
@pytest.mark.parametrize("k", [32, 2048, 4096])
def test_gpu_hinted_multi_program_topk(n, k):
    for batch, heads in ((1, 1), (8, 8)):
        nb = torch.tensor([n - 37 * i for i in range(batch)], dtype=torch.int32, device="cuda")
        previous, current = make_hinted_scores(batch, heads, n, k, 0.7, seed=n + k, device="cuda")
        path = check_hinted_long(current, k, nb, kth_scores(previous, k).contiguous(), 1, 2, multi_program=None)
        assert (path == 1).float().mean() > 0.9  # the previous step's k-th score: the round fits
        garbage = torch.full((batch, heads), float("nan"), device="cuda")
        assert (check_hinted_long(current, k, nb, garbage, 1, 2, multi_program=None) == -1).all()
