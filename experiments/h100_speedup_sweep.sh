#!/usr/bin/env bash
# The paper-style speedup sweep (conf/experiment/speedup.yaml: predictors none, last_step, ema, oracle at
# 8K-127K, 8B shape, bf16, Triton, 64 tokens each) through run.py on one GPU, half of its contexts a
# device call (< 600 s), each half's serial baseline in the same call as its PRR runs:
#   PART=short  task.prompt_tokens=8192,32768      PART=long  task.prompt_tokens=65536,126976
# collected on the device (experiments/collect_sweep.py) into $OUT/speedup_8b_$PART.{csv,json}; the
# figure speedup_sweep_h100 (analysis/figures.py) reads both halves.
#   usage on the device: OUT=... PART=short bash experiments/h100_speedup_sweep.sh
. "$(dirname "$0")/h200_preamble.sh"
install_wheels
case ${PART:?set PART=short or PART=long} in
  short) contexts=8192,32768 ;;
  long) contexts=65536,126976 ;;
  *) say "PART=$PART: not short or long"; exit 2 ;;
esac
say "sweep: task.prompt_tokens=$contexts"
timeout ${SWEEP_S:-470} python3 run.py -m +experiment=speedup task.prompt_tokens=$contexts \
  hydra.sweep.dir=/tmp/multirun/speedup_$PART > /tmp/sweep.log 2>&1
echo "rc=$?" | tee -a "$LOG"; grep -i -E "error|Traceback|tok/s|latency" /tmp/sweep.log | tail -12 | cut -c1-200 | tee -a "$LOG"
say "collect"
python3 experiments/collect_sweep.py /tmp/multirun/speedup_$PART "$OUT/speedup_8b_$PART" \
  --command "python run.py -m +experiment=speedup task.prompt_tokens=$contexts (on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))" > /tmp/collect.log 2>&1
echo "rc=$?" | tee -a "$LOG"; tail -20 /tmp/collect.log | cut -c1-200 | tee -a "$LOG"
python3 - "$OUT/speedup_8b_$PART.csv" <<'PY' | tee -a "$LOG"
import sys, pandas as pd
f = pd.read_csv(sys.argv[1])
cols = [c for c in ("prompt_tokens", "predictor", "status", "token_latency_median_ms", "hit_rate") if c in f]
print(f[cols].to_string(index=False))
PY
say "done"
