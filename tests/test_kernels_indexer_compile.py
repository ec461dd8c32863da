"""The lightning indexer's kernels compile for an H100/H200 (sm_90, through ptxas) on a CPU: the
interpreter accepts code a GPU compile rejects, so prr.kernels.indexer_score_jit and
prr.kernels.indexer_keys_jit (and indexer_step_jit) are compiled ahead of time for their constexpr variants (bf16 / fp8
keys, bf16 / fp32 q, padded and full head counts), in a subprocess without TRITON_INTERPRET, once
with every int argument an i32 and once with the unit strides as the constexpr 1 Triton specialises
them to (with the pointers and other strides 16-divisible). The score kernel must come out as Hopper tensor-core dots (warp_group_dot) fed by
pipelined asynchronous copies of the key tiles: what makes it byte-bound. The fp8 append's PTX must
quantize with torch's arithmetic (fp8_quantization_ptx_problems: IEEE divisions, no sign-losing
negation, no inexact FMA contraction), the bytes the GPU tests compare with the reference's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import prr.kernels.indexer_keys_jit as K
    import prr.kernels.indexer_score_jit as S
    import prr.kernels.indexer_step_jit as J

    F, B16, F8, I32 = "*fp32", "*bf16", "*fp8e4nv", "*i32"
    UNIT = ("stride_qd", "stride_wh", "stride_kd", "stride_st", "stride_ot", "stride_cd", "stride_kd")
    failed = []

    def fp8_quantization_ptx_problems(ptx):
        """The fp8 append's PTX must do torch's arithmetic: IEEE-rounded divisions (scale = absmax / 448,
        k / scale), no float negation (Triton <= 3.6 lowers -x to 0 - x, which makes -0.0 +0.0: the sign
        goes back as a bit), no FMA contraction but the exact |v| * 2^k + 1.5 * 2^23 of the rounding to
        the e4m3 grid, and the hardware's satfinite round-to-nearest conversion of on-grid values."""
        problems = []
        if ptx.count("div.rn.f32") < 2:
            problems.append("fewer than 2 div.rn.f32 (the scale, k / scale)")
        problems += [f"approximate division {op}" for op in ("div.approx", "div.full", "rcp.approx") if op in ptx]
        if "neg.f32" in ptx:
            problems.append("neg.f32: a float negation (0 - x in Triton <= 3.6 loses the sign of -0.0)")
        problems += [f"FMA contraction {line.strip()}" for line in ptx.splitlines()
                     if "fma.rn.f32" in line and not line.rstrip().endswith("0f4B400000;")]  # 1.5 * 2^23, ROUND_TO_INTEGER
        if "cvt.rn.satfinite.e4m3x2.f32" not in ptx:
            problems.append("no cvt.rn.satfinite.e4m3x2.f32 (the fp32 -> e4m3 store)")
        return problems

    def build(fn, types, constexprs, **options):
        """-> the kernel compiled as the launchers' contiguous tensors arrive (unit strides the constexpr 1,
        pointers and the other strides divisible by 16), after compiling it with every int an i32."""
        kernels = []
        for contiguous in (False, True):
            fixed = dict(constexprs)
            if contiguous:
                fixed.update({n: 1 for n in fn.arg_names if n in UNIT})
            sig = {n: "constexpr" if n in fixed else types.get(n, "i32") for n in fn.arg_names}
            aligned = [i for i, n in enumerate(fn.arg_names) if n not in fixed and (n.endswith("_ptr") or
                       (n.startswith("stride_") and n not in UNIT))]
            attrs = {(i,): [["tt.divisibility", 16]] for i in aligned} if contiguous else {}
            try:
                kernels.append(triton.compile(ASTSource(fn=fn, signature=sig, constexprs=fixed, attrs=attrs),
                                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **options}))
            except Exception as e:  # noqa: BLE001 - reported below
                failed.append(f"{fn.__name__} {fixed}: {type(e).__name__}: {str(e)[:800]}")
        return kernels[-1] if len(kernels) == 2 else None

    for keys, scales in ((B16, False), (F8, True)):
        for q, split in ((B16, False), (F, True)):
            for block_t, heads, stages in ((64, 64, 3), (128, 16, 2)):
                built = build(S._indexer_score_kernel, {"q_ptr": q, "weights_ptr": F, "keys_ptr": keys, "scales_ptr": F,
                              "lengths_ptr": I32, "out_ptr": F},
                              {"FP8": scales, "SPLIT_Q": split, "DOT_FP32": False, "BLOCK_T": block_t, "BLOCK_H": heads,
                               "HEAD_DIM": 128, "NUM_STAGES": stages, "PDL": False}, num_stages=stages)
                if built is not None:
                    ttgir = built.asm["ttgir"]
                    if "warp_group_dot" not in ttgir or "async_copy_global_to_local" not in ttgir:
                        failed.append(f"score kernel keys {keys} q {q} block_t {block_t}: no wgmma fed by async copies")
        for new in (B16, F):
            built = build(K._index_key_append_kernel, {"key_cache_ptr": keys, "key_scales_ptr": F, "k_new_ptr": new,
                          "positions_ptr": I32}, {"FP8": scales, "BLOCK_D": 128, "PDL": False}, num_warps=1)
            if built is not None and scales:
                failed += [f"append kernel k_new {new}: {p}" for p in fp8_quantization_ptx_problems(built.asm["ptx"])]
    # the decode step's inputs (query heads, head weights, the key appended): rope_dim 0 (inv_freq's stand-in
    # pointer) with bf16 keys, RoPE on half the dims with fp8 keys; H_I = 5 (the grid's, not a power of two)
    for keys, scales, rope in ((B16, False, 0), (F8, True, 64)):
        built = build(J._indexer_step_kernel, {"projection_ptr": B16, "positions_ptr": I32, "inv_freq_ptr": F,
                      "norm_weight_ptr": B16, "norm_bias_ptr": B16, "query_ptr": F, "head_weights_ptr": F,
                      "key_cache_ptr": keys, "key_scales_ptr": F, "eps": "fp32"},
                      {"INDEX_HEADS": 5, "INDEX_DIM": 128, "ROPE_DIM": rope, "FP8": scales, "PDL": False}, num_warps=1)
        if built is not None:
            ptx = built.asm["ptx"]
            failed += [f"step kernel keys {keys}: approximate division {op}" for op in ("div.approx", "div.full",
                       "rcp.approx") if op in ptx]
            if scales and "cvt.rn.satfinite.e4m3x2.f32" not in ptx:
                failed.append("step kernel: no cvt.rn.satfinite.e4m3x2.f32 (the fp32 -> e4m3 store)")
    print("\\n".join(failed) if failed else "all compiled")
    sys.exit(1 if failed else 0)
''')


# ~30 s of Triton compiles for a GPU target: `make test-full` (the GPU runs compile them for real)
@pytest.mark.slow
def test_indexer_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # (silences triton 3.9's notice)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    assert "all compiled" in done.stdout
