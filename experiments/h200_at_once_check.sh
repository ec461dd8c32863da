#!/usr/bin/env bash
# One device call (< 400 s on an H200) for what the CPU-built changes of 2026-12-04 left unmeasured:
#  1. GPU tests: spin learning at the step's end (layer-range launches, captured, bf16) and
#     query_similarity's hit counters at the step's end (one launch on the side stream);
#  2. whole runs, Quest 32K, block 16, K = 32: serial, spin and query_similarity (1.065x and 1.100x
#     before, engine_matrix_predictors_32k_7a7fcba);
#  3. query_similarity's propose at 128K, block 16, selections of K = 128 blocks, |P| = 32 and 128
#     (the [512 x 128] register compares a review flagged).
# Everything lands in $OUT (log.txt, gpu_tests.txt, csv + json per benchmark).
#   usage on the device: PYTHONPATH=$PWD/.site:$PWD OUT=... bash experiments/h200_at_once_check.sh
. "$(dirname "$0")/h200_preamble.sh"

say "gpu tests"
timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_graph_decode.py \
  -k "learning_at_once or counters_at_step_end" > "$OUT/gpu_tests.txt" 2>&1
tail -3 "$OUT/gpu_tests.txt" | tee -a "$LOG"

say "whole runs: quest 32K b16 K32, none/spin/query_similarity"
timeout ${RUNS_S:-240} python3 experiments/bench_engine_runs.py --cases matrix --contexts 32000 --blocks 16 \
  --topk 32 --selectors quest --predictors none,spin,query_similarity --steps 32 --timeout 70 \
  --runs /tmp/runs --out "$OUT/engine_matrix_spin_qsim_32k" > /tmp/matrix.log 2>&1
tail -8 /tmp/matrix.log | tee -a "$LOG"

say "query_similarity propose, K = 128"
timeout ${BENCH_S:-60} python3 experiments/bench_predictors.py --predictors query_similarity --contexts 131072 \
  --blocks 16 --budgets 32,128 --topk 128 --qs-fill-width 0 --out "$OUT/qsim_k128" > /tmp/qsim_k128.log 2>&1
tail -4 /tmp/qsim_k128.log | tee -a "$LOG"
say "done"
