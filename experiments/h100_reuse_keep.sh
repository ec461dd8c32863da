#!/usr/bin/env bash
# One device call (< 600 s) for reuse=steps' buffers in one launch a layer (2026-12-07, not run yet):
# keep_selection (a selecting step keeps each layer's A, count and scores: 4 torch launches before) and
# append_newest_block writing the buffers (between selections, in place under between=last: 1 launch, 3
# before). Their GPU tests and the reuse GPU tests; then whole runs of reuse=steps (every 2 and 4) beside
# serial DSA for quest at 32K, block 64, K = 8, here and, where carried, in the tree before (.xfer/before):
# before, every 2 ran 1.004x serial and every 4 0.979x (a selecting step +2.8% over serial).
#   usage on the device: OUT=... bash experiments/h100_reuse_keep.sh
. "$(dirname "$0")/h200_preamble.sh"
install_wheels
say "gpu tests: the kernels"
timeout ${TESTS_S:-120} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_keep_selection.py \
  tests/test_kernels_append_newest.py > "$OUT/gpu_tests_kernels.txt" 2>&1
tail -3 "$OUT/gpu_tests_kernels.txt" | tee -a "$LOG"
say "gpu tests: reuse on the engine"
timeout ${REUSE_TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_selection_reuse.py \
  > "$OUT/gpu_tests_reuse.txt" 2>&1
tail -3 "$OUT/gpu_tests_reuse.txt" | tee -a "$LOG"
for tree in after before; do
  dir=$ROOT; [[ $tree == before ]] && dir=$ROOT/.xfer/before
  [[ -d $dir ]] || continue
  say "reuse=steps runs ($tree)"
  (cd "$dir" && PYTHONPATH=$ROOT/.site:$dir timeout ${RUNS_S:-150} python3 experiments/bench_engine_runs.py --cases matrix \
    --contexts 32000 --blocks 64 --topk 8 --selectors quest --predictors none --reuse-every 2,4 --steps ${STEPS:-24} \
    --timeout 100 --runs /tmp/runs_$tree --out "$OUT/engine_reuse_steps_$tree" > /tmp/steps_$tree.log 2>&1)
  echo "rc=$?" | tee -a "$LOG"; tail -5 /tmp/steps_$tree.log | tee -a "$LOG"
done
say "done"
