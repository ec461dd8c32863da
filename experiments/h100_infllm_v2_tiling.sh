#!/usr/bin/env bash
# InfLLM-v2's lse pass on tl.dot (2026-12-07, fifth session), one device call (< 600 s):
#  1. its GPU tests (every tiling against the reference at the 8B shape, the selections, a captured replay);
#  2. experiments/profile_infllm_v2.py --sweep at 32K and 128K, batch 1, walking 32 layers: the selection per
#     kernel beside Quest's, and the scores per lse tiling;
#  3. serial whole runs of quest and infllm_v2 at 32K and 128K (issue 52: infllm_v2 within 1.3x Quest's at 128K).
#   usage on the device: OUT=... bash experiments/h100_infllm_v2_tiling.sh
. "$(dirname "$0")/h200_preamble.sh"
install_wheels
say "gpu tests"
timeout ${TESTS_S:-90} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_infllm_v2.py \
  tests/test_selectors_infllm_v2.py > "$OUT/gpu_tests.txt" 2>&1
tail -2 "$OUT/gpu_tests.txt" | tee -a "$LOG"
say "profile and lse sweep"
timeout ${PROFILE_S:-200} python3 experiments/profile_infllm_v2.py --batches 1 --layers 32 --sweep \
  --out "$OUT/profile_infllm_v2" > /tmp/profile.log 2>&1
echo "rc=$?" | tee -a "$LOG"; grep -E "µs/layer|^sweep" /tmp/profile.log | cut -c1-220 | tee -a "$LOG"
say "serial whole runs"
timeout ${RUNS_S:-260} python3 experiments/bench_engine_runs.py --cases matrix --contexts 32000,128000 --blocks 64 \
  --topk 8 --selectors quest,infllm_v2 --predictors none --steps 24 --timeout 120 --runs /tmp/runs \
  --out "$OUT/engine_serial" > /tmp/runs.log 2>&1
echo "rc=$?" | tee -a "$LOG"; tail -8 /tmp/runs.log | tee -a "$LOG"
say "done"
