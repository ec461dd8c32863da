#!/usr/bin/env bash
# One device call (< 600 s), sixth session (2026-12-07):
#  1. GPU tests of the indexer's one-launch step inputs (kernels/indexer_step.py) and of the indexer in
#     both engines (tests/test_one_engine.py -k indexer);
#  2. where selector=indexer's serial token goes (1.67x Quest's at 32K, selection_runs_20261207): the graph
#     engine's step traced kernel by kernel (experiments/step_breakdown.py), indexer block 1 top-2048 tokens
#     beside Quest block 16 K = 128 (the same 2,048 tokens), 32K, views serial, P = A, ema; and the indexer's
#     serial step in the tree before the step kernel (the ignored .xfer/before, carried);
#  3. reuse=steps' buffers in one launch a layer (keep_selection, append_newest_block(out=)), built last
#     session on the CPU: the steps of experiments/h100_reuse_keep.sh (GPU tests, whole runs every 2 and 4).
#   usage on the device: OUT=... bash experiments/h100_indexer_profile.sh
. "$(dirname "$0")/h200_preamble.sh"
install_wheels
say "gpu tests: indexer step kernel, indexer in both engines"
timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_indexer_step.py \
  tests/test_kernels_indexer.py > "$OUT/gpu_tests_indexer_kernels.txt" 2>&1
tail -2 "$OUT/gpu_tests_indexer_kernels.txt" | tee -a "$LOG"
timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_one_engine.py -k indexer \
  > "$OUT/gpu_tests_indexer_engines.txt" 2>&1
tail -2 "$OUT/gpu_tests_indexer_engines.txt" | tee -a "$LOG"
for tree in after before; do
  dir=$ROOT; cells=indexer:32000:1:2048,quest:32000:16:128; views=serial,prr_p=a,prr_ema
  [[ $tree == before ]] && { dir=$ROOT/.xfer/before; cells=indexer:32000:1:2048; views=serial; }
  [[ -d $dir ]] || continue
  say "step_breakdown ($tree): $cells $views"
  (cd "$dir" && PYTHONPATH=$ROOT/.site:$dir timeout ${BREAKDOWN_S:-200} python3 experiments/step_breakdown.py \
    --cells $cells --views $views --replays 20 --traced 3 --out "$OUT/breakdown_$tree" > /tmp/breakdown_$tree.log 2>&1)
  echo "rc=$?" | tee -a "$LOG"; tail -8 /tmp/breakdown_$tree.log | cut -c1-220 | tee -a "$LOG"
done
say "reuse=steps buffers (h100_reuse_keep.sh's steps)"
mkdir -p "$OUT/reuse_keep"
(TREES=after KERNEL_TESTS="tests/test_kernels_keep_selection.py tests/test_kernels_append_newest.py" BENCH=0 TESTS_S=120 \
  OUT=$OUT/reuse_keep bash "$(dirname "$0")/h100_append_newest.sh" > /dev/null 2>&1)
echo "rc=$?" | tee -a "$LOG"; grep -v "^\.\.\." "$OUT/reuse_keep/log.txt" | cut -c1-200 | tee -a "$LOG"
say "done"
