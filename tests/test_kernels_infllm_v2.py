"""InfLLM-v2's selection kernels (prr.kernels.infllm_v2) against their torch definition
(prr.kernels.reference_infllm_v2) on fresh random inputs at odd sizes: D not a power of two, G = 1,
3, 5, rows shorter than one window, of exactly one, ending mid-block, several lse splits; fp32
compressed keys within 1e-6, scores within 1e-5 relative, -inf exactly past the context. Then the
selector's Triton path against its torch path while decoding, and each kernel compiled for sm_90.
CPU: TRITON_INTERPRET=1 (conftest). GPU (-m gpu): the 8B shape at 32K and 128K in bf16, and one
CUDA-graph capture."""

from __future__ import annotations

import copy
import os
import textwrap
from pathlib import Path

import pytest
import torch
from prr.kernels.infllm_v2 import infllm_v2_compress_append, infllm_v2_score
from prr.kernels.reference_infllm_v2 import (
    compress_append_reference,
    compress_range_reference,
    infllm_v2_score_reference,
)

from prr.cache import PagedKVCache
from prr.selectors.infllm_v2 import InfLLMV2Selector
from tests.helpers import assert_compiles_for_sm90

ROOT = Path(__file__).resolve().parents[1]
GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device and TRITON_INTERPRET=0")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30))


def assert_scores_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    assert torch.equal(got[~finite], want[~finite])
    assert rel_err(got[finite], want[finite]) < tol


def random_compressed(batch, kv_heads, head_dim, max_blocks, lengths, seed, device="cpu", dtype=torch.float32):
    """Compressed keys of random caches, each row's complete windows written ([B, Hkv, 4 NB, D]) and keys."""
    g = torch.Generator(device=device).manual_seed(seed)
    keys = (torch.randn(batch, kv_heads, max_blocks * 64, head_dim, generator=g, device=device) * 2).to(dtype)
    compressed = torch.zeros(batch, kv_heads, 4 * max_blocks, head_dim, device=device, dtype=dtype)
    for row, length in enumerate(lengths):
        compress_range_reference(compressed[row : row + 1], keys[row : row + 1], 0, length)
    return compressed, keys


@pytest.mark.parametrize("batch, kv_heads, group, head_dim, max_blocks, lengths", [
    (2, 3, 3, 24, 7, [411, 31]),      # one row without a complete window, D not a power of two
    (1, 1, 1, 16, 1, [32]),           # exactly one window, one block
    (3, 2, 5, 40, 13, [833, 64, 47]),  # G = 5, a row of two windows
    (1, 2, 4, 32, 45, [2861]),        # 178 windows: several lse splits
])
def test_scores_equal_the_reference(batch, kv_heads, group, head_dim, max_blocks, lengths):
    """The default lse tiling (tl.dot) and the FMA chunks with other tiles and split counts."""
    compressed, _ = random_compressed(batch, kv_heads, head_dim, max_blocks, lengths, seed=max_blocks)
    q = torch.randn(batch, kv_heads * group, head_dim, generator=torch.Generator().manual_seed(1)) * 2
    rows = torch.tensor(lengths, dtype=torch.int32)
    want = infllm_v2_score_reference(q, compressed, rows, max_blocks)
    assert_scores_close(infllm_v2_score(q, compressed, rows, max_blocks), want, 1e-5)
    tiled = infllm_v2_score(q, compressed, rows, max_blocks, block_w=16, max_splits=3, num_warps=2, dot=False)
    assert_scores_close(tiled, want, 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_scores_equal_the_reference(dtype):
    """16-bit q and keys (fp16 enters tl.dot as it is; bf16 as fp32 under the interpreter), D = 8 (the dot
    pads K to 16): within the reference's fp32 sums over the same 16-bit values."""
    lengths = [700, 95]
    compressed, _ = random_compressed(2, 2, 8, 12, lengths, seed=5, dtype=dtype)
    q = (torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(2)) * 2).to(dtype)
    rows = torch.tensor(lengths, dtype=torch.int32)
    want = infllm_v2_score_reference(q, compressed, rows, 12)
    assert_scores_close(infllm_v2_score(q, compressed, rows, 12), want, 1e-4)


def test_a_bad_lse_tiling_is_refused():
    compressed, _ = random_compressed(1, 1, 8, 2, [100], seed=0)
    with pytest.raises(ValueError, match="block_w=24 must be a power of two >= 16"):
        infllm_v2_score(torch.randn(1, 1, 8), compressed, torch.tensor([100], dtype=torch.int32), 2, block_w=24)


