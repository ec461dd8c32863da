"""prr.kernels.keep_selection (a layer's A kept in reuse=steps' static buffers: the ids with zero
padding, the count, the scores) against its torch reference on fresh random inputs at odd sizes:
B 1 and 3, Hkv 1 and 5, C 3 and 9, width C to C + 4, NB 37, int32 and int64 ids and counts, fp32
and bf16 scores or none (then the scores buffer is left as it was), strided inputs, buffers
holding stale values; bad arguments refused. CPU: TRITON_INTERPRET=1 (conftest). GPU (-m gpu):
the 8B shape and one CUDA-graph capture; the kernel compiled for sm_90."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch
from prr.kernels.keep_selection import keep_selection
from prr.kernels.reference_keep_selection import keep_selection_reference

from tests.helpers import assert_compiles_for_sm90

ROOT = Path(__file__).resolve().parents[1]
GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device and TRITON_INTERPRET=0")


def random_selection(gen: torch.Generator, batch: int, heads: int, capacity: int, num_scores: int,
                     id_dtype: torch.dtype, score_dtype: torch.dtype | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(indices [B, Hkv, C], count [B, Hkv] of id_dtype, scores [B, Hkv, NB] or None): ids anywhere
    below NB, padding past count random too (it is copied as it is), scores random with -inf past
    a random context."""
    indices = torch.randint(0, num_scores, (batch, heads, capacity), generator=gen).to(id_dtype)
    count = torch.randint(0, capacity + 1, (batch, heads), generator=gen).to(id_dtype)
    if score_dtype is None:
        return indices, count, None
    scores = torch.randn(batch, heads, num_scores, generator=gen)
    scores[..., num_scores - 3 :] = float("-inf")
    return indices, count, scores.to(score_dtype)


def stale_buffers(gen: torch.Generator, batch: int, heads: int, width: int, num_scores: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The static buffers as a previous step left them (random values: the padding must be rewritten)."""
    return (torch.randint(1, 99, (batch, heads, width), generator=gen, dtype=torch.int32),
            torch.randint(1, 99, (batch, heads), generator=gen, dtype=torch.int32),
            torch.randn(batch, heads, num_scores, generator=gen))


def kernel_and_reference(inputs, buffers) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    got, want = [b.clone() for b in buffers], [b.clone() for b in buffers]
    keep_selection(*inputs, *got)
    keep_selection_reference(*inputs, *want)
    return got, want


@pytest.mark.parametrize("batch,heads,capacity", [(1, 1, 3), (3, 5, 9), (1, 5, 3), (3, 1, 9)])
@pytest.mark.parametrize("id_dtype,score_dtype", [(torch.int32, torch.float32), (torch.int64, torch.float32),
                                                  (torch.int32, None), (torch.int64, torch.bfloat16)])
def test_kernel_equals_the_reference(batch, heads, capacity, id_dtype, score_dtype):
    for extra in range(5):  # width C .. C + 4
        gen = torch.Generator().manual_seed(batch * 1000 + heads * 100 + capacity * 10 + extra)
        inputs = random_selection(gen, batch, heads, capacity, 37, id_dtype, score_dtype)
        buffers = stale_buffers(gen, batch, heads, capacity + extra, 37)
        got, want = kernel_and_reference(inputs, buffers)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), extra
        assert torch.equal(got[0][..., :capacity], inputs[0].int()) and not got[0][..., capacity:].any()
        assert torch.equal(got[1], inputs[1].int())
        if score_dtype is None:  # not kept: the buffer as it was
            assert torch.equal(got[2], buffers[2])
        else:
            assert torch.equal(got[2], inputs[2].float())


def test_strided_inputs():
    """A selector's A or scores may be views (e.g. a slice of a wider list): their strides are followed."""
    gen = torch.Generator().manual_seed(7)
    idx, cnt, scores = random_selection(gen, 3, 5, 9, 37, torch.int64, torch.float32)
    wide_idx = torch.zeros(3, 5, 18, dtype=torch.int64)
    wide_idx[..., ::2] = idx
    wide_scores = torch.zeros(5, 3, 37).transpose(0, 1)  # [B, Hkv, NB] with the heads outermost
    wide_scores.copy_(scores)
    buffers = stale_buffers(gen, 3, 5, 11, 37)
    got, want = kernel_and_reference((wide_idx[..., ::2], cnt.t().contiguous().t(), wide_scores), buffers)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert torch.equal(got[2], scores) and torch.equal(got[0][..., :9], idx.int())


def test_bad_arguments_are_refused():
    idx, cnt = torch.zeros(1, 2, 4, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32)
    scores = torch.zeros(1, 2, 37)
    out = (torch.zeros(1, 2, 5, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, 2, 37))
    with pytest.raises(ValueError, match="width must be >= C=4"):
        keep_selection(idx, cnt, scores, out[0][..., :3], *out[1:])
    with pytest.raises(ValueError, match="width=3 must be >= C=4"):
        keep_selection_reference(idx, cnt, scores, out[0][..., :3].clone(), *out[1:])
    with pytest.raises(ValueError, match="indices must be"):
        keep_selection(idx.float(), cnt, scores, *out)
    with pytest.raises(ValueError, match="count must be"):
        keep_selection(idx, cnt[0], scores, *out)
    with pytest.raises(ValueError, match="out_indices must be a contiguous torch.int32"):
        keep_selection(idx, cnt, scores, out[0].long(), *out[1:])
    with pytest.raises(ValueError, match="out_indices must be a contiguous"):
        keep_selection(idx, cnt, scores, torch.zeros(1, 2, 10, dtype=torch.int32)[..., ::2], *out[1:])
    with pytest.raises(ValueError, match="out_count must be"):
        keep_selection(idx, cnt, scores, out[0], out[1].long(), out[2])
    with pytest.raises(ValueError, match="out_scores must be"):
        keep_selection(idx, cnt, scores, *out[:2], torch.zeros(1, 2, 36))
    with pytest.raises(ValueError, match="scores must be a float"):
        keep_selection(idx, cnt, scores.int(), *out)
    for fn in (keep_selection, keep_selection_reference):
        with pytest.raises(ValueError, match="without out_scores"):
            fn(idx, cnt, scores, *out[:2], None)
    keep_selection(idx, cnt, None, *out[:2], None)  # scores not kept: no buffer needed


# --- GPU ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("capacity", [8, 9, 64, 130])
def test_kernel_equals_the_reference_at_the_8b_shape(batch, capacity):
    """8 KV heads, |A| from 8 to 130, width C and C + 3, 2,048 blocks (128K of 64 tokens), int32
    and int64 ids, scores or none."""
    gen = torch.Generator().manual_seed(batch + capacity)
    for id_dtype, score_dtype in ((torch.int32, torch.float32), (torch.int64, None)):
        for width in (capacity, capacity + 3):
            inputs = [t if t is None else t.cuda() for t in random_selection(gen, batch, 8, capacity, 2048, id_dtype,
                                                                              score_dtype)]
            buffers = [t.cuda() for t in stale_buffers(gen, batch, 8, width, 2048)]
            got, want = kernel_and_reference(inputs, buffers)
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w), (id_dtype, width)


