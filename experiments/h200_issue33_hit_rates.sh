#!/usr/bin/env bash
# Issue 33, items 4-5 and query_similarity's propose, in one device call (< 330 s on an H200):
# GPU tests of predictor=bench_hit_rate and the query_similarity kernels; the stage map of the
# cells the whole runs use; whole runs at controlled hit rates (predictor=bench_hit_rate, a
# benchmark tool) beside serial DSA and the map's prediction; budget=profiled at those rates; and
# bench_predictors for query_similarity at 128K / block 16. Everything lands in $OUT (8 files).
#   usage on the device: PYTHONPATH=$PWD bash experiments/h200_issue33_hit_rates.sh
set -u
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the output folder}
W=/tmp/issue33 && mkdir -p $W
LOG=$OUT/log.txt
say() { echo "[$SECONDS s] $*" | tee -a "$LOG"; }
left() { echo $((${BUDGET:-320} - SECONDS)); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"

say "gpu tests"
timeout 50 python3 -m pytest -q -m gpu tests/test_bench_hit_rate.py tests/test_kernels_predict.py \
  -k "float32 or query_similarity" > "$OUT/gpu_tests.txt" 2>&1
tail -1 "$OUT/gpu_tests.txt" | tee -a "$LOG"

say "stage map"
timeout 50 python3 experiments/bench_decode.py --parts stage --stage-layers 4 --hit-rates 1.0,0.9,0.7,0.5 \
  --stage-cells quest:32768:16:512,infllm:32768:16:512,quest:32768:64:2048 --out $W/stage >> "$LOG" 2>&1
cp $W/stage.json $OUT/stage_map.json 2>/dev/null
cp $W/stage_stage.csv $OUT/stage_map.csv 2>/dev/null

say "query_similarity propose"
timeout 35 python3 experiments/bench_predictors.py --predictors query_similarity --contexts 131072 --blocks 16 \
  --budgets 32,128 --out $W/pred >> "$LOG" 2>&1
cp $W/pred/bench_predictors.json $OUT/bench_predictors_qsim.json 2>/dev/null

say "whole runs, 32K block 16 K 32"
timeout $(( $(left) - 45 )) python3 experiments/bench_engine_runs.py --cases matrix --contexts 32000 --blocks 16 \
  --topk 32 --selectors quest,infllm --predictors none --hit-rates 0.5,0.7,0.9 --profiled-hit-rates 0.9 --steps 32 \
  --timeout 60 --runs $W/runs --stage-map $W/stage_stage.csv --out $W/runs_b16 >> "$LOG" 2>&1
cp $W/runs_b16.json $OUT/engine_runs_b16.json 2>/dev/null

say "whole runs, 32K block 64 K 32 (hit rate 1)"
timeout $(( $(left) - 3 )) python3 experiments/bench_engine_runs.py --cases matrix --contexts 32000 --blocks 64 \
  --topk 32 --selectors quest --predictors none --hit-rates 1 --profiled-hit-rates 1 --steps 32 \
  --timeout 50 --runs $W/runs64 --stage-map $W/stage_stage.csv --out $W/runs_b64 >> "$LOG" 2>&1
cp $W/runs_b64.json $OUT/engine_runs_b64.json 2>/dev/null
say "done"
