#!/usr/bin/env bash
# One device call (< 480 s), sixth session (2026-12-07), after the indexer's step inputs became one kernel
# (kernels/indexer_step.py) and its projection one fused GEMV of the graph engine (the layer's RMSNorm inside
# dense_gemv, written into the selector's slot: Selector.hidden_projection):
#  1. GPU tests: dense_gemv (out=), the step kernel, the indexer in both engines;
#  2. whole runs: selector=indexer (block 1, top-2,048 tokens) beside Quest (block 16, K = 128: the same
#     tokens) serial, 32K and 128K, 24 steps (bench_engine_runs.py);
#  3. the indexer's serial step traced kernel by kernel beside Quest's at 32K (step_breakdown.py);
#  4. the multi-program top-K's chunk (programs per row) at 32K and 128K candidates, k = 2,048, 1 and 8 rows
#     (bench_topk_long.py --chunk 1024 / 2048 / default): the indexer's top-K is 29 µs a layer at 32K.
# Seventh session (CPU only: no device lent): exact-mode PRR over tokens keeps P's scores only and repairs in one
# launch (kernels/token_sparse_decode.token_scores, prr_repair.repair_and_merge part_out=None): its GPU tests join
# step 1, the PRR views (P = A, ema) join step 3, and step 2b times the indexer's PRR whole runs at 32K
# (ema, P = A replayed, the profiled budget at a replayed 0.8): the issue's whole-run row for the indexer.
# CONTEXTS (default 32000,128000), TESTS=0, SERIAL_RUNS=0, BREAKDOWN=0, PRR_RUNS=0 and CHUNKS="" (none) shorten it.
#   usage on the device: OUT=... bash experiments/device_packed.sh experiments/device_indexer_fused.sh
. "$(dirname "$0")/h200_preamble.sh"
install_wheels
if [[ ${TESTS:-1} != 0 ]]; then say "gpu tests"
timeout ${TESTS_S:-120} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_dense_gemv.py \
  tests/test_kernels_indexer_step.py tests/test_kernels_token_repair.py tests/test_kernels_token_sparse_decode.py \
  > "$OUT/gpu_tests_kernels.txt" 2>&1
tail -1 "$OUT/gpu_tests_kernels.txt" | tee -a "$LOG"
timeout ${TESTS_S:-120} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_one_engine.py -k indexer \
  > "$OUT/gpu_tests_engines.txt" 2>&1
tail -1 "$OUT/gpu_tests_engines.txt" | tee -a "$LOG"; fi
if [[ ${SERIAL_RUNS:-1} != 0 ]]; then say "whole runs"
timeout ${RUNS_S:-150} python3 experiments/bench_engine_runs.py --cases matrix --contexts ${CONTEXTS:-32000,128000} --blocks 1 \
  --topk 2048 --selectors indexer --predictors none --steps 24 --timeout 70 --runs /tmp/ri --out "$OUT/engine_indexer" \
  > /tmp/i.log 2>&1
echo "rc=$?" | tee -a "$LOG"; tail -3 /tmp/i.log | cut -c1-160 | tee -a "$LOG"
timeout ${RUNS_S:-100} python3 experiments/bench_engine_runs.py --cases matrix --contexts ${CONTEXTS:-32000,128000} --blocks 16 \
  --topk 128 --selectors quest --predictors none --steps 24 --timeout 60 --runs /tmp/rq --out "$OUT/engine_quest_k128" \
  > /tmp/q.log 2>&1
echo "rc=$?" | tee -a "$LOG"; tail -3 /tmp/q.log | cut -c1-160 | tee -a "$LOG"; fi
if [[ ${PRR_RUNS:-1} != 0 ]]; then say "indexer PRR whole runs, 32K"
timeout ${PRR_RUNS_S:-150} python3 experiments/bench_engine_runs.py --cases matrix --contexts 32000 --blocks 1 \
  --topk 2048 --selectors indexer --predictors ema --hit-rates 1.0 --profiled-hit-rates 0.8 --steps 24 --timeout 70 \
  --runs /tmp/rp --out "$OUT/engine_indexer_prr" > /tmp/p.log 2>&1
echo "rc=$?" | tee -a "$LOG"; tail -5 /tmp/p.log | cut -c1-160 | tee -a "$LOG"; fi
if [[ ${BREAKDOWN:-1} != 0 ]]; then say "step_breakdown"
timeout ${BREAKDOWN_S:-100} python3 experiments/step_breakdown.py --cells indexer:32000:1:2048,quest:32000:16:128 \
  --views serial,prr_p=a,prr_ema --replays 20 --traced 3 --out "$OUT/breakdown" > /tmp/b.log 2>&1
echo "rc=$?" | tee -a "$LOG"; tail -3 /tmp/b.log | cut -c1-200 | tee -a "$LOG"; fi
for chunk in ${CHUNKS-1024 2048 default}; do
  say "bench_topk_long chunk $chunk"
  extra=(); [[ $chunk != default ]] && extra=(--chunk "$chunk")
  timeout ${TOPK_S:-40} python3 experiments/bench_topk_long.py --candidates 32768,131072 --k 2048 --rows 1,8 \
    "${extra[@]}" --out "$OUT/topk_chunk_$chunk" > /tmp/t.log 2>&1
  echo "rc=$?" | tee -a "$LOG"; tail -6 /tmp/t.log | cut -c1-200 | tee -a "$LOG"
done
say "done"
