#!/usr/bin/env bash
# The long-context studies of the opt-in model qwen2.5-coder-0.5b on the H200 (issue 20): its
# 491 MB GGUF reaches the device in pieces (at most 64 MiB travel per device call), is assembled
# and sha256-checked there by prr's own fetch code, converted once, and the studies run in bf16.
# The device keeps /tmp between back-to-back calls, so the pieces wait in $STAGE.
#
#   here:      bash experiments/h200_long_context.sh split          # pieces into /tmp/prr_qwen_pieces
#   here:      bash experiments/h200_long_context.sh stage N        # piece N into .xfer/ (then `receive` there)
#   here:      bash experiments/h200_long_context.sh stage data     # RULER's data and the Python wheels, a call of their own
#   device:    bash experiments/h200_long_context.sh receive        # (carry .xfer) .xfer/* -> $STAGE, sha256 printed
#   device:    bash experiments/h200_long_context.sh prepare        # assemble + verify + convert (prr.model.fetch)
#   device:    bash experiments/h200_long_context.sh locality CONTEXTS | accuracy CONTEXTS
#   device:    [STORE=<a committed run's stem>] BUDGET_S=400 \
#                bash experiments/h200_long_context.sh predictors CONTEXT   # the predictor study, continued
#   device:    STORE=experiments/results/h200/accuracy_qwen_matrix_samples.csv.gz BUDGET_S=400 \
#                bash experiments/h200_long_context.sh campaign CONTEXTS   # issue 34's matrix, continued
#              (one process for every context, BUDGET_S seconds; BATCH samples decoded together)
#              (study output under $OUT, the campaign's store as .csv.gz and locality's files as one
#              .tgz: the device returns at most 8 files of 16 MiB; unpack into experiments/results/h200/)
set -euo pipefail
PIECES=/tmp/prr_qwen_pieces
STAGE=/tmp/prr_qwen_stage
MODEL=qwen2.5-coder-0.5b
cmd=${1:?usage: split | stage N | receive | prepare | locality CONTEXTS | accuracy CONTEXTS | campaign CONTEXTS | predictors CONTEXT}

