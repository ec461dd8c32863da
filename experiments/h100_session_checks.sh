#!/usr/bin/env bash
# What the 2026-12-07 fourth session built on the CPU and could not check on a GPU (its device
# budget was 0), in one device call (< 600 s). Not run yet: its first run is the check.
#  1. the GPU tests of that work: reuse=steps on the graph engine (two captured views a step),
#     reuse in scored tasks, the indexer from a kept prefill, the prefill tail's batched selections
#     (the top-K without a stable sort now sits in the torch select path the engine captures);
#  2. whole runs of reuse=steps (every 2 and 4) beside serial DSA for quest and infllm_v2 at 32K,
#     block 64, K = 8 blocks, priced by prr.cost_model from the committed H100 stage map;
#  3. the stage map of infllm_v2 at 32K walking 32 layers instead of 4 (docs/results/cost_model.md:
#     whole runs spend ~14 us more a layer on its selection than the 4-layer map; L2 the suspect).
# Everything lands in $OUT.   usage on the device: OUT=... bash experiments/h100_session_checks.sh
. "$(dirname "$0")/h200_preamble.sh"
install_wheels
STAGE_MAP=${STAGE_MAP:-experiments/results/h100/issue52_followup_20261207/bench_decode_stage_infllm_v2_stage.csv}
say "gpu tests"
timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_selection_reuse.py \
  tests/test_scored_reuse.py tests/test_indexer_replay.py tests/test_selectors_tail.py tests/test_blocks.py \
  > "$OUT/gpu_tests.txt" 2>&1
tail -3 "$OUT/gpu_tests.txt" | tee -a "$LOG"
say "reuse=steps runs"
timeout ${STEPS_S:-250} python3 experiments/bench_engine_runs.py --cases matrix --contexts 32000 --blocks 64 --topk 8 \
  --selectors quest,infllm_v2 --predictors none --reuse-every 2,4 --steps ${STEPS:-24} --timeout 100 \
  --stage-map "$STAGE_MAP" --runs /tmp/runs_steps --out "$OUT/engine_reuse_steps" > /tmp/steps.log 2>&1
echo "rc=$?" | tee -a "$LOG"; tail -10 /tmp/steps.log | tee -a "$LOG"
say "stage map, 4 and 32 layers"
for layers in 4 32; do
  timeout ${MAP_S:-80} python3 experiments/bench_decode.py --parts stage --stage-layers $layers \
    --stage-cells quest:32768:64:512,infllm_v2:32768:64:512 --hit-rates 1.0 \
    --out "$OUT/bench_decode_stage_layers$layers" > /tmp/map$layers.log 2>&1
  echo "rc=$?" | tee -a "$LOG"; tail -6 /tmp/map$layers.log | tee -a "$LOG"
done
say "done"
