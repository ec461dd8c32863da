#!/usr/bin/env bash
# One closing device call (< 560 s on an H200), most important first:
#  1. GPU tests: ema learning at once (captured), the study counters, graph-engine scoring;
#  2. step_breakdown.py: ema learning at once against after each layer (32K block 16, 128K block 64);
#  3. whole runs (run.py) at 32K, block 16, K 32: every selector serial and with ema (|P| = K);
#  4. whole runs at 128K, block 64, K 32, as far as the time goes.
# Everything lands in $OUT (at most 8 files come back).
#   usage on the device: PYTHONPATH=$PWD OUT=... bash experiments/h200_closing_check.sh
set -u
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the output folder}
W=/tmp/closingcheck && mkdir -p $W
LOG=$OUT/log.txt
BUDGET=${BUDGET:-540}
say() { echo "[$SECONDS s] $*" | tee -a "$LOG"; }
left() { echo $((BUDGET - SECONDS)); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"

say "gpu tests"
timeout ${TESTS_S:-110} python3 -m pytest -q -m gpu tests/test_graph_decode.py -k at_once \
  tests/test_study_counters.py tests/test_graph_scoring.py > "$OUT/gpu_tests.txt" 2>&1
tail -3 "$OUT/gpu_tests.txt" | tee -a "$LOG"

say "step breakdown, ema at once"
timeout ${BREAKDOWN_S:-90} python3 experiments/step_breakdown.py --cells quest:32000:16:32,quest:130816:64:32 \
  --replays 40 --traced 3 --out $W > $W/breakdown.log 2>&1
tail -n 22 $W/breakdown.log >> "$LOG"; cp $W/step_breakdown.csv $W/step_breakdown_kernels.csv $OUT/ 2>/dev/null

say "whole runs, 32K block 16 K 32"
timeout ${MATRIX32_S:-170} python3 experiments/bench_engine_runs.py --cases matrix --contexts 32000 --blocks 16 --topk 32 \
  --selectors quest,infllm,less,exact --predictors none,ema --steps 32 --timeout 40 \
  --runs $W/runs32 --out $W/matrix32k >> "$LOG" 2>&1
cp $W/matrix32k.json $OUT/ 2>/dev/null

say "whole runs, 128K block 64 K 32"
timeout $(( $(left) - 5 )) python3 experiments/bench_engine_runs.py --cases matrix --contexts 128000 --blocks 64 \
  --topk 32 --selectors quest,infllm,exact,less --predictors none,ema --steps 32 --timeout 80 \
  --runs $W/runs128 --out $W/matrix128k >> "$LOG" 2>&1
cp $W/matrix128k.json $OUT/ 2>/dev/null
say "done"
grep -v "^  " "$LOG" | tail -n 40
