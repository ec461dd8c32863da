#!/usr/bin/env bash
# Issue 52's kernels on the GPU, one device call (< 600 s): the GPU tests of each new kernel, then
# its benchmark, each cut at its share of the time. Which parts run: PARTS (default all of
# "indexer token topk infllm_v2"). Everything lands in $OUT (log.txt, gpu_tests_<part>.txt,
# bench_<part>.{md,csv,json}).
#   usage on the device: OUT=... PARTS="indexer token" bash experiments/h100_issue52_kernels.sh
. "$(dirname "$0")/h200_preamble.sh"
install_wheels
PARTS=${PARTS:-indexer token topk infllm_v2}
part() {  # $1: name, $2: test files, $3: test seconds, $4: bench seconds, $5...: the bench command
  local name=$1 tests=$2 test_s=$3 bench_s=$4; shift 4
  case " $PARTS " in *" $name "*) ;; *) return ;; esac
  say "$name: gpu tests"
  timeout "$test_s" python3 -m pytest -q -p no:cacheprovider -m gpu $tests > "$OUT/gpu_tests_$name.txt" 2>&1
  tail -2 "$OUT/gpu_tests_$name.txt" | tee -a "$LOG"
  say "$name: bench"
  timeout "$bench_s" "$@" > "/tmp/bench_$name.log" 2>&1
  echo "rc=$?" | tee -a "$LOG"
  tail -${TAIL:-30} "/tmp/bench_$name.log" | tee -a "$LOG"
}
part indexer "tests/test_kernels_indexer.py" ${INDEXER_TESTS_S:-60} ${INDEXER_BENCH_S:-150} \
  python3 experiments/bench_indexer.py --out "$OUT/bench_indexer"
part token "tests/test_kernels_token_sparse_decode.py" ${TOKEN_TESTS_S:-60} ${TOKEN_BENCH_S:-180} \
  python3 experiments/bench_token_attention.py --out "$OUT/bench_token_attention"
part topk "tests/test_kernels_selection.py tests/test_kernels_topk_split.py tests/test_kernels_hinted_topk.py" \
  ${TOPK_TESTS_S:-90} ${TOPK_BENCH_S:-200} python3 experiments/${TOPK_BENCH:-bench_long_topk.py} --out "$OUT/bench_long_topk"
part infllm_v2 "tests/test_kernels_infllm_v2.py tests/test_selectors_infllm_v2.py" ${INFLLM_V2_TESTS_S:-60} \
  ${INFLLM_V2_BENCH_S:-120} python3 experiments/${INFLLM_V2_BENCH:-bench_infllm_v2.py} --out "$OUT/bench_infllm_v2"
say "done"
