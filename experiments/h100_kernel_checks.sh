#!/usr/bin/env bash
# One device call (< 600 s) for kernel work built on the CPU (2026-12-07, fifth session):
#  1. InfLLM-v2's scores from stored logits (the pool pass no longer re-reads the keys): its GPU tests,
#     then experiments/profile_infllm_v2.py per kernel beside Quest's, walking 4 and 32 layers, here
#     and in the tree before the change (unpacked in the ignored .xfer/before, carried);
#  2. a branch's token-list decode kernel that shares the block kernel's prologue and tail, its tree
#     unpacked in the ignored .xfer/dedupe (carried): its GPU tests, then bench_token_attention
#     --quick there and in this tree (before / after on one GPU).
#   usage on the device: OUT=... bash experiments/h100_kernel_checks.sh
. "$(dirname "$0")/h200_preamble.sh"
install_wheels
say "infllm_v2: gpu tests"
timeout ${V2_TESTS_S:-90} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_infllm_v2.py \
  tests/test_selectors_infllm_v2.py > "$OUT/gpu_tests_infllm_v2.txt" 2>&1
tail -2 "$OUT/gpu_tests_infllm_v2.txt" | tee -a "$LOG"
for tree in after before; do
  dir=$ROOT; selectors=quest,infllm_v2
  [[ $tree == before ]] && { dir=$ROOT/.xfer/before; selectors=infllm_v2; }
  [[ -d $dir ]] || continue
  say "profile_infllm_v2 ($tree)"
  (cd "$dir" && PYTHONPATH=$ROOT/.site:$dir timeout ${PROFILE_S:-100} python3 experiments/profile_infllm_v2.py --batches 1 \
    --layers 4,32 --selectors $selectors --out "$OUT/profile_infllm_v2_$tree" > "/tmp/profile_$tree.log" 2>&1)
  echo "rc=$?" | tee -a "$LOG"; grep "µs/layer" "/tmp/profile_$tree.log" | tee -a "$LOG"
done
[[ -d .xfer/dedupe ]] || { say "no .xfer/dedupe: part 2 skipped"; exit 0; }
say "dedupe: gpu tests"
(cd .xfer/dedupe && PYTHONPATH=$ROOT/.site:$ROOT/.xfer/dedupe timeout ${TESTS_S:-100} python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_kernels_token_sparse_decode.py tests/test_kernels_sparse_decode.py > "$OUT/gpu_tests_dedupe.txt" 2>&1)
tail -2 "$OUT/gpu_tests_dedupe.txt" | tee -a "$LOG"
for tree in main dedupe; do
  dir=$ROOT; [[ $tree == dedupe ]] && dir=$ROOT/.xfer/dedupe
  say "bench_token_attention --quick ($tree)"
  (cd "$dir" && PYTHONPATH=$ROOT/.site:$dir timeout ${BENCH_S:-70} python3 experiments/bench_token_attention.py --quick \
    --out "$OUT/bench_token_attention_$tree" > "/tmp/bench_$tree.log" 2>&1); echo "rc=$?" | tee -a "$LOG"
  tail -14 "/tmp/bench_$tree.log" | tee -a "$LOG"
done
say "done"
