"""The predictor kernels compile for an H200 (sm_90, through ptxas) on a CPU: the interpreter
accepts code a GPU compile rejects (module globals read inside @triton.jit, scalar/block type
mixes, constexpr branches), so every kernel of prr.kernels.predict_jit and each of its
constexpr variants is compiled ahead of time, in a subprocess without TRITON_INTERPRET (the
test session decorates kernels for the interpreter). Ints equal to 1 are compiled as the
constexprs Triton specialises them to."""

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
    import prr.kernels.predict_jit as J

    F, U8, I32, I64 = "*fp32", "*u8", "*i32", "*i64"
    failed = []

    def build(fn, types, constexprs, **options):
        sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
        try:
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 8, **options})
        except Exception as e:  # noqa: BLE001 - reported below
            failed.append(f"{fn.__name__} {constexprs}: {type(e).__name__}: {str(e)[:800]}")

    rank = {"ema_ptr": F, "sel_ptr": U8, "stick_ptr": F, "rec_ptr": F, "num_blocks_ptr": I64, "z_ptr": F, "zsel_ptr": U8,
            "rank_ptr": F, "source_stickiness": "fp32", "temporal_weight": "fp32", "cross_weight": "fp32"}
    for mix in (0, 1, 2):
        build(J._ema_rank_kernel, rank, {"MIX": mix, "TILE": 4096, "PDL": False}, enable_fp_fusion=False)
    build(J._ema_rank_kernel, rank, {"MIX": 0, "TILE": 16, "PDL": True, "recent_blocks": 1}, enable_fp_fusion=False)
    update = {"scores_ptr": F, "idx_ptr": I32, "cnt_ptr": I64, "alpha_ptr": F, "ema_ptr": F, "sel_ptr": U8, "z_ptr": F,
              "zsel_ptr": U8}
    for write_z in (False, True):
        build(J._ema_update_kernel, update, {"WRITE_Z": write_z, "TILE": 4096, "IDX_TILE": 128, "PDL": False})
    build(J._ema_update_kernel, update, {"WRITE_Z": False, "TILE": 16, "IDX_TILE": 128, "PDL": True, "capacity": 1})
    for mode in (0, 1, 2):
        build(J._scatter_selected_kernel, {"row_ptr": F, "scores_ptr": F, "idx_ptr": I64, "cnt_ptr": I32, "scale": "fp32",
              "bonus": "fp32"}, {"MODE": mode, "TILE": 2048, "IDX_TILE": 128, "PDL": False})
    for draw, per_layer in ((False, False), (True, False), (True, True)):
        build(J._spin_rank_kernel, {"vertical_ptr": F, "diagonal_ptr": F, "num_blocks_ptr": I32, "updates_ptr": I64,
              "rank_ptr": F, "draw_ptr": F, "key": "i32"},
              {"DRAW": draw, "KEY_PER_LAYER": per_layer, "TILE": 4096, "PDL": False})
    build(J._spin_update_kernel, {"scores_ptr": F, "idx_ptr": I32, "cnt_ptr": I32, "vertical_ptr": F, "diagonal_ptr": F,
          "member_ptr": U8, "updates_ptr": I64, "alpha_vertical": "fp32", "alpha_diagonal": "fp32",
          "selection_bonus": "fp32"}, {"TILE": 4096, "IDX_TILE": 128, "PDL": False})
    lists = {"query_ptr": "*bf16", "keys_ptr": F, "set_ids_ptr": I32, "set_cnt_ptr": I32, "last_sel_ptr": U8,
             "last_z_ptr": F, "filled_ptr": I64, "num_blocks_ptr": I32, "pending_ptr": F, "has_pending_ptr": U8,
             "recent_bonus": "fp32", "tie": "fp32"}
    build(J._qsim_rank_kernel, {**lists, "rank_ptr": F},
          {"NEIGHBOURS": 2, "C_BLOCK": 64, "M_ROWS": 2, "Q_TILE": 128, "TILE": 4096, "IDX_TILE": 128, "PDL": False},
          enable_fp_fusion=False)
    # the 8B shape's K = 32 and K = 128 lists at |P| = 32 and 128, with and without the fill list (256 lanes);
    # a short row; 33 neighbours (64 rows of lanes: the rows' bits in int64)
    for neighbours, m_rows, block, k_block, fill in ((2, 4, 8192, 64, True), (2, 4, 8192, 32, False),
                                                     (2, 4, 8192, 128, False), (2, 4, 8192, 128, True),
                                                     (2, 4, 64, 16, True), (33, 64, 64, 16, False)):
        build(J._qsim_propose_kernel, {"similarity_ptr": F, "set_ids_ptr": I32, "set_cnt_ptr": I32, "last_z_ptr": F,
              "filled_ptr": I64, "num_blocks_ptr": I32, "fill_ptr": I32, "fill_valid_ptr": U8, "idx_out_ptr": I32,
              "count_out_ptr": I32, "scratch_row_ptr": I32, "recent_bonus": "fp32", "tie": "fp32"},
              {"NEIGHBOURS": neighbours, "C_BLOCK": 64, "M_ROWS": m_rows, "K_BLOCK": k_block, "BLOCK": block,
               "HAS_FILL": fill, "RADIX_BITS": 2, "PAD_BLOCK": 256, "PDL": False}, enable_fp_fusion=False,
              num_warps=4)
    for slots, q_chunk in ((8, 512), (1, 4096)):
        build(J._qsim_similarity_kernel, {"query_ptr": "*bf16", "keys_ptr": F, "pending_ptr": F, "has_pending_ptr": U8,
              "similarity_ptr": F}, {"SLOTS": slots, "Q_CHUNK": q_chunk}, num_warps=4)
    for block, fill_block in ((8192, 256), (64, 16)):
        build(J._qsim_fill_kernel, {"last_z_ptr": F, "fill_ptr": I32, "count_ptr": I32, "fill_valid_ptr": U8,
              "tie": "fp32"}, {"BLOCK": block, "FILL_BLOCK": fill_block, "RADIX_BITS": 2, "PAD_BLOCK": 256,
                               "PDL": False}, enable_fp_fusion=False)
    for pair in (False, True):
        build(J._qsim_update_kernel, {"scores_ptr": F, "idx_ptr": I32, "cnt_ptr": I32, "keys_ptr": F,
              "set_ids_ptr": I32, "set_cnt_ptr": I32, "pending_ptr": F, "has_pending_ptr": U8, "cursor_ptr": I64,
              "last_sel_ptr": U8, "last_z_ptr": F},
              {"PAIR": pair, "TILE": 4096, "IDX_TILE": 128, "Q_TILE": 128, "PDL": False})
    build(J._qsim_counters_kernel, {"has_pending_ptr": U8, "cursor_ptr": I64, "filled_ptr": I64}, {})
    build(J._qsim_counters_kernel, {"has_pending_ptr": U8, "cursor_ptr": I64, "filled_ptr": I64}, {"cache_size": 1})
    print("\\n".join(failed) if failed else "all compiled")
    sys.exit(1 if failed else 0)
''')


# 8-60 s of Triton compiles for a GPU target: `make test-full` (the H200 runs compile them for real)
@pytest.mark.slow
def test_predictor_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # (silences triton 3.9's notice; the kernels that need it off say so)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "all compiled" in done.stdout
