#!/usr/bin/env bash
# One device call (< 300 s on an H200) for what the CPU-built changes of 2026-12-04 left unmeasured:
#  1. GPU tests: exact's speculation in its q·K launch captured on two streams (cross_layer, whose P a
#     layer below writes the same step, and last_step), query_similarity's kernels (propose with
#     the fill list ordered by one sort; the fill list in one launch) against the torch path;
#  2. query_similarity's propose and update at 128K, block 16, |P| = 32 and 128, without the fill
#     list and with it at widths 128 and 256 (bench_predictors.py: P equal to the torch path's).
# Everything lands in $OUT: 8 files, the most that come back (log.txt, gpu_tests.txt, 3 x csv + json).
#   usage on the device: PYTHONPATH=$PWD/.site:$PWD OUT=... [WIDTHS="0 128"] bash experiments/h200_qsim_fill.sh
. "$(dirname "$0")/h200_preamble.sh"

say "gpu tests"
timeout ${TESTS_S:-120} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_exact_speculation.py \
  tests/test_kernels_predict.py -k "speculat or query_similarity or qsim or fill" > "$OUT/gpu_tests.txt" 2>&1
tail -3 "$OUT/gpu_tests.txt" | tee -a "$LOG"

for width in ${WIDTHS:-0 128 256}; do
  say "query_similarity, fill width $width"
  timeout ${BENCH_S:-60} python3 experiments/bench_predictors.py --predictors query_similarity --contexts 131072 \
    --blocks 16 --budgets 32,128 --qs-fill-width $width --out "$OUT/qsim_fill$width" > /tmp/qsim_fill$width.log 2>&1
  tail -3 /tmp/qsim_fill$width.log | tee -a "$LOG"
done
say "done"
