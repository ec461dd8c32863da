#!/usr/bin/env bash
# One device call (< 420 s on an H200) for query_similarity's two CPU-built changes:
#  1. GPU tests: its kernels against the torch path (the propose's membership by one sort, any K),
#     its learning at once captured against learning after each layer, the profiled budget's graph probe;
#  2. its propose and update at 128K, block 16, |P| = 32 and 128, with selections of K = 32 and 128
#     blocks (32.9 us at K = 128 before, bench_predictors_qsim_k128_17eb1c5);
#  3. whole runs, Quest 32K, block 16, K = 32: serial and query_similarity (1.074x learning after each layer).
# Everything lands in $OUT (log.txt, gpu_tests.txt, csv + json per benchmark).
#   usage on the device: PYTHONPATH=$PWD/.site:$PWD OUT=... bash experiments/h200_qsim_at_once_k128.sh
. "$(dirname "$0")/h200_preamble.sh"

say "gpu tests"
timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_predict.py \
  tests/test_graph_decode.py tests/test_graph_budget.py -k "query_similarity or qsim or learning_at_once or budget" \
  > "$OUT/gpu_tests.txt" 2>&1
tail -3 "$OUT/gpu_tests.txt" | tee -a "$LOG"

for topk in 32 128; do
  say "query_similarity propose, K = $topk"
  timeout ${BENCH_S:-60} python3 experiments/bench_predictors.py --predictors query_similarity --contexts 131072 \
    --blocks 16 --budgets 32,128 --topk $topk --qs-fill-width 0 --out "$OUT/qsim_k$topk" > /tmp/qsim_k$topk.log 2>&1
  tail -3 /tmp/qsim_k$topk.log | tee -a "$LOG"
done

say "whole runs: quest 32K b16 K32, none/query_similarity"
timeout ${RUNS_S:-160} python3 experiments/bench_engine_runs.py --cases matrix --contexts 32000 --blocks 16 \
  --topk 32 --selectors quest --predictors none,query_similarity --steps 32 --timeout 70 \
  --runs /tmp/runs --out "$OUT/engine_matrix_qsim_32k" > /tmp/matrix.log 2>&1
tail -4 /tmp/matrix.log | tee -a "$LOG"
say "done"