def test_compress_append_equals_the_reference_and_the_bulk_windows():
    """Row 0 at every window end of 3 blocks and a few other positions, row 1 never at one (it writes
    nothing); 3 KV heads, D 20. Row 0's windows then equal the bulk ones."""
    batch, kv_heads, d, blocks = 2, 3, 20, 3
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(batch, kv_heads, blocks * 64, d, generator=g)
    got = torch.zeros(batch, kv_heads, 4 * blocks, d)
    want = torch.zeros_like(got)
    for pos in sorted([16 * i + 15 for i in range(4 * blocks)] + [0, 30, 64, 100]):
        positions = torch.tensor([pos, (pos + 7) % (blocks * 64)], dtype=torch.int32)
        infllm_v2_compress_append(got, keys, positions)
        compress_append_reference(want, keys, positions)
    assert rel_err(got, want) < 1e-6 and got[1].abs().sum() == 0
    bulk = torch.zeros_like(got)
    compress_range_reference(bulk, keys, 0, blocks * 64)
    assert rel_err(got[0], bulk[0]) < 1e-6 and got[0, :, : 4 * blocks - 1].abs().amin(-1).gt(0).all()


def decode_both(steps, prompt, kv_heads, group, head_dim, device="cpu", dtype=torch.float32, topk_blocks=4):
    """The same decode through the selector's torch path and its Triton path: yields (step, torch's
    selection, Triton's, the torch path's cache, the Triton path's)."""
    slow = InfLLMV2Selector(topk_blocks=topk_blocks, local_blocks=1)
    fast = InfLLMV2Selector(topk_blocks=topk_blocks, local_blocks=1)
    assert fast.set_backend("triton") == "triton"
    g = torch.Generator(device=device).manual_seed(0)
    cache = PagedKVCache(1, 1, kv_heads, head_dim, 64, prompt + steps, dtype, device)
    keys = torch.randn(1, kv_heads, prompt + steps, head_dim, generator=g, device=device)
    cache.append(0, keys[:, :, :prompt], keys[:, :, :prompt])
    slow.update_metadata(cache, 0, 0, prompt)
    twin = copy.deepcopy(cache)
    for step in range(steps):
        pos = prompt + step
        for c in (cache, twin):
            c.append(0, keys[:, :, pos : pos + 1], keys[:, :, pos : pos + 1])
        positions = torch.tensor([pos], dtype=torch.int32, device=device)
        slow.append_metadata(cache, 0, positions)
        fast.append_metadata(twin, 0, positions)
        q = torch.randn(1, kv_heads, group, head_dim, generator=g, device=device).to(dtype) * 3
        lengths = positions + 1
        num_blocks = (lengths + 63) // 64
        yield step, slow.select(q, cache, 0, lengths), fast.select(q, twin, 0, lengths, num_blocks), cache, twin


def test_triton_path_selects_what_the_torch_path_selects():
    """17 decode steps across a window boundary and a block boundary (prompt 630): the same A."""
    for step, want, got, cache, twin in decode_both(17, 630, kv_heads=2, group=3, head_dim=16):
        assert torch.equal(got.blocks.indices, want.blocks.indices), step
        assert_scores_close(got.scores, want.scores, 1e-5)
        slot = "infllm_v2_compressed"
        assert rel_err(twin.metadata[0][slot], cache.metadata[0][slot]) < 1e-6


