#!/usr/bin/env bash
# One device call (< 600 s), 2026-12-07 fifth session: reuse=steps after its newest-block kernel, and
# InfLLM-v2 re-priced after its kernel change.
#  (the GPU tests of the newest-block kernel and the captured reuse=steps runs passed in
#  experiments/results/h100/append_newest_20261207);
#  1. the stage map of quest and infllm_v2 at 32K and 128K (block 64, K = 512 tokens, hit rate 1.0; 4 layers:
#     walking 32 changed nothing at 32K, session5_20261207);
#  2. whole runs of infllm_v2 at 32K priced by that map: serial, reuse=steps every 2 / 4 and reuse=layers anchors 2 / 4.
#   usage on the device: OUT=... bash experiments/h100_reuse_and_map.sh
. "$(dirname "$0")/h200_preamble.sh"
install_wheels
say "stage map"
timeout ${MAP_S:-130} python3 experiments/bench_decode.py --parts stage --stage-layers 4 \
  --stage-cells quest:32768:64:512,infllm_v2:32768:64:512,quest:131072:64:512,infllm_v2:131072:64:512 \
  --hit-rates 1.0 --out "$OUT/bench_decode_stage" > /tmp/map.log 2>&1
echo "rc=$?" | tee -a "$LOG"; grep "^stage " /tmp/map.log | tee -a "$LOG"
MAP=$OUT/bench_decode_stage_stage.csv  # (no map, no runs: pricing them by another kernel's map would mislead)
[[ -f $MAP ]] || { say "no stage map: the whole runs are not run"; exit 1; }
say "whole runs, priced by $MAP"
timeout ${RUNS_S:-170} python3 experiments/bench_engine_runs.py --cases matrix --contexts 32000 --blocks 64 --topk 8 \
  --selectors ${SELECTORS:-infllm_v2} --predictors none --reuse-every 2,4 --reuse-anchors 2,4 --steps 24 --timeout 100 \
  --stage-map "$MAP" --runs /tmp/runs --out "$OUT/engine_reuse" > /tmp/runs.log 2>&1
echo "rc=$?" | tee -a "$LOG"; tail -12 /tmp/runs.log | cut -c1-260 | tee -a "$LOG"
say "done"
