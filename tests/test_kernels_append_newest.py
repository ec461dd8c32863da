"""prr.kernels.append_newest (a block list with each row's newest block added: reuse=steps between
selections) against its torch reference on fresh random lists at odd sizes: B 1 and 3, Hkv 1, 2
and 5, C 3, 7 and 9, width C, C + 1 and C + 3, ascending and best-first lists, the newest already a
member, empty and full lists, the newest the largest id, padding of any value; and the reference
against the membership-mask union it replaces (ReusedSelections.with_newest before the kernel);
out= apart from the input and in place (reuse=steps' buffers).
CPU: TRITON_INTERPRET=1 (conftest). GPU (-m gpu): the 8B shape and one CUDA-graph capture; the
kernel compiled for sm_90."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch
from prr.kernels.append_newest import append_newest_block
from prr.kernels.reference_append_newest import append_newest_reference

from prr.blocks import BlockSet
from tests.helpers import assert_compiles_for_sm90

ROOT = Path(__file__).resolve().parents[1]
GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device and TRITON_INTERPRET=0")
MODES = ("member", "largest", "empty", "full_absent", "full_member", "anywhere")


def random_lists(gen: torch.Generator, batch: int, heads: int, capacity: int, max_blocks: int, best_first: bool,
                 junk_padding: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indices [B, Hkv, C] int32, count [B, Hkv] int32, num_blocks [B] int32): distinct ids per (row,
    KV head), ascending or in random order (a predictor's best first), the modes of MODES over the
    rows' heads (the newest a member; absent and above every id; empty; full with and without it;
    ids anywhere below max_blocks, the newest among them or not); row 0's newest is the largest id
    there is (max_blocks - 1); padding zeros or random ids (the newest among them)."""
    num_blocks = torch.randint(capacity + 2, max_blocks + 1, (batch,), generator=gen)
    num_blocks[0] = max_blocks
    indices = torch.zeros(batch, heads, capacity, dtype=torch.int64)
    count = torch.zeros(batch, heads, dtype=torch.int64)
    for b in range(batch):
        newest = int(num_blocks[b]) - 1
        for h in range(heads):
            mode = MODES[(b * heads + h) % len(MODES)]
            n = {"empty": 0, "full_absent": capacity, "full_member": capacity}.get(
                mode, int(torch.randint(1, capacity + 1, (1,), generator=gen)))
            pool = torch.randperm(max_blocks if mode == "anywhere" else newest + 1, generator=gen)
            others = pool[pool != newest]
            ids = torch.cat([torch.tensor([newest]), others[: n - 1]]) if mode in ("member", "full_member") \
                else others[:n]
            ids = ids.sort().values if not best_first else ids[torch.randperm(n, generator=gen)]
            indices[b, h, :n], count[b, h] = ids, n
            if junk_padding and n < capacity:
                indices[b, h, n:] = torch.randint(0, max_blocks, (capacity - n,), generator=gen)
                indices[b, h, -1] = newest  # padding naming the newest does not make it a member
    return indices.int(), count.int(), num_blocks.int()


