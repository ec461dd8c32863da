"""The multi-program top-k's kernels (kernels/topk_radix_jit.py) compile for an H100 / H200 (sm_90,
through ptxas) on a CPU: the interpreter accepts code a GPU compile rejects. The level pass with and
without FINISH (multi_program_finish), the emit, at the launcher's sizes (chunk 4096, tile 2048,
cap 4096 and 512, 8 warps) and with the unit stride Triton specialises a contiguous row to; the
registers and spills of each are printed (pytest -s) for the lead's GPU runs."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import assert_compiles_for_sm90

SCRIPT = textwrap.dedent('''
    import os
    import subprocess
    import sys
    import tempfile
    import triton
    import triton.backends.nvidia
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import prr.kernels.topk_radix_jit as R

    failed = []
    POINTERS = {"scores_ptr": "*fp32", "hint_out_ptr": "*fp32", "hint_ptr": "*fp32"}

    def resource_usage(cubin):
        """cuobjdump's registers / spill line of a cubin (no driver here: CompiledKernel.n_regs is unset)."""
        tool = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        return " ".join(line.strip() for line in out.splitlines() if "REG" in line)

    def build(fn, constexprs):
        fixed = dict(constexprs, stride_sn=1, PDL=False)
        sig = {n: "constexpr" if n in fixed else POINTERS.get(n, "*i32" if n.endswith("_ptr") else "i32")
               for n in fn.arg_names}
        try:
            compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=fixed),
                                      target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
            print(fn.__name__, constexprs, resource_usage(compiled.asm["cubin"]))
        except Exception as e:  # noqa: BLE001 - reported below
            failed.append(f"{fn.__name__} {constexprs}: {type(e).__name__}: {str(e)[:1500]}")

    for cap in (4096, 512):
        radix = 4 if cap <= 512 else 2
        for level, finish, write in ((1, False, False), (2, False, False), (1, True, False), (1, True, True)):
            build(R._radix_level_kernel, {"LEVEL": level, "CHUNK": 4096, "TILE": 2048, "CAP": cap,
                  "CAND_RADIX": radix, "FINISH": finish, "PAD_BLOCK": 256, "WRITE_HINT": write,
                  "WRITE_PATH": write})
    for write in (False, True):
        build(R._radix_emit_kernel, {"CHUNK": 4096, "TILE": 2048, "CHUNKS_BLOCK": 8, "PAD_BLOCK": 256,
              "WRITE_HINT": write, "WRITE_PATH": write})
    print("\\n".join(failed) if failed else "all compiled")
    sys.exit(1 if failed else 0)
''')


@pytest.mark.slow  # Triton compiles for a GPU target: make test-full (the GPU runs compile them for real)
def test_multi_program_topk_kernels_compile_for_sm90():
    assert_compiles_for_sm90(SCRIPT, {"TRITON_DEFAULT_FP_FUSION": "1"})
