#!/usr/bin/env bash
# Issue 52's follow-up on the GPU, one device call (< 600 s): the GPU tests of the indexer,
# InfLLM-v2 and long top-k kernels (the fp8 append fix is in them), the indexer benchmark again,
# then whole runs of quest and infllm_v2 (serial, ema, P = A replayed, profiled at a 0.7 hit rate) at 32K (block 64, K 8: infllm_v2's
# selection blocks are 64 tokens). Everything lands in $OUT.
#   usage on the device: OUT=... bash experiments/h100_issue52_followup.sh
. "$(dirname "$0")/h200_preamble.sh"
install_wheels
say "gpu tests"
timeout ${TESTS_S:-110} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_indexer.py \
  tests/test_kernels_infllm_v2.py tests/test_kernels_topk_long.py tests/test_selectors_infllm_v2.py \
  > "$OUT/gpu_tests.txt" 2>&1
tail -3 "$OUT/gpu_tests.txt" | tee -a "$LOG"
say "bench_indexer"
timeout ${INDEXER_S:-110} python3 experiments/bench_indexer.py --out "$OUT/bench_indexer" > /tmp/bench_indexer.log 2>&1
echo "rc=$?" | tee -a "$LOG"; tail -25 /tmp/bench_indexer.log | tee -a "$LOG"
say "whole runs"
timeout ${RUNS_S:-330} python3 experiments/bench_engine_runs.py --cases matrix --contexts 32000 --blocks 64 --topk 8 \
  --selectors quest,infllm_v2 --predictors none,ema --hit-rates 1.0 --profiled-hit-rates 0.7 --steps ${STEPS:-24} --runs /tmp/runs \
  --out "$OUT/engine_matrix_infllm_v2" > /tmp/runs.log 2>&1
echo "rc=$?" | tee -a "$LOG"; tail -20 /tmp/runs.log | tee -a "$LOG"
say "done"
