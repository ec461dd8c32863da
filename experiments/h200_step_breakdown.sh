#!/usr/bin/env bash
# Issue 33: where the whole PRR step's extra time goes (experiments/step_breakdown.py), then why
# InfLLM's 128K whole run outlived its 40 s limit (one run.py run, its log kept). One device call.
#   usage on the device: PYTHONPATH=$PWD OUT=... bash experiments/h200_step_breakdown.sh
set -u
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the output folder}
W=/tmp/stepbreakdown && mkdir -p $W
LOG=$OUT/log.txt
say() { echo "[$SECONDS s] $*" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"

say "step breakdown"
timeout ${BREAKDOWN_S:-300} python3 experiments/step_breakdown.py \
  --cells ${CELLS:-quest:32000:16:32,infllm:32000:16:32,quest:130816:64:32} --out $OUT >> "$LOG" 2>&1
say "infllm 128K whole run"
timeout ${INFLLM_S:-200} python3 experiments/bench_engine_runs.py --cases matrix --contexts 128000 --blocks 64 \
  --topk 32 --selectors infllm --predictors none --steps 32 --timeout $(( ${INFLLM_S:-200} - 20 )) \
  --runs $W/runs --out $W/infllm128k >> "$LOG" 2>&1
cp $W/infllm128k.json $OUT/ 2>/dev/null
find $W/runs -name "*.log" -exec tail -n 40 {} \; > $OUT/infllm128k_runlog.txt 2>/dev/null
say "done"
tail -n 30 "$LOG"
