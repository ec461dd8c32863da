#!/usr/bin/env bash
# One device call (< 420 s on an H200): whole runs against the stage map once bench_hit_rate learns
# every layer at once (71eb14f; before, its per-layer copies on the side stream cost the runs
# 2.4-4.6% that the map does not count):
#  1. GPU tests: the counters at the step's end with query_similarity captured (d8e20ce's fix),
#     bench_hit_rate's captured replay;
#  2. the stage map of each cell of CELLS (selector:block; default Quest at blocks 64 and 16) at 32K,
#     K = 32 blocks, at hit rates 1.0, 0.95, 0.9;
#  3. whole runs of each cell at 32K, K = 32: serial, bench_hit_rate 1.0 (teacher-forced) and
#     budget=profiled at 1.0, each printed beside the map's prediction at its measured hit rate.
# DTYPE=float32 times the map and the runs in fp32 (where the teacher-forced replay can hold a hit
# rate near 1.0: bf16 last bits flip near-tied selections), TESTS=0 skips step 1.
# Everything lands in $OUT (log.txt, gpu_tests.txt, stage_map.csv, one json + csv per cell).
#   usage on the device: PYTHONPATH=$PWD/.site:$PWD OUT=... [DTYPE=float32] [TESTS=0] [CELLS="quest:16 infllm:16"] bash experiments/h200_stage_map_at_once.sh
. "$(dirname "$0")/h200_preamble.sh"
W=/tmp/stage_map_at_once && mkdir -p $W

DTYPE=${DTYPE:-bfloat16}
[ "${TESTS:-1}" = 1 ] && say "gpu tests" && timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_graph_decode.py tests/test_bench_hit_rate.py \
  -k "counters_at_step_end or replay" > "$OUT/gpu_tests.txt" 2>&1
[ "${TESTS:-1}" = 1 ] && tail -1 "$OUT/gpu_tests.txt" | tee -a "$LOG"

say "stage map, $DTYPE"
CELLS=${CELLS:-quest:64 quest:16}  # selector:block, each at 32K, K = 32 blocks
MAP_CELLS=$(for c in $CELLS; do echo -n "${c%%:*}:32768:${c##*:}:$((32 * ${c##*:}))," ; done)
rm -f $W/stage_stage.csv  # (a warm machine keeps /tmp: never read an earlier call's map)
timeout 90 python3 experiments/bench_decode.py --dtype $DTYPE --parts stage --stage-layers 4 --hit-rates 1.0,0.95,0.9 \
  --stage-cells ${MAP_CELLS%,} --out $W/stage >> "$LOG" 2>&1
cp $W/stage_stage.csv $OUT/stage_map.csv || exit 1

for cell in $CELLS; do
  selector=${cell%%:*} block=${cell##*:}
  say "whole runs, $selector block $block, $DTYPE"
  timeout ${RUNS_S:-110} python3 experiments/bench_engine_runs.py --dtype $DTYPE --cases matrix --contexts 32000 --blocks $block --topk 32 \
    --selectors $selector --predictors none --hit-rates 1.0 --profiled-hit-rates 1.0 --steps 32 --timeout ${RUN_S:-35} \
    --runs $W/runs_${selector}_$block --stage-map $W/stage_stage.csv --out $OUT/hit1_${selector}_b$block > $W/runs.log 2>&1
  tail -6 $W/runs.log | tee -a "$LOG"
done
say "done"
