"""The exact and LESS kernels compile for an H200 (sm_90, through ptxas) on a CPU: the
interpreter accepts code a GPU compile rejects, so every kernel of prr.kernels.exact_jit and
prr.kernels.less_jit is compiled ahead of time for its constexpr variants, in a subprocess
without TRITON_INTERPRET (the test session decorates kernels for the interpreter); once with
every int argument an i32 and once with the unit strides as the constexpr 1 Triton specialises
them to (how the launchers' contiguous tensors arrive)."""

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
    import prr.kernels.exact_jit as E
    import prr.kernels.less_jit as L

    F, B16, I32 = "*fp32", "*bf16", "*i32"
    failed = []
    UNIT = ("stride_qd", "stride_kd", "stride_vd", "stride_ln", "stride_pp", "stride_on", "stride_ic", "stride_ch",
            "stride_Sd", "stride_sm", "stride_om", "stride_Td", "stride_tm", "stride_um", "stride_nd", "stride_mg",
            "stride_pg", "stride_od", "stride_lg", "stride_wd", "stride_ed", "stride_qlm", "stride_qg", "stride_pod",
            "stride_pls", "stride_rd", "stride_xd")

    def build(fn, types, constexprs, **options):
        for unit in (False, True):
            fixed = dict(constexprs)
            if unit:
                fixed.update({n: 1 for n in fn.arg_names if n in UNIT})
            sig = {n: "constexpr" if n in fixed else types.get(n, "i32") for n in fn.arg_names}
            try:
                triton.compile(ASTSource(fn=fn, signature=sig, constexprs=fixed), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": 4, **options})
            except Exception as e:  # noqa: BLE001 - reported below
                failed.append(f"{fn.__name__} {fixed}: {type(e).__name__}: {str(e)[:800]}")

    for dtype, native, precision in ((B16, True, "tf32"), (B16, False, "tf32"), (F, False, "ieee")):
        for group, block, tile_blocks in ((4, 16, 8), (1, 64, 2), (8, 16, 1)):
            build(E._exact_block_lse_kernel, {"q_ptr": dtype, "k_ptr": dtype, "lengths_ptr": I32, "num_blocks_ptr": I32,
                  "block_lse_ptr": F, "part_lse_ptr": F, "qk_scale": "fp32"},
                  {"GROUP": group, "GROUP_PAD": 16, "HEAD_DIM": 128, "BLOCK_SIZE": block, "TILE_BLOCKS": tile_blocks,
                   "TILES": 4, "NATIVE_DOT": native, "INPUT_PRECISION": precision, "PDL": False})
        # with P's speculation in the same launch (StaticPlan.speculate_in_selection)
        build(E._exact_lse_speculate_kernel, {"q_ptr": dtype, "k_ptr": dtype, "v_ptr": dtype, "lengths_ptr": I32,
              "num_blocks_ptr": I32, "block_lse_ptr": F, "part_lse_ptr": F, "ids_ptr": I32, "counts_ptr": I32,
              "spec_out_ptr": F, "spec_lse_ptr": F, "qk_scale": "fp32"},
              {"GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "TILE_BLOCKS": 8, "TILES": 4,
               "NATIVE_DOT": native, "INPUT_PRECISION": precision, "SUB_TILE": 16, "PRECISE_PV": native, "PDL": False})
    for group, pad in ((4, 4), (1, 1), (3, 4)):
        for sum_group in (False, True):
            build(E._exact_block_mass_kernel, {"block_lse_ptr": F, "part_lse_ptr": F, "num_blocks_ptr": I32, "out_ptr": F},
                  {"GROUP": group, "GROUP_PAD": pad, "BLOCKS_PER_PART": 32, "PART_CHUNK": 256, "BLOCK_N": 128,
                   "SUM_GROUP": sum_group, "PDL": False})
    for summary in (F, B16):
        for group, pad, given, merge, out in ((4, 16, False, False, F), (1, 16, True, True, B16), (8, 16, False, True, B16)):
            build(L._less_compensate_kernel, {"q_ptr": B16, "qlog_ptr": F, "w_ptr": F, "ids_ptr": I32,
                  "counts_ptr": I32, "lengths_ptr": I32, "big_ptr": summary, "small_ptr": summary, "offset_ptr": F,
                  "big_tot_ptr": F, "small_tot_ptr": F, "offset_tot_ptr": F, "center_ptr": F, "part_out_ptr": F,
                  "part_lse_ptr": F, "out_ptr": out, "lse_ptr": F, "scale": "fp32", "sqrt_scale": "fp32",
                  "half_log_m": "fp32", "min_relative_mass": "fp32"},
                  {"GROUP": group, "GROUP_PAD": pad, "HEAD_DIM": 128, "NUM_FEATURES": 32, "M_BLOCK": 32, "D_BLOCK": 8,
                   "C_BLOCK": 32, "LOGITS_GIVEN": given, "MERGE": merge, "SPLITS_PAD": 4, "PDL": False})
        for block, quest in ((16, True), (64, True), (64, False)):
            build(L._less_append_kernel, {"k_ptr": B16, "v_ptr": B16, "positions_ptr": I32, "w_ptr": F, "center_ptr": F,
                  "big_ptr": summary, "small_ptr": summary, "offset_ptr": F, "big_tot_ptr": F, "small_tot_ptr": F,
                  "offset_tot_ptr": F, "key_max_ptr": B16, "key_min_ptr": B16, "sqrt_scale": "fp32",
                  "half_log_m": "fp32"},
                  {"HEAD_DIM": 128, "BLOCK_SIZE": block, "M_BLOCK": 16, "D_BLOCK": 32, "QUEST": quest, "PDL": False})
    print("\\n".join(failed) if failed else "all compiled")
    sys.exit(1 if failed else 0)
''')


# 8-45 s of Triton compiles for a GPU target: `make test-full` (the H200 runs compile them for real)
@pytest.mark.slow
def test_exact_and_less_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # (silences triton 3.9's notice)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    assert "all compiled" in done.stdout