def mask_union(indices: torch.Tensor, count: torch.Tensor, num_blocks: torch.Tensor, max_blocks: int,
               width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The union as ReusedSelections.with_newest made it before the kernel: a membership mask over
    every block, the newest set, members ascending (prr.blocks)."""
    mask = BlockSet(indices, count).mask(max_blocks)  # [B, Hkv, NB]
    newest = (num_blocks.long() - 1).view(-1, 1, 1).expand(*mask.shape[:2], 1)
    union = BlockSet.from_mask(mask.scatter(-1, newest, True), width)
    return union.indices.to(torch.int32), union.count.to(torch.int32)


SIZES = [(1, 1, 3), (3, 2, 7), (1, 5, 9), (3, 5, 3), (3, 5, 9)]  # (B, Hkv, C)


@pytest.mark.parametrize("batch,heads,capacity", SIZES)
@pytest.mark.parametrize("extra", [0, 1, 3])
@pytest.mark.parametrize("best_first", [False, True])
def test_kernel_equals_the_reference(batch, heads, capacity, extra, best_first):
    gen = torch.Generator().manual_seed(batch * 1000 + heads * 100 + capacity * 10 + extra + 5 * best_first)
    idx, cnt, nb = random_lists(gen, batch, heads, capacity, 37, best_first, junk_padding=extra == 1)
    width = capacity + extra
    got_idx, got_cnt = append_newest_block(idx, cnt, nb, width)
    want_idx, want_cnt = append_newest_reference(idx, cnt, nb, width)
    assert got_idx.dtype == got_cnt.dtype == torch.int32 and got_idx.shape == (batch, heads, width)
    assert torch.equal(got_cnt, want_cnt) and torch.equal(got_idx, want_idx)
    assert not idx.eq(0).all()  # (the lists are not all padding)


@pytest.mark.parametrize("batch,heads,capacity", SIZES)
@pytest.mark.parametrize("extra", [0, 1, 3])
def test_the_reference_is_the_mask_union_it_replaces(batch, heads, capacity, extra):
    """Every mode, both orders: the same set, order, padding and size as the mask's (a union one
    over width included: width = C with a full list without the newest keeps the C smallest)."""
    for best_first in (False, True):
        gen = torch.Generator().manual_seed(batch * 100 + heads * 10 + capacity + extra)
        idx, cnt, nb = random_lists(gen, batch, heads, capacity, 37, best_first, junk_padding=True)
        want = mask_union(idx, cnt, nb, 37, capacity + extra)
        got = append_newest_reference(idx, cnt, nb, capacity + extra)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_cases_by_hand():
    """Ascending and best-first lists, the newest (block 9 of 10) a member, absent, the largest id;
    an empty list; a full list at width C keeps its C smallest ids and counts C + 1; block 0 the newest."""
    idx = torch.tensor([[[2, 9, 4], [7, 1, 0], [0, 0, 0], [3, 5, 8]]], dtype=torch.int32)
    cnt = torch.tensor([[3, 2, 0, 3]], dtype=torch.int32)
    nb = torch.tensor([10], dtype=torch.int32)
    for fn in (append_newest_block, append_newest_reference):
        out, size = fn(idx, cnt, nb, 4)
        assert out.tolist() == [[[2, 4, 9, 0], [1, 7, 9, 0], [9, 0, 0, 0], [3, 5, 8, 9]]]
        assert size.tolist() == [[3, 3, 1, 4]]
        out, size = fn(idx, cnt, nb, 3)
        assert out[0, 3].tolist() == [3, 5, 8] and size[0, 3] == 4
        # the first decode block (block 0): zero padding is not a member
        out, size = fn(torch.zeros(1, 1, 2, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                       torch.ones(1, dtype=torch.int32), 2)
        assert out.tolist() == [[[0, 0]]] and size.tolist() == [[1]]


def test_int64_and_strided_inputs():
    """A torch predictor's proposal is int64 (top-k's order); a view's strides are followed."""
    gen = torch.Generator().manual_seed(11)
    idx, cnt, nb = random_lists(gen, 3, 5, 7, 37, best_first=True)
    wide = torch.zeros(3, 5, 14, dtype=torch.int64)
    wide[..., ::2] = idx.long()
    got = append_newest_block(wide[..., ::2], cnt.long(), nb.long(), 9)
    want = append_newest_reference(idx, cnt, nb, 9)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("batch,heads,capacity", [(1, 1, 3), (3, 5, 9), (3, 2, 7)])
def test_out_apart_and_in_place(batch, heads, capacity):
    """out= writes reuse=steps' static buffers, whatever they held: apart from the input
    (between=predicted's proposal) and the input itself (between=last: the kept A, two steps in a
    row with the next block newest), kernel and reference alike: the fresh result each time."""
    width = capacity + 2
    for best_first in (False, True):
        gen = torch.Generator().manual_seed(batch * 100 + heads * 10 + capacity + best_first)
        idx, cnt, nb = random_lists(gen, batch, heads, capacity, 37, best_first, junk_padding=True)
        nb = nb.clamp(max=36)  # the second step's newest block (nb + 1 - 1) is still below 37
        first = append_newest_reference(idx, cnt, nb, width)
        second = append_newest_reference(*first, nb + 1, width)
        for fn in (append_newest_block, append_newest_reference):
            out = (torch.full((batch, heads, width), 5, dtype=torch.int32), torch.full((batch, heads), 5, dtype=torch.int32))
            got = fn(idx, cnt, nb, width, out=out)
            assert got[0] is out[0] and got[1] is out[1]
            assert torch.equal(out[0], first[0]) and torch.equal(out[1], first[1]), (fn.__name__, best_first)
            kept_idx = torch.full((batch, heads, width), 7, dtype=torch.int32)  # the buffers: A, then stale ids
            kept_idx[..., :capacity] = idx
            kept_cnt = cnt.clone()
            for num_blocks, want in ((nb, first), (nb + 1, second)):
                got = fn(kept_idx, kept_cnt, num_blocks, width, out=(kept_idx, kept_cnt))
                assert got[0] is kept_idx and got[1] is kept_cnt
                assert torch.equal(kept_idx, want[0]) and torch.equal(kept_cnt, want[1]), (fn.__name__, best_first)