# --- GPU ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("context, batch", [(32768, 1), (32768, 8), (131072, 1)])
def test_scores_equal_the_reference_at_the_8b_shape(context, batch):
    """32 query / 8 KV heads, D 128, bf16 compressed keys and queries; rows of different lengths."""
    blocks = context // 64
    lengths = [context - 64 * i - 37 * (i % 2) for i in range(batch)]
    compressed, _ = random_compressed(batch, 8, 128, blocks, lengths, seed=3, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, 32, 128, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda").bfloat16()
    rows = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    want = infllm_v2_score_reference(q, compressed, rows, blocks)
    assert_scores_close(infllm_v2_score(q, compressed, rows, blocks), want, 1e-4)
    for tiling in ({"dot": False}, {"block_w": 64, "max_splits": 256, "num_warps": 8}, {"block_w": 16, "max_splits": 512}):
        assert_scores_close(infllm_v2_score(q, compressed, rows, blocks, **tiling), want, 1e-4)


@pytest.mark.gpu
@gpu
def test_triton_path_selects_what_the_torch_path_selects_on_a_gpu():
    """The 8B shape's heads (8 KV, G 4, D 128) in bf16 from a 20,000-token prompt, 40 steps: the same
    sets wherever they are well defined (checked by the score gap: none within 1e-4 here)."""
    for step, want, got, _, _ in decode_both(40, 20000, kv_heads=8, group=4, head_dim=128, device="cuda",
                                             dtype=torch.bfloat16, topk_blocks=64):
        assert_scores_close(got.scores, want.scores, 1e-4)
        if not torch.equal(got.blocks.indices, want.blocks.indices):
            top = want.scores.sort(-1, descending=True).values
            assert ((top[..., 62] - top[..., 63]).abs() < 1e-4 * top[..., 62]).any(), step


@pytest.mark.gpu
@gpu
def test_triton_path_replays_in_a_cuda_graph():
    """append_metadata + select captured once and replayed step after step equal the same calls made
    eagerly: static shapes, no host synchronisation."""
    b, hkv, group, d, prompt, steps = 2, 8, 4, 128, 3000, 40
    sel = InfLLMV2Selector(topk_blocks=16)
    assert sel.set_backend("triton") == "triton"
    g = torch.Generator(device="cuda").manual_seed(0)
    eager = PagedKVCache(1, b, hkv, d, 64, prompt + steps + 64, torch.bfloat16, "cuda")
    eager.append(0, torch.randn(b, hkv, prompt, d, generator=g, device="cuda").bfloat16(),
                 torch.randn(b, hkv, prompt, d, generator=g, device="cuda").bfloat16())
    sel.update_metadata(eager, 0, 0, prompt)
    graphed = copy.deepcopy(eager)
    pos = torch.full((b,), prompt, dtype=torch.int32, device="cuda")
    q = torch.empty(b, hkv, group, d, dtype=torch.bfloat16, device="cuda")
    out = {}

    def step(cache):
        sel.append_metadata(cache, 0, pos)
        lengths = pos + 1
        return sel.select(q, cache, 0, lengths, num_blocks=(pos + 64).div(64, rounding_mode="floor"))

    def write_token(t):
        k = torch.randn(b, hkv, d, generator=g, device="cuda").bfloat16()
        for cache in (eager, graphed):
            cache.keys[0][:, :, prompt + t] = k
        q.copy_(torch.randn(b, hkv, group, d, generator=g, device="cuda"))
        pos.fill_(prompt + t)

    saved = [t.clone() for t in graphed.metadata[0].values()]
    write_token(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(graphed)  # warm-up (compiles the kernels)
    torch.cuda.current_stream().wait_stream(stream)
    for t, old in zip(graphed.metadata[0].values(), saved, strict=True):
        t.copy_(old)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out["sel"] = step(graphed)
    for t in range(steps):
        if t:
            write_token(t)
        want = step(eager)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out["sel"].blocks.indices, want.blocks.indices), t
        assert torch.equal(out["sel"].scores, want.scores), t
    for name, ref in eager.metadata[0].items():
        assert torch.equal(graphed.metadata[0][name], ref), name


# --- compiles for the H100 / H200 -----------------------------------------------------------------

SCRIPT = textwrap.dedent('''
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import prr.kernels.infllm_v2_jit as K

    F, B16, I32 = "*fp32", "*bf16", "*i32"
    failed = []

    def build(fn, types, constexprs):
        sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
        try:
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4})
        except Exception as e:  # noqa: BLE001 - reported below
            failed.append(f"{fn.__name__} {constexprs}: {type(e).__name__}: {str(e)[:1500]}")

    build(K._compress_append_kernel, {"compressed_ptr": B16, "keys_ptr": B16, "positions_ptr": I32},
          {"WINDOW": 32, "STRIDE": 16, "BLOCK_D": 128})
    sizes = {"GROUP": 4, "GROUP_PAD": 4, "WINDOW": 32, "STRIDE": 16}
    lse_types = {"q_ptr": B16, "compressed_ptr": B16, "lengths_ptr": I32, "max_ptr": F, "sum_ptr": F,
                 "logits_ptr": F, "scale": "fp32"}
    lse_sizes = {**sizes, "WINDOWS_PER_SPLIT": 128, "BLOCK_W": 32, "BLOCK_D": 128, "D_CHUNK": 32}
    build(K._lse_kernel, lse_types, {**lse_sizes, "GROUP_PAD": 16, "DOT": True, "NATIVE_DOT": True})
    build(K._lse_kernel, lse_types, {**lse_sizes, "GROUP_PAD": 16, "DOT": True, "NATIVE_DOT": False})
    build(K._lse_kernel, lse_types, {**lse_sizes, "DOT": False, "NATIVE_DOT": False})
    build(K._lse_kernel, lse_types, {**lse_sizes, "BLOCK_D": 16, "D_CHUNK": 16, "GROUP_PAD": 16, "DOT": True,
                                     "NATIVE_DOT": True})  # the smallest K tl.dot takes (D <= 16 pads to it)
    build(K._pool_kernel, {"lengths_ptr": I32, "max_ptr": F, "sum_ptr": F, "logits_ptr": F, "out_ptr": F},
          {**sizes, "BLOCK": 64, "SPLITS_PAD": 64, "BLOCK_N": 32})
    print("\\n".join(failed) if failed else "all compiled")
    sys.exit(1 if failed else 0)
''')


def test_infllm_v2_kernels_compile_for_sm90():
    """The interpreter accepts code a GPU compile rejects: each kernel compiled ahead of time for
    sm_90 (through ptxas) at the 8B shape, in a subprocess without TRITON_INTERPRET."""
    assert_compiles_for_sm90(SCRIPT, {"TRITON_DEFAULT_FP_FUSION": "1"})
