#!/usr/bin/env bash
# One device call (< 600 s) for the reuse=steps newest-block op (2026-12-07): append_newest_block's
# GPU tests and the reuse GPU tests; per-call kernels and µs of with_newest (mask before, torch, triton:
# experiments/bench_append_newest.py); whole runs of reuse=steps (every 2 and 4) beside serial DSA for
# quest at 32K, block 64, K = 8, here and in the tree before the op (the ignored .xfer/before, carried).
# TREES (default "after before") names the trees run; KERNEL_TESTS names the kernels' test files (default: the append's); BENCH=0 skips the per-call bench.
#   usage on the device: OUT=... bash experiments/h100_append_newest.sh
. "$(dirname "$0")/h200_preamble.sh"
install_wheels
say "gpu tests: the kernel"
timeout ${TESTS_S:-90} python3 -m pytest -q -p no:cacheprovider -m gpu ${KERNEL_TESTS:-tests/test_kernels_append_newest.py} \
  > "$OUT/gpu_tests_kernel.txt" 2>&1
tail -3 "$OUT/gpu_tests_kernel.txt" | tee -a "$LOG"
if [[ ${BENCH:-1} != 0 ]]; then
  say "bench_append_newest"
  timeout ${BENCH_S:-90} python3 experiments/bench_append_newest.py --out "$OUT/append_newest" > /tmp/bench.log 2>&1
  echo "rc=$?" | tee -a "$LOG"; tail -22 /tmp/bench.log | tee -a "$LOG"
fi
say "gpu tests: reuse on the engine"
timeout ${REUSE_TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_selection_reuse.py \
  > "$OUT/gpu_tests_reuse.txt" 2>&1
tail -3 "$OUT/gpu_tests_reuse.txt" | tee -a "$LOG"
for tree in ${TREES:-after before}; do
  dir=$ROOT; [[ $tree == before ]] && dir=$ROOT/.xfer/before
  [[ -d $dir ]] || continue
  say "reuse=steps runs ($tree)"
  (cd "$dir" && PYTHONPATH=$ROOT/.site:$dir timeout ${RUNS_S:-150} python3 experiments/bench_engine_runs.py --cases matrix \
    --contexts 32000 --blocks 64 --topk 8 --selectors quest --predictors none --reuse-every 2,4 --steps ${STEPS:-24} \
    --timeout 100 --runs /tmp/runs_$tree --out "$OUT/engine_reuse_steps_$tree" > /tmp/steps_$tree.log 2>&1)
  echo "rc=$?" | tee -a "$LOG"; tail -5 /tmp/steps_$tree.log | tee -a "$LOG"
done
say "done"