def test_bad_arguments_are_refused():
    idx, cnt, nb = torch.zeros(1, 2, 4, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32), torch.ones(1)
    with pytest.raises(ValueError, match="width=3 must be"):
        append_newest_block(idx, cnt, nb.int(), 3)
    with pytest.raises(ValueError, match="width=3 must be"):
        append_newest_reference(idx, cnt, nb.int(), 3)
    with pytest.raises(ValueError, match="num_blocks must be"):
        append_newest_block(idx, cnt, nb, 4)  # float
    with pytest.raises(ValueError, match="count must be"):
        append_newest_block(idx, cnt[0], nb.int(), 4)
    with pytest.raises(ValueError, match="indices must be"):
        append_newest_block(idx.float(), cnt, nb.int(), 4)
    out = (torch.zeros(1, 2, 5, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"out\[0\] \(indices\) must be a contiguous int32 \[1, 2, 5\]"):
        append_newest_block(idx, cnt, nb.int(), 5, out=(out[0][..., :4], out[1]))
    with pytest.raises(ValueError, match=r"out\[0\] \(indices\) must be a contiguous"):
        append_newest_block(idx, cnt, nb.int(), 5, out=(out[0].long(), out[1]))
    with pytest.raises(ValueError, match=r"out\[1\] \(count\) must be"):
        append_newest_block(idx, cnt, nb.int(), 5, out=(out[0], torch.zeros(1, 4, dtype=torch.int32)[:, ::2]))
    with pytest.raises(ValueError, match="out must be a tuple"):
        append_newest_block(idx, cnt, nb.int(), 5, out=list(out))
    with pytest.raises(ValueError, match="starts where its input does but is not that input"):
        append_newest_block(out[0][..., :4], cnt, nb.int(), 5, out=out)  # A a prefix view of the buffer


# --- GPU ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("capacity", [8, 9, 64, 65, 128, 130])
def test_kernel_equals_the_reference_at_the_8b_shape(batch, capacity):
    """8 KV heads, |A| from 8 to 130 (K plus the blocks begun between selections), 32K-128K contexts
    of 64-token blocks: both orders, width C + 1 and C + 3, int32 on the GPU."""
    gen = torch.Generator().manual_seed(batch + capacity)
    for best_first in (False, True):
        idx, cnt, nb = random_lists(gen, batch, 8, capacity, 2048, best_first, junk_padding=True)
        idx, cnt, nb = idx.cuda(), cnt.cuda(), nb.cuda()
        for width in (capacity + 1, capacity + 3):
            got = append_newest_block(idx, cnt, nb, width)
            want = append_newest_reference(idx, cnt, nb, width)
            assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (best_first, width)


@pytest.mark.gpu
@gpu
def test_replays_in_a_cuda_graph():
    """Captured once and replayed over new lists: the reference's answer each time (static shapes, no
    host synchronisation)."""
    gen = torch.Generator().manual_seed(3)
    idx, cnt, nb = (t.cuda() for t in random_lists(gen, 8, 8, 65, 512, best_first=True))
    append_newest_block(idx, cnt, nb, 66)  # warm-up (compiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = append_newest_block(idx, cnt, nb, 66)
    for step in range(5):
        for t, new in zip((idx, cnt, nb), random_lists(gen, 8, 8, 65, 512, best_first=step % 2 == 1), strict=True):
            t.copy_(new)
        graph.replay()
        want = append_newest_reference(idx, cnt, nb, 66)
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]), step


# --- compiles for the H100 / H200 -----------------------------------------------------------------

SCRIPT = textwrap.dedent('''
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import prr.kernels.append_newest_jit as K

    failed = []
    fn = K._append_newest_kernel
    for ids in ("*i32", "*i64"):
        for capacity in (8, 65, 130):  # the launcher's sizes: BLOCK >= C + 1, CHUNK <= 32
            block = triton.next_power_of_2(capacity + 1)
            constexprs = {"BLOCK": block, "CHUNK": min(block, 32), "BLOCK_OUT": triton.next_power_of_2(capacity + 3),
                          "PDL": False}
            types = {"idx_ptr": ids, "count_ptr": ids, "num_blocks_ptr": ids, "out_idx_ptr": "*i32",
                     "out_count_ptr": "*i32"}
            sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
            try:
                triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                               target=GPUTarget("cuda", 90, 32), options={"num_warps": 4 if block >= 128 else 1})
            except Exception as e:  # noqa: BLE001 - reported below
                failed.append(f"{ids} C={capacity}: {type(e).__name__}: {str(e)[:1500]}")
    print("\\n".join(failed) if failed else "all compiled")
    sys.exit(1 if failed else 0)
''')


def test_append_newest_kernel_compiles_for_sm90():
    """The interpreter accepts code a GPU compile rejects: the kernel compiled ahead of time for sm_90
    (through ptxas) at the 8B shape's sizes, in a subprocess without TRITON_INTERPRET."""
    assert_compiles_for_sm90(SCRIPT)
