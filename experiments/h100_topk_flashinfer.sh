#!/usr/bin/env bash
# Issue 52's and 53's top-k cells beside FlashInfer in one device call (< 600 s): FlashInfer's wheels
# (bench_flashinfer.py's docstring lists them) in the ignored .xfer/fi/, carried with .whl and .xfer;
# its radix top-k JIT-compiles on first use (FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws).
# bench_hinted_topk.py times prr's top-k (one row in registers up to 16,384, the multi-program
# path above), the hinted top-k, torch.topk and flashinfer.top_k on the same rows; sets checked.
#   usage on the device: OUT=... bash experiments/h100_topk_flashinfer.sh
. "$(dirname "$0")/h200_preamble.sh"
install_wheels "$ROOT"/.xfer/fi/*.whl
export FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1 | tee -a "$LOG"
say "bench_hinted_topk with FlashInfer"
timeout ${BENCH_S:-520} python3 experiments/bench_hinted_topk.py --candidates ${CANDIDATES:-8192,32768,131072} \
  --hit-rates 0.7 --out "$OUT/bench_hinted_topk" > "$OUT/bench_hinted_topk.log" 2>&1
echo "rc=$?" | tee -a "$LOG"; tail -${TAIL:-40} "$OUT/bench_hinted_topk.log"
say "done"
