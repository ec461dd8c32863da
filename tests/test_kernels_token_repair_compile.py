"""Exact-mode PRR's token-state kernels compile for an H100/H200 (sm_90, through ptxas) on a CPU: the
interpreter accepts code a GPU compile rejects. token_sparse_decode_jit.token_scores_kernel and
prr_repair._repair_and_merge_kernel with TOKEN_STATES (and without, the block states' path beside
it) at the 8B shape (32 query / 8 KV heads, D 128, bf16 cache) and top-2,048 lists, with the
tiles the split plan picks (32, and 128 when every split has an SM of its own)."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import assert_compiles_for_sm90

SCRIPT = textwrap.dedent('''
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import prr.kernels.prr_repair as R
    import prr.kernels.token_sparse_decode_jit as T

    B16, F, I32, I8 = "*bf16", "*fp32", "*i32", "*i8"
    failed = []

    def build(fn, types, constexprs):
        sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
        try:
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        except Exception as e:  # noqa: BLE001 - reported below
            failed.append(f"{fn.__name__} {constexprs}: {type(e).__name__}: {str(e)[:1500]}")

    for tile in (32, 128):
        build(T.token_scores_kernel,
              {"q_ptr": B16, "k_ptr": B16, "ids_ptr": I32, "counts_ptr": I32, "lengths_ptr": I32, "scores_ptr": F,
               "scale": "fp32"},
              {"GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "TILE_TOKENS": tile, "NATIVE_DOT": True,
               "INPUT_PRECISION": "tf32", "PDL": False})
        for token_states, block_size in ((True, 1), (False, 1), (False, 16)):
            build(R._repair_and_merge_kernel,
                  {"q_ptr": B16, "k_ptr": B16, "v_ptr": B16, "sel_ptr": I32, "sel_cnt_ptr": I32, "pred_ptr": I32,
                   "pred_cnt_ptr": I32, "lengths_ptr": I32, "part_out_ptr": F, "part_lse_ptr": F, "miss_ptr": I32,
                   "keep_ptr": I8, "split_out_ptr": F, "split_lse_ptr": F, "arrivals_ptr": I32, "out_ptr": B16,
                   "lse_ptr": F, "qk_scale": "fp32"},
                  {"GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "BLOCK_SIZE": block_size, "TILE_TOKENS": tile,
                   "NATIVE_DOT": True, "INPUT_PRECISION": "tf32", "PRECISE_PV": True, "SEL_PAD": 2048,
                   "PRED_PAD": 2048, "LIST_CHUNK": R.LIST_CHUNK, "STATE_CHUNK": 4, "SPLITS_PAD": 16,
                   "MERGE_GROUP": 4, "SPLIT_CHUNK": 16, "TOKEN_STATES": token_states, "PDL": False})
    print("\\n".join(failed) if failed else "all compiled")
    sys.exit(1 if failed else 0)
''')


@pytest.mark.slow  # 26 s on the 2-core CPU: make test-full, as the other compile checks
def test_token_state_kernels_compile_for_sm90():
    assert_compiles_for_sm90(SCRIPT)
