"""Split-row top-k (`topk_select(..., split=CHUNK)`, kernels/topk_split_jit.py) against
`prr.blocks.top_blocks` on the forced / masked scores and against the one-program-per-row
`topk_select`, bit for bit, on fresh random inputs at odd sizes. CPU: TRITON_INTERPRET=1 (set in
conftest; sizes kept small). The GPU variant (-m gpu) runs at real sizes with TRITON_INTERPRET=0."""

from __future__ import annotations

import os

import pytest
import torch
from prr.kernels.reference_selection import forced_scores, make_topk_scores
from prr.kernels.topk import MAX_ROW_BLOCK, topk_select

from prr.blocks import top_blocks

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="needs a CUDA device and TRITON_INTERPRET=0",
)


def top_blocks_ascending(scores, k, num_blocks, sink, recent) -> tuple[torch.Tensor, torch.Tensor]:
    """prr.blocks.top_blocks on the forced / masked scores, as topk_select writes it:
    -> (ids [B, Hkv, min(k, N)] int32 ascending then 0, counts [B, Hkv] int32)."""
    n = scores.shape[-1]
    chosen = top_blocks(forced_scores(scores.cpu(), num_blocks.cpu(), sink, recent), k)
    if chosen.capacity == 0:
        return torch.zeros(*scores.shape[:2], 0, dtype=torch.int32), torch.zeros(scores.shape[:2], dtype=torch.int32)
    ids = torch.where(chosen.valid(), chosen.indices.long(), n).sort(-1).values
    ids = torch.where(ids == n, 0, ids)
    return ids.to(torch.int32), chosen.count.to(torch.int32)


def check_split(scores, k, num_blocks, sink, recent, split, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    idx, cnt = topk_select(scores, k, num_blocks, sink, recent, split=split, **kw)
    ref_idx, ref_cnt = top_blocks_ascending(scores, k, num_blocks, sink, recent)
    assert idx.dtype == torch.int32 and cnt.dtype == torch.int32
    assert idx.shape == ref_idx.shape and cnt.shape == ref_cnt.shape
    assert torch.equal(cnt.cpu(), ref_cnt)
    assert torch.equal(idx.cpu(), ref_idx)  # same set, ascending, padding 0
    row_idx, row_cnt = topk_select(scores, k, num_blocks, sink, recent, **kw)  # the default path
    assert torch.equal(idx, row_idx) and torch.equal(cnt, row_cnt)
    return idx, cnt


def with_neg_inf(scores: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """A copy with about `fraction` of the scores -inf (below nb too: never taken)."""
    g = torch.Generator().manual_seed(seed)
    return scores.masked_fill(torch.rand(scores.shape, generator=g) < fraction, float("-inf"))


@pytest.mark.parametrize(
    "kind,n,num_blocks,k,sink,recent,split",
    [
        ("randn", 700, [700, 300], 40, 1, 2, 256),  # N not a multiple of the chunk; a short context
        ("ties", 1029, [1029, 1000], 33, 2, 1, 256),  # three values: ties across chunks
        ("integers", 200, [200, 150], 100, 1, 3, 64),  # k > chunk: chunks keep every valid block
        ("ties", 300, [0, 77], 1, 0, 1, 64),  # k = 1; an empty row
        ("extremes", 130, [130, 100], 30, 0, 0, 32),  # ±inf, ±FLT_MAX, denormals, ±0
        ("randn", 100, [100, 100], 5, 8, 2, 16),  # more forced blocks than k: the lowest forced ids
        ("ties", 61, [61, 50], 10, 1, 1, 256),  # one chunk covers the row
    ],
)
def test_topk_split_matches_top_blocks(kind, n, num_blocks, k, sink, recent, split):
    scores, nb = make_topk_scores(2, 1 if n > 500 else 2, n, num_blocks, kind, seed=n + k)  # 1 KV head: interpreter time
    check_split(scores, k, nb, sink, recent, split)


def test_topk_split_neg_inf_ties_and_radix_bits():
    """Scores rounded to a few values with a third of them -inf below nb: fewer selectable
    blocks than k in some rows (counts < min(k, nb)); 1-bit passes too."""
    scores, nb = make_topk_scores(2, 2, 200, [200, 90], "ties", seed=7)
    scores = with_neg_inf(scores, 0.35, seed=7)
    check_split(scores, 30, nb, 1, 2, 64)
    _, cnt = check_split(scores, 150, nb, 1, 2, 32, radix_bits=1)
    assert (cnt[1] < 90).all()  # the short row has fewer selectable blocks than nb


def test_topk_split_fp16_strided_and_k_past_n():
    scores, nb = make_topk_scores(2, 2, 100, [100, 70], "integers", seed=3)
    check_split(scores.half(), 20, nb, 1, 1, 32)
    wide = torch.randn(2, 100, 2).transpose(1, 2)  # non-contiguous [B, Hkv, N]
    check_split(wide, 9, nb, 0, 1, 64)
    check_split(scores, 300, nb, 2, 2, 64)  # k > N: K_out = N, everything valid taken


def test_topk_split_errors():
    scores, nb = make_topk_scores(1, 2, 27)
    for bad in (100, 8, 0, -64, 2 * MAX_ROW_BLOCK):
        with pytest.raises(ValueError, match=f"split={bad}"):
            topk_select(scores, 3, nb, split=bad)
    with pytest.raises(ValueError, match="split=True"):
        topk_select(scores, 3, nb, split=True)
    with pytest.raises(ValueError, match="split=64.0"):
        topk_select(scores, 3, nb, split=64.0)
    # 2500 chunks x 16 candidates do not fit one merge program (checked before any launch)
    long_scores, long_nb = torch.zeros(1, 1, 40000), torch.tensor([40000], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"split=16 leaves 2500 chunks x 16 candidates"):
        topk_select(long_scores, 16, long_nb, split=16)
    with pytest.raises(ValueError, match="k=-1"):  # topk_select's own checks still come first
        topk_select(scores, -1, nb, split=16)
    idx, cnt = topk_select(scores, 0, nb, split=16)  # k = 0: nothing launched, counts 0
    assert idx.shape == (1, 2, 0) and torch.equal(cnt, torch.zeros(1, 2, dtype=torch.int32))


# --- GPU, real sizes (Hkv 8; 8 and 64 rows of 8192 blocks, 128K context at block 16) ---------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [8, 64])
@pytest.mark.parametrize("k", [32, 128])
@pytest.mark.parametrize("split", [1024, 2048])
def test_gpu_topk_split_8192_blocks(rows, k, split):
    hkv, n = 8, 8192
    batch = rows // hkv
    nbs = [n] + [n - 1000 * i - 7 for i in range(1, batch)]
    for kind in ("randn", "ties"):
        scores, nb = make_topk_scores(batch, hkv, n, nbs, kind, seed=rows + k, device="cuda")
        check_split(scores, k, nb, 1, 2, split)
        check_split(scores.bfloat16(), k, nb, 0, 1, split)