@pytest.mark.gpu
@gpu
def test_replays_in_a_cuda_graph():
    """Captured once and replayed over new selections: the reference's buffers each time (static
    shapes, no host synchronisation)."""
    gen = torch.Generator().manual_seed(3)
    inputs = [t.cuda() for t in random_selection(gen, 8, 8, 8, 512, torch.int32, torch.float32)]
    buffers = [t.cuda() for t in stale_buffers(gen, 8, 8, 11, 512)]
    keep_selection(*inputs, *buffers)  # warm-up (compiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        keep_selection(*inputs, *buffers)
    for step in range(5):
        for t, new in zip(inputs, random_selection(gen, 8, 8, 8, 512, torch.int32, torch.float32), strict=True):
            t.copy_(new)
        for t in buffers:
            t.fill_(step + 1)
        graph.replay()
        want = [b.clone() for b in buffers]
        keep_selection_reference(*inputs, *want)
        for g, w in zip(buffers, want, strict=True):
            assert torch.equal(g, w), step


# --- compiles for the H100 / H200 -----------------------------------------------------------------

SCRIPT = textwrap.dedent('''
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import prr.kernels.keep_selection_jit as K

    failed = []
    fn = K._keep_selection_kernel
    for ids, scores in (("*i32", "*fp32"), ("*i64", "*bf16")):
        for width, has_scores in ((11, True), (133, True), (133, False)):  # K = 8 and 128 plus the blocks gained
            constexprs = {"BLOCK_OUT": triton.next_power_of_2(width), "BLOCK_SCORES": 1024,
                          "HAS_SCORES": has_scores, "PDL": False}
            types = {"idx_ptr": ids, "count_ptr": ids, "scores_ptr": scores, "out_idx_ptr": "*i32",
                     "out_count_ptr": "*i32", "out_scores_ptr": "*fp32"}
            sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
            try:
                triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                               target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
            except Exception as e:  # noqa: BLE001 - reported below
                failed.append(f"{ids} {scores} W={width} scores={has_scores}: {type(e).__name__}: {str(e)[:1500]}")
    print("\\n".join(failed) if failed else "all compiled")
    sys.exit(1 if failed else 0)
''')


def test_keep_selection_kernel_compiles_for_sm90():
    """The interpreter accepts code a GPU compile rejects: the kernel compiled ahead of time for sm_90
    (through ptxas) at the 8B shape's sizes, in a subprocess without TRITON_INTERPRET."""
    assert_compiles_for_sm90(SCRIPT)
