#!/usr/bin/env bash
# The technique map's inputs re-timed with InfLLM-v2's new kernel (analysis/figures.py's
# TECHNIQUE_MAP_INPUTS are of the old one), on one GPU, in two device calls back to back (< 600 s each):
#   PART=map     the stage map (quest and infllm_v2, 32K and 128K, block 64, K = 512 tokens, hit rates 0.7
#                and 1.0), then the PRR matrix at 32K: serial, ema, P = A replayed, profiled at a 0.7 hit rate;
#   PART=reuse   reuse=layers (anchors 2, 4) beside serial at 32K and 128K, priced by STAGE_MAP (the map
#                call's bench_decode_stage_stage.csv, carried back in the tree).
# Then point TECHNIQUE_MAP_INPUTS at the new files and `python -m analysis.make_figures --only technique_map_h100`.
#   usage on the device: OUT=... PART=map bash experiments/h100_technique_inputs.sh
. "$(dirname "$0")/h200_preamble.sh"
install_wheels
case ${PART:?set PART=map or PART=reuse} in
  map)
    say "stage map"
    timeout ${MAP_S:-200} python3 experiments/bench_decode.py --parts stage --stage-layers 4 \
      --stage-cells quest:32768:64:512,infllm_v2:32768:64:512,quest:131072:64:512,infllm_v2:131072:64:512 \
      --hit-rates 0.7,1.0 --out "$OUT/bench_decode_stage" > /tmp/map.log 2>&1
    echo "rc=$?" | tee -a "$LOG"; grep "^stage " /tmp/map.log | tee -a "$LOG"
    say "PRR matrix"
    timeout ${MATRIX_S:-330} python3 experiments/bench_engine_runs.py --cases matrix --contexts 32000 --blocks 64 \
      --topk 8 --selectors quest,infllm_v2 --predictors none,ema --hit-rates 1.0 --profiled-hit-rates 0.7 \
      --steps 24 --timeout 120 --runs /tmp/runs_matrix --out "$OUT/engine_matrix" > /tmp/matrix.log 2>&1
    echo "rc=$?" | tee -a "$LOG"; tail -10 /tmp/matrix.log | cut -c1-240 | tee -a "$LOG" ;;
  reuse)
    [[ -f ${STAGE_MAP:-} ]] || { say "STAGE_MAP=${STAGE_MAP:-} is not a file: carry the map call's stage CSV"; exit 2; }
    say "reuse=layers runs"
    timeout ${REUSE_S:-520} python3 experiments/bench_engine_runs.py --cases matrix --contexts 32000,128000 --blocks 64 \
      --topk 8 --selectors quest,infllm_v2 --predictors none --reuse-anchors 2,4 --steps 24 --timeout 120 \
      --stage-map "$STAGE_MAP" --runs /tmp/runs_reuse --out "$OUT/engine_reuse_layers" > /tmp/reuse.log 2>&1
    echo "rc=$?" | tee -a "$LOG"; tail -14 /tmp/reuse.log | cut -c1-240 | tee -a "$LOG" ;;
  *) say "PART=$PART: not map or reuse"; exit 2 ;;
esac
say "done"
