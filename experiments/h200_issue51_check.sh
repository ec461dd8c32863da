#!/usr/bin/env bash
# Issue 51's device call: the restructured engine (PRRStep, PredictorSchedule, observers, typed
# ops) against the tree before it, both in this one call (< 600 s on an H100 / H200), then
# issue 53's hinted top-k as far as the time goes:
#  1. GPU tests of the step, its views, the typed ops and the one-engine equivalence (captured;
#     GPU_TESTS: other test files, e.g. the pipelines');
#  2. whole runs of run.py at 32K, block 16, K = 32, 32 steps: quest, infllm, less, exact x
#     {none, ema} (budget=fixed, |P| = K), first in the tree before the change (.xfer/before: the
#     engine files of 0bc17a8, made by `git archive 0bc17a8 prr kernels conf run.py hydra_plugins
#     pyproject.toml experiments/bench_engine_runs.py`), then in this tree;
#  3. hinted top-k: its GPU tests, then bench_hinted_topk.py at 8K-128K candidates, hit rate 0.7.
# Everything lands in $OUT (log.txt, gpu_tests.txt, matrix_before.json, matrix_after.json).
#   usage on the device: OUT=... bash experiments/h200_issue51_check.sh
. "$(dirname "$0")/h200_preamble.sh"
install_wheels

say "gpu tests"
GPU_TESTS=${GPU_TESTS:-tests/test_graph_decode.py tests/test_exact_speculation.py tests/test_less_side_summaries.py \
  tests/test_study_counters.py tests/test_engine_ops.py tests/test_one_engine.py}
timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider -m gpu $GPU_TESTS > "$OUT/gpu_tests.txt" 2>&1
tail -3 "$OUT/gpu_tests.txt" | tee -a "$LOG"

matrix() {  # $1: the tree's dir, $2: the output name, $3: selectors, $4: predictors
  (cd "$1" && PYTHONPATH=$ROOT/.site:$1 timeout ${MATRIX_S:-200} python3 experiments/bench_engine_runs.py \
    --cases matrix --contexts 32000 --blocks 16 --topk 32 --selectors "${3:-quest,infllm,less,exact}" \
    --predictors "${4:-none,ema}" --steps ${STEPS:-32} --timeout 60 --runs /tmp/runs_$2 --out "$OUT/$2" > /tmp/$2.log 2>&1)
  tail -8 /tmp/$2.log | tee -a "$LOG"
}
if [ -n "${SHORT:-}" ]; then  # a short call: every selector serial, Quest with ema too
  for tree in before after; do
    dir=$ROOT; [ $tree = before ] && dir=$ROOT/.xfer/before
    say "whole runs, $tree: serial"
    matrix "$dir" matrix_${tree}_serial quest,infllm,less,exact none
    say "whole runs, $tree: quest ema"
    matrix "$dir" matrix_${tree}_quest_ema quest ema
  done
else
  say "whole runs, the tree before (0bc17a8)"
  matrix "$ROOT/.xfer/before" matrix_before
  say "whole runs, this tree"
  matrix "$ROOT" matrix_after
fi
[ -n "${SKIP_HINTED:-}" ] && { say "done"; exit 0; }
say "hinted top-k: gpu tests"
left() { echo $(( ${BUDGET:-550} - SECONDS )); }
timeout ${HINT_TESTS_S:-60} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_hinted_topk.py \
  tests/test_selectors_hinted_topk.py > "$OUT/gpu_tests_hinted_topk.txt" 2>&1
tail -3 "$OUT/gpu_tests_hinted_topk.txt" | tee -a "$LOG"
say "hinted top-k: bench, $(left) s left"
timeout $(( $(left) - 10 )) python3 experiments/bench_hinted_topk.py --candidates 8192,32768,131072 --hit-rates 0.7 \
  --out "$OUT/bench_hinted_topk" > /tmp/hint.log 2>&1
tail -40 /tmp/hint.log | tee -a "$LOG"
say "done"
