#!/usr/bin/env bash
# One device call (< 600 s), sixth session (2026-12-07):
#  1. where selector=indexer's serial token goes (1.67x Quest's at 32K, selection_runs_20261207): the graph
#     engine's step traced kernel by kernel (experiments/step_breakdown.py), indexer block 1 top-2048 tokens
#     beside Quest block 16 K = 128 (the same 2,048 tokens), 32K, views serial, P = A, ema;
#  2. reuse=steps' buffers in one launch a layer (keep_selection, append_newest_block(out=)), built last
#     session on the CPU: the steps of experiments/h100_reuse_keep.sh (GPU tests, whole runs every 2 and 4).
#   usage on the device: OUT=... bash experiments/h100_indexer_profile.sh
. "$(dirname "$0")/h200_preamble.sh"
install_wheels
say "step_breakdown: indexer beside quest at the same tokens"
timeout ${BREAKDOWN_S:-240} python3 experiments/step_breakdown.py --cells indexer:32000:1:2048,quest:32000:16:128 \
  --views serial,prr_p=a,prr_ema --replays 20 --traced 3 --out "$OUT/breakdown" > /tmp/breakdown.log 2>&1
echo "rc=$?" | tee -a "$LOG"; tail -12 /tmp/breakdown.log | cut -c1-220 | tee -a "$LOG"
cp /tmp/breakdown.log "$OUT/breakdown/log.txt" 2>/dev/null
say "reuse=steps buffers (h100_reuse_keep.sh's steps)"
mkdir -p "$OUT/reuse_keep"
(KERNEL_TESTS="tests/test_kernels_keep_selection.py tests/test_kernels_append_newest.py" BENCH=0 TESTS_S=120 \
  OUT=$OUT/reuse_keep bash "$(dirname "$0")/h100_append_newest.sh" > /dev/null 2>&1)
echo "rc=$?" | tee -a "$LOG"; cat "$OUT/reuse_keep/log.txt" | cut -c1-200 | tee -a "$LOG"
say "done"
