#!/usr/bin/env bash
# Whole runs of the selection levers on the GPU, one device call (< 600 s):
#  1. reuse=layers (anchors 2 and 4) beside serial DSA for quest and infllm_v2 at 32K and 128K,
#     block 64, K = 8 blocks (512 tokens), each priced by prr.cost_model from the stage map of
#     those cells (STAGE_MAP, timed on an H100 the same day);
#  2. selector=indexer (block 1, top-2048 tokens, random weights) serial and with ema at 32K,
#     beside quest serial at the same token budget (block 16, K = 128).
# Everything lands in $OUT.   usage on the device: OUT=... bash experiments/h100_selection_runs.sh
. "$(dirname "$0")/h200_preamble.sh"
install_wheels
STAGE_MAP=${STAGE_MAP:-experiments/results/h100/issue52_followup_20261207/bench_decode_stage_infllm_v2_stage.csv}
say "reuse runs"
timeout ${REUSE_S:-330} python3 experiments/bench_engine_runs.py --cases matrix --contexts 32000,128000 --blocks 64 \
  --topk 8 --selectors quest,infllm_v2 --predictors none --reuse-anchors 2,4 --steps ${STEPS:-24} --timeout 120 \
  --stage-map "$STAGE_MAP" --runs /tmp/runs_reuse --out "$OUT/engine_reuse_layers" > /tmp/reuse.log 2>&1
echo "rc=$?" | tee -a "$LOG"; tail -16 /tmp/reuse.log | tee -a "$LOG"
say "indexer runs"
timeout ${INDEXER_S:-200} python3 experiments/bench_engine_runs.py --cases matrix --contexts 32000 --blocks 1 \
  --topk 2048 --selectors indexer --predictors none,ema --steps ${STEPS:-24} --timeout 150 --runs /tmp/runs_indexer \
  --out "$OUT/engine_indexer" > /tmp/indexer.log 2>&1
echo "rc=$?" | tee -a "$LOG"; tail -12 /tmp/indexer.log | tee -a "$LOG"
timeout 60 python3 experiments/bench_engine_runs.py --cases matrix --contexts 32000 --blocks 16 --topk 128 \
  --selectors quest --predictors none --steps ${STEPS:-24} --runs /tmp/runs_q128 --out "$OUT/engine_quest_k128" > /tmp/q.log 2>&1
echo "rc=$?" | tee -a "$LOG"; tail -3 /tmp/q.log | tee -a "$LOG"
say "done"