device_env() {  # the device has no registry: hydra/omegaconf/antlr4/gguf wheels travel in .whl/
  export PRR_CACHE_DIR=$STAGE/cache TRITON_INTERPRET=0
  if [ ! -f "$STAGE/site.done" ]; then  # a marker, so an interrupted install is redone
    rm -rf "$STAGE/site"
    python3 -m pip install -q --no-index --no-deps --target "$STAGE/site" "$STAGE"/whl/*.whl
    touch "$STAGE/site.done"
  fi
  export PYTHONPATH=$STAGE/site:$PWD
}
tree_bytes() {  # what a device call carries of the working tree (tracked and untracked-not-ignored files)
  local n
  n=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1 || true)
  [[ "$n" =~ ^[0-9]+$ ]] || { echo "could not size the working tree (du said: '$n')" >&2; exit 2; }
  echo "$n"
}
out_dir() { echo "${OUT:?set OUT to the folder the study writes into (the device sets it)}"; }

case $cmd in
  split)
    src=$(python3 -c "from prr.model.zoo import ZOO; from prr.paths import cache_dir; print(ZOO['$MODEL'].gguf_path(cache_dir()))")
    [ -f "$src" ] || { echo "no assembled GGUF at $src: run make model-qwen first" >&2; exit 2; }
    rm -rf "$PIECES" && mkdir -p "$PIECES"
    # a call carries the working tree (tracked and untracked-not-ignored files: it grows with committed
    # results) + a piece under 64 MiB, 4 MB to spare (RULER's data and the wheels travel alone: `stage data`)
    tree=$(tree_bytes)
    piece=$(( 64 * 1024 * 1024 - tree - 4000000 ))
    [ "$piece" -gt 8000000 ] || { echo "the working tree ($tree bytes) leaves no room for pieces" >&2; exit 2; }
    echo "pieces of $piece bytes (working tree $tree bytes)"
    split -b "$piece" -d -a 2 "$src" "$PIECES/part"
    (cd "$PIECES" && sha256sum part* > SHA256SUMS && ls | wc -l)
    ;;
  stage)
    rm -rf .xfer && mkdir -p .xfer
    if [ "${2:?piece number or data}" = data ]; then  # RULER's data wheels and the device's Python wheels
      ruler=$(python3 -c "from prr.tasks.ruler_data import data_dir; print(data_dir())")
      mkdir -p .xfer/ruler .xfer/whl && cp "$ruler"/*.whl .xfer/ruler/ && cp .whl/*.whl .xfer/whl/
    else
      cp "$PIECES/part$(printf %02d "$2")" "$PIECES/SHA256SUMS" .xfer/
    fi
    du -sh .xfer
    total=$(( $(tree_bytes) + $(du -sb .xfer | cut -f1) ))
    if [ "$total" -gt $(( 64 * 1024 * 1024 )) ]; then  # the device would refuse the call
      echo "the working tree and .xfer come to $total bytes, over the 64 MiB a call carries: the tree grew since" \
        "split; run split again (pieces sized for today's tree), or move large results files out of the tree for" \
        "the piece calls (git checkout restores them)" >&2
      exit 2
    fi
    ;;
  receive)
    mkdir -p "$STAGE/pieces" "$STAGE/cache/ruler" "$STAGE/whl"
    if [ -d .xfer/ruler ]; then cp .xfer/ruler/*.whl "$STAGE/cache/ruler/" && cp .xfer/whl/*.whl "$STAGE/whl/"; fi
    if [ -f .xfer/SHA256SUMS ]; then cp .xfer/part* .xfer/SHA256SUMS "$STAGE/pieces/"; fi
    (cd "$STAGE/pieces" && if [ -f SHA256SUMS ]; then sha256sum -c --ignore-missing SHA256SUMS; fi && ls; ls "$STAGE/whl")
    ;;
  prepare)
    (cd "$STAGE/pieces" && sha256sum -c SHA256SUMS)  # every piece present and intact
    device_env
    gguf=$(python3 -c "from prr.model.zoo import ZOO; from prr.paths import cache_dir; print(ZOO['$MODEL'].gguf_path(cache_dir()))")
    mkdir -p "$(dirname "$gguf")"
    if [ ! -f "$gguf" ]; then  # assembled under a temp name: an interrupted cat leaves no GGUF behind
      cat "$STAGE"/pieces/part* > "$gguf.tmp" && mv "$gguf.tmp" "$gguf"
    fi
    python3 -m prr.model.fetch $MODEL  # verifies size + sha256 of the whole GGUF, then converts once
    python3 -c "from prr.tasks.ruler_data import verify_all; verify_all()"
    ;;
  locality)  # the committed runs: 16384 as is; 8192 and 32768 with TASKS=niah_multikey_2 STEPS=32;
    # issue 34's 20 prompts: VARIANTS=quest_max TOPK=64 ENGINE=graph BACKEND=triton SAMPLES=10 (64-81 s a context)
    out=$(out_dir)  # an assignment: set -e stops here when OUT is unset
    device_env
    name=locality_long_qwen_${2//,/_}
    rm -rf "${STAGE:?}/locality/$name" && mkdir -p "$STAGE/locality/$name"
    # its five files per context come back as one tar (the device returns at most 8 files)
    trap 'tar czf "$out/$name.tgz" -C "$STAGE/locality/$name" . 2>/dev/null || true' EXIT
    python3 experiments/locality_study.py --model $MODEL --contexts "${2:?contexts}" --tasks "${TASKS:-niah_multikey_2,qa_2}" \
      --steps "${STEPS:-64}" --samples "${SAMPLES:-1}" --engine "${ENGINE:-eager}" --backend "${BACKEND:-torch}" \
      ${VARIANTS:+--variants "$VARIANTS"} ${TOPK:+--topk "$TOPK"} \
      --device cuda --dtype bfloat16 --out "$STAGE/locality/$name/$name"
    ;;
  accuracy)
    out=$(out_dir)  # an assignment: set -e stops here when OUT is unset
    device_env
    python3 experiments/accuracy_study.py --model $MODEL --tasks "${TASKS:-ruler:niah_single_1,ruler:vt}" \
      --contexts "${2:?contexts}" --samples "${SAMPLES:-2}" --budgets "${BUDGETS:-1024,2048}" --ema-budgets "${EMA_BUDGETS-1024}" \
      --selectors "${SELECTORS:-quest,infllm,less,exact}" --max-new-tokens "${NEW_TOKENS:-16}" \
      --device cuda --dtype bfloat16 --out "$out/accuracy_qwen_${2//,/_}"
    ;;
  campaign)  # issue 34's accuracy matrix on the graph engine, resumable: STORE (a committed *_samples.csv[.gz]) is continued
    out=$(out_dir)  # an assignment: set -e stops here when OUT is unset
    device_env
    stem=$STAGE/campaign/accuracy_qwen_matrix  # outside $OUT (emptied per call): back-to-back calls continue it
    mkdir -p "$STAGE/campaign"
    if [ -n "${STORE:-}" ] && [ ! -f "${stem}_samples.csv" ]; then  # (a committed store is gzipped: it outgrew 16 MiB)
      case $STORE in *.gz) gunzip -c "$STORE" > "${stem}_samples.csv" ;; *) cp "$STORE" "${stem}_samples.csv" ;; esac
    fi
    # the store and tables come back, also when cut short; the device returns at most 8 files of 16 MiB
    # each, and the store outgrew that: it comes back gzipped (here: copy it over the committed .csv.gz)
    # The GPU's memory and use are logged every 20 s into $OUT/gpu_use.log (stopped at exit).
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv -l 20 > "$out/gpu_use.log" 2>&1 &
    smi=$!
    trap 'kill "$smi" 2>/dev/null; [ -f "${stem}_samples.csv" ] && gzip -n -c "${stem}_samples.csv" > "$out/$(basename "$stem")_samples.csv.gz"; cp "$stem".csv "$stem".json "$out"/ 2>/dev/null || true' EXIT
    contexts=${2:?contexts}
    tasks=${TASKS:-$(python3 -c "from prr.tasks.ruler import TASKS; print(','.join('ruler:' + t for t in TASKS))")}
    # One process for every context: each config's engine is built and captured once. BATCH samples
    # decode together (default 1; 8: about 1.3 s per prompt for the 17 configs against 2.5-4.5 s, docs/results/accuracy.md). BUDGET_S: no new sample
    # after it; keep it ~100 s under the call's limit (a killed call returns no store: the trap needs an exit).
    # One process only: at 32K and batch 8 it reaches 141 GB of the H200's memory (17 captured engines and
    # the kept prefills), and two processes ran out of memory even at batch 6 (issue34/campaign_workers2_*).
    python3 experiments/accuracy_study.py --model $MODEL --engine graph --backend triton --tasks "$tasks" \
      --contexts "$contexts" --samples "${SAMPLES:-25}" --budgets 1024,2048 --ema-budgets 1024,2048 \
      --selectors "${SELECTORS:-quest,infllm,less,exact}" --max-new-tokens task --device cuda --dtype bfloat16 \
      --batch-size "${BATCH:-1}" --out "$stem" --resume --time-budget "${BUDGET_S:-400}"
    ;;
  predictors)  # issue 34's predictor study over 20 prompts (10 per task) on the graph engine, resumable like the campaign:
    # the store lives in $STAGE (back-to-back calls continue it); STORE=<a committed run's stem> seeds it
    # (its _store.csv.gz and _store.json); every call returns the store and the tables (also when cut short)
    out=$(out_dir)  # an assignment: set -e stops here when OUT is unset
    device_env
    name=predictor_study_qwen_${2:?context}
    stem=$STAGE/predictors/$name
    mkdir -p "$STAGE/predictors"
    if [ -n "${STORE:-}" ] && [ ! -f "${stem}_store.json" ]; then
      cp "${STORE}_store.csv.gz" "${stem}_store.csv.gz" && cp "${STORE}_store.json" "${stem}_store.json"
    fi
    trap 'cp "$stem".csv "$stem".json "${stem}"_*.csv "${stem}"_store.* "$out"/ 2>/dev/null || true' EXIT
    # BUDGET_S: no new prompt after it; keep it ~100 s under the call's limit (the trap needs an exit)
    python3 experiments/predictor_study.py --model $MODEL --tasks ${TASKS:-ruler:niah_multikey_2 ruler:qa_2} \
      --context-tokens "$2" --steps "${STEPS:-64}" --samples "${SAMPLES:-10}" --engine "${ENGINE:-graph}" \
      --device cuda --dtype bfloat16 --no-figures \
      --predictors ${PREDICTORS:-last_step ema ema_calibrated spin query_similarity cross_layer_ema ema_membership} \
      --out "$stem" --resume --time-budget "${BUDGET_S:-400}"
    ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac
