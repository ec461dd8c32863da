#!/usr/bin/env bash
# Issue 33's closing measurements in one device call (< 560 s on an H200), most important first:
#  1. GPU tests of this session's kernels (InfLLM, LESS, bench_hit_rate's captured replay);
#  2. whole runs at 32K, block 16, K 32: every selector serial and with ema (|P| = K): InfLLM and
#     LESS against Quest, and PRR against its own serial run;
#  3. the stage map of the cells the controlled-hit-rate runs use, then those runs
#     (predictor=bench_hit_rate at 0.9 and 1.0, teacher-forced) and budget=profiled at 1.0,
#     for Quest and InfLLM at block 16 and Quest at block 64;
#  4. whole runs at 128K, block 64, K 32: Quest, InfLLM, exact, serial and with ema.
# Everything lands in $OUT (at most 8 files come back).
#   usage on the device: PYTHONPATH=$PWD bash experiments/h200_issue33_final.sh
set -u
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the output folder}
W=/tmp/issue33final && mkdir -p $W
LOG=$OUT/log.txt
BUDGET=${BUDGET:-540}
say() { echo "[$SECONDS s] $*" | tee -a "$LOG"; }
left() { echo $((BUDGET - SECONDS)); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"
git log -1 --format='tree of %h %s' 2>/dev/null | tee -a "$LOG"

say "gpu tests"
timeout 50 python3 -m pytest -q -m gpu tests/test_bench_hit_rate.py tests/test_kernels_infllm.py \
  tests/test_kernels_less.py -x > "$OUT/gpu_tests.txt" 2>&1
tail -1 "$OUT/gpu_tests.txt" | tee -a "$LOG"

say "whole runs, 32K block 16 K 32, every selector, none and ema"
timeout 170 python3 experiments/bench_engine_runs.py --cases matrix --contexts 32000 --blocks 16 --topk 32 \
  --selectors quest,infllm,infllm_prr,less,exact --predictors none,ema --steps 32 --timeout 40 \
  --runs $W/runs32 --out $W/matrix32k >> "$LOG" 2>&1
cp $W/matrix32k.json $OUT/ 2>/dev/null

say "stage map"
timeout 45 python3 experiments/bench_decode.py --parts stage --stage-layers 4 --hit-rates 1.0,0.9,0.7,0.5 \
  --stage-cells quest:32768:16:512,infllm:32768:16:512,quest:32768:64:2048 --out $W/stage >> "$LOG" 2>&1
cp $W/stage_stage.csv $OUT/stage_map.csv 2>/dev/null

say "controlled hit rates, block 16"
timeout $(( $(left) - 150 )) python3 experiments/bench_engine_runs.py --cases matrix --contexts 32000 --blocks 16 \
  --topk 32 --selectors quest,infllm --predictors none --hit-rates 0.9,1.0 --profiled-hit-rates 1.0 --steps 32 \
  --timeout 40 --runs $W/runsh --stage-map $W/stage_stage.csv --out $W/hitrates_b16 >> "$LOG" 2>&1
cp $W/hitrates_b16.json $OUT/ 2>/dev/null

say "controlled hit rate 1.0, block 64"
timeout $(( $(left) - 100 )) python3 experiments/bench_engine_runs.py --cases matrix --contexts 32000 --blocks 64 \
  --topk 32 --selectors quest --predictors none --hit-rates 1.0 --profiled-hit-rates 1.0 --steps 32 \
  --timeout 40 --runs $W/runs64 --stage-map $W/stage_stage.csv --out $W/hitrates_b64 >> "$LOG" 2>&1
cp $W/hitrates_b64.json $OUT/ 2>/dev/null

say "whole runs, 128K block 64 K 32"
timeout $(( $(left) - 3 )) python3 experiments/bench_engine_runs.py --cases matrix --contexts 128000 --blocks 64 \
  --topk 32 --selectors quest,infllm,exact,less --predictors none,ema --steps 32 --timeout 40 \
  --runs $W/runs128 --out $W/matrix128k >> "$LOG" 2>&1
cp $W/matrix128k.json $OUT/ 2>/dev/null
say "done"
