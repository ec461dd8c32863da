#!/usr/bin/env bash
# Everything the H200 results come from, in one device call (≈ 9 min; split it over two calls
# if the per-call limit is 10 min): GPU tests, the kernel sweeps, the decode benchmark and the
# token profiles, all written under $OUT; copy them to experiments/results/h200/ afterwards.
#   usage on the device: PYTHONPATH=$PWD bash experiments/h200_session.sh [tests,kernels,decode,profile,flashinfer]
# flashinfer (not in the default set): bench_flashinfer.py (every part) and bench_read_latency.py.
# It needs FlashInfer's wheels in the ignored .whl/ (bench_flashinfer.py's docstring lists them;
# carry .whl). FlashInfer JIT-compiles its kernels on first use (≈ 3 min): a cache saved by an
# earlier call as .whl/fi_ws_h200.tgz is restored first, and the new one is left in $OUT.
set -u
export TRITON_INTERPRET=0
OUT=${OUT:?set OUT to the output folder}
parts=${1:-tests,kernels,decode,profile}
has() { [[ ",$parts," == *",$1,"* ]]; }
if has tests; then
  python3 -m pytest -q -m gpu tests/test_kernels_selection.py tests/test_kernels_cache_append.py tests/test_kernels_dense_gemv.py \
    tests/test_kernels_qkv_append.py tests/test_kernels_sparse_decode.py tests/test_kernels_prr_merge.py tests/test_graph_decode.py \
    tests/test_graph_budget.py tests/test_graph_run.py tests/test_one_engine.py tests/test_engine_ops.py > "$OUT/gpu_tests.log" 2>&1
  tail -1 "$OUT/gpu_tests.log"
  # the same checks with programmatic dependent launch (kernels/pdl.py; opt-in)
  PRR_PDL=1 python3 -m pytest -q -m gpu tests/test_kernels_sparse_decode.py tests/test_kernels_cache_append.py tests/test_kernels_dense_gemv.py tests/test_kernels_qkv_append.py \
    tests/test_graph_decode.py tests/test_graph_run.py > "$OUT/gpu_tests_pdl.log" 2>&1
  tail -1 "$OUT/gpu_tests_pdl.log"
fi
if has kernels; then
  python3 experiments/bench_kernels.py --only decode_tuning --out "$OUT/bench_decode_tuning" > "$OUT/bench_decode_tuning.log" 2>&1
  python3 experiments/bench_kernels.py --only selection --out "$OUT/bench_selection" > "$OUT/bench_selection.log" 2>&1
  tail -3 "$OUT/bench_selection.log"
  python3 experiments/bench_gemv.py --out "$OUT/bench_gemv" 2>&1 | tail -10
fi
if has decode; then
  python3 experiments/bench_decode.py --out "$OUT/bench_decode" > "$OUT/bench_decode.log" 2>&1
  grep -E "^(token|stage) " "$OUT/bench_decode.log" | tail -12
fi
if has flashinfer; then
  python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>&1 | grep -v WARNING
  export PYTHONPATH=$PWD/.site:${PYTHONPATH:-$PWD} PATH=$PWD/.site/bin:$PATH FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws
  [[ -f .whl/fi_ws_h200.tgz ]] && tar xzf .whl/fi_ws_h200.tgz -C /tmp
  python3 experiments/bench_flashinfer.py --topk-split 512,1024,2048,4096 --topk-k 32,128,512 \
    --out "$OUT/bench_flashinfer" > "$OUT/bench_flashinfer.log" 2>&1
  tail -3 "$OUT/bench_flashinfer.log"
  python3 experiments/bench_read_latency.py --out "$OUT/bench_read_latency" > "$OUT/bench_read_latency.log" 2>&1
  tail -3 "$OUT/bench_read_latency.log"
  tar czf "$OUT/fi_ws_h200.tgz" -C /tmp fi_ws
fi
if has profile; then
  for pdl in "" --pdl; do
    for proj in torch fused; do
      python3 experiments/profile_decode.py $pdl --projections $proj --out "$OUT" 2>&1 | tail -1
      python3 experiments/profile_decode.py $pdl --projections $proj --block 64 --out "$OUT" 2>&1 | tail -1
    done
  done
fi
