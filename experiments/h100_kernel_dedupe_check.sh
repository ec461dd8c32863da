#!/usr/bin/env bash
# One device call (< 600 s) for two pieces built on the CPU:
#  1. InfLLM-v2's selection per kernel beside Quest's, walking 4 and 32 layers
#     (experiments/profile_infllm_v2.py; batch 8 walks 4 layers only: 32 layers of 128K do not fit);
#  2. a branch's token-list decode kernel that shares the block kernel's prologue and tail, its tree
#     unpacked in the ignored .xfer/dedupe (carried): its GPU tests, then bench_token_attention
#     --quick there and in this tree (before / after on one GPU).
#   usage on the device: OUT=... bash experiments/h100_kernel_dedupe_check.sh
. "$(dirname "$0")/h200_preamble.sh"
install_wheels
say "profile_infllm_v2"
timeout ${PROFILE_S:-200} python3 experiments/profile_infllm_v2.py --batches 1 --layers 4,32 --out "$OUT/profile_infllm_v2_b1" \
  > /tmp/profile_b1.log 2>&1; echo "rc=$?" | tee -a "$LOG"; grep "µs/layer" /tmp/profile_b1.log | tee -a "$LOG"
timeout ${PROFILE8_S:-80} python3 experiments/profile_infllm_v2.py --batches 8 --layers 4 --out "$OUT/profile_infllm_v2_b8" \
  > /tmp/profile_b8.log 2>&1; echo "rc=$?" | tee -a "$LOG"; grep "µs/layer" /tmp/profile_b8.log | tee -a "$LOG"
[[ -d .xfer/dedupe ]] || { say "no .xfer/dedupe: part 2 skipped"; exit 0; }
say "dedupe: gpu tests"
(cd .xfer/dedupe && PYTHONPATH=$ROOT/.site:$ROOT/.xfer/dedupe timeout ${TESTS_S:-120} python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_kernels_token_sparse_decode.py tests/test_kernels_sparse_decode.py > "$OUT/gpu_tests_dedupe.txt" 2>&1)
tail -2 "$OUT/gpu_tests_dedupe.txt" | tee -a "$LOG"
for tree in main dedupe; do
  dir=$ROOT; [[ $tree == dedupe ]] && dir=$ROOT/.xfer/dedupe
  say "bench_token_attention --quick ($tree)"
  (cd "$dir" && PYTHONPATH=$ROOT/.site:$dir timeout ${BENCH_S:-80} python3 experiments/bench_token_attention.py --quick \
    --out "$OUT/bench_token_attention_$tree" > "/tmp/bench_$tree.log" 2>&1); echo "rc=$?" | tee -a "$LOG"
  tail -14 "/tmp/bench_$tree.log" | tee -a "$LOG"
done
say "done"
