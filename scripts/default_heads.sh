#!/usr/bin/env bash
# Rebuild a packaged base's default heads end to end, resumably (each stage resumes or is skipped once done):
#   self-distilled data -> feature store -> heads -> adapter -> tuned policy.
# Hours of CPU; run it in the background and rerun it after an interruption:
#   nohup scripts/default_heads.sh > runs/default_heads.log 2>&1 &                   (SmolLM2-135M-Instruct)
#   MODEL=gemma3 nohup scripts/default_heads.sh > runs/default_heads_gemma3.log 2>&1 &  (Gemma-3-270M)
#   MODEL=smollm2-feature ...                         (SmolLM2's feature_attention heads, docs/feature-heads.md)
#   MODEL=qwen-coder ...                              (Qwen2.5-Coder-0.5B-Instruct, on code requests)
#   MODEL=qwen-coder-1.5b ...                         (Qwen2.5-Coder-1.5B-Instruct on its native Q4_K_M blocks)
# Stages write under runs/ (ignored by git); the data set is kept in data/ and committed.
# Env: MODEL (smollm2, smollm2-feature, gemma3, qwen-coder or qwen-coder-1.5b), TOKENS (answer tokens), STEPS (training steps), OUT (adapter dir),
#      STORE_TOKENS (store and train on N training tokens, prompts included, a seeded draw of whole sequences: a run that fits a session).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_setup.sh
MODEL=${MODEL:-smollm2}
case "$MODEL" in
  smollm2)  # a chat model: ShareGPT and HumanEval requests, in its chat template
    BASE=(); PROMPTS=sharegpt,humaneval; NEW=384; LAYERS=2,8; RUN=smollm2-135m; TUNE_PROMPTS=mixed
    EXTRA_RUN=; EXTRA_ARGS=()
    TOKENS=${TOKENS:-2000000}; STEPS=${STEPS:-1500} ;;
  smollm2-feature)  # the same data and store; feature_attention heads at L2 (draft) and L8 (intermediate),
    # trained apart and shipped together (docs/feature-heads.md; not the default: not faster, see there)
    MODEL=smollm2; BASE=(); PROMPTS=sharegpt,humaneval; NEW=384; LAYERS=2,8; RUN=smollm2-135m-feature
    TUNE_PROMPTS=mixed; EXTRA_RUN=smollm2-135m-feature-l8; EXTRA_ARGS=(--heads-layers 8 --head-roles intermediate)
    OUT=${OUT:-runs/heads-smollm2-feature}; TOKENS=${TOKENS:-2000000}; STEPS=${STEPS:-1400} ;;
  gemma3)  # a pretrained base model: plain-text continuations
    BASE=(--base gemma3-270m); PROMPTS=continuation; NEW=256; LAYERS=2,4,6,9; RUN=gemma3-270m; TUNE_PROMPTS=continuation
    EXTRA_RUN=; EXTRA_ARGS=()
    TOKENS=${TOKENS:-1000000}; STEPS=${STEPS:-800} ;;
  qwen-coder)  # a code chat model: ShareGPT's requests about code and HumanEval (held-out problems left out)
    BASE=(--base qwen2.5-coder-0.5b); PROMPTS=sharegpt-code,humaneval; NEW=384; LAYERS=2,4,6,9,12
    RUN=qwen2.5-coder-0.5b; TUNE_PROMPTS=code; EXTRA_RUN=; EXTRA_ARGS=()
    TOKENS=${TOKENS:-600000}; STEPS=${STEPS:-500} ;;
  qwen-coder-1.5b)  # the same prompts; the base decodes its GGUF blocks (the default), 16 answers at a time
    BASE=(--base qwen2.5-coder-1.5b); PROMPTS=sharegpt-code,humaneval; NEW=384; LAYERS=2,4,7,10,14
    RUN=qwen2.5-coder-1.5b; TUNE_PROMPTS=code; EXTRA_RUN=; EXTRA_ARGS=()
    SELFDISTILL=(--dtype native --batch-size 16 --shard-records 256 --shard-seconds 300)
    STORE_ARGS=(--dtype native)  # the states the heads will read when decoding: the GGUF blocks'
    TUNE_DTYPES=native  # what it decodes by default (float32 would be 6 GB and hours of tuning)
    TOKENS=${TOKENS:-600000}; STEPS=${STEPS:-500} ;;
  *) echo "MODEL must be smollm2, smollm2-feature, gemma3, qwen-coder or qwen-coder-1.5b" >&2; exit 2 ;;
esac
[ -n "${SELFDISTILL+x}" ] || SELFDISTILL=(--batch-size 48 --shard-records 128 --shard-seconds 240)
[ -n "${STORE_ARGS+x}" ] || STORE_ARGS=()
TUNE_DTYPES=${TUNE_DTYPES:-bfloat16,float32}
DATA=data/selfdistill-$MODEL
STORE=store-$MODEL
OUT=${OUT:-runs/heads-$MODEL}
stamp() { echo "=== $(date +%H:%M:%S) $*"; }

stamp "self-distilled data: $TOKENS answer tokens ($DATA)"
resume=(); [ -f "$DATA/hispec_selfdistill.json" ] && resume=(--resume)
hispec-selfdistill "${BASE[@]}" --prompts "$PROMPTS" --out "$DATA" --max-tokens "$TOKENS" --max-new-tokens "$NEW" \
  "${SELFDISTILL[@]}" "${resume[@]}"

# runs/<stage>.done holds the data size a finished stage was built from; runs/<stage>.building the size of
# the one in progress (an interrupted stage of the same size resumes, anything else starts again)
SIZE=$TOKENS; cap=()
if [ -n "${STORE_TOKENS:-}" ]; then SIZE=$TOKENS/$STORE_TOKENS; cap=(--max-tokens "$STORE_TOKENS"); fi
mode_for() { [ -e "runs/$1" ] && [ "$(cat "runs/$1.building" 2>/dev/null)" = "$SIZE" ] && echo --resume || echo --overwrite; }

stamp "feature store (runs/$STORE)"
if [ "$(cat "runs/$STORE.done" 2>/dev/null)" != "$SIZE" ]; then
  mode=$(mode_for "$STORE")
  # a store of the same data set resumes even with another cap: a larger one (or none) grows it
  if [ -e "runs/$STORE" ] && [ "$(cut -d/ -f1 "runs/$STORE.building" 2>/dev/null)" = "$TOKENS" ]; then mode=--resume; fi
  echo "$SIZE" > "runs/$STORE.building"
  hispec-store "${BASE[@]}" --dataset "$DATA" --out "runs/$STORE" --layers "$LAYERS" --eval-sequences 64 \
    "${STORE_ARGS[@]}" "${cap[@]}" $mode
  echo "$SIZE" > "runs/$STORE.done"
fi

train_run() {  # train_run NAME [recipe overrides...]: runs/NAME from recipes/$RUN.yaml, resumably
  local name=$1; shift
  stamp "heads: $STEPS steps (runs/$name)"
  if [ "$(cat "runs/$name.done" 2>/dev/null)" != "$SIZE" ]; then
    mode=$(mode_for "$name")
    echo "$SIZE" > "runs/$name.building"
    hispec-train --recipe "recipes/$RUN.yaml" --max-steps "$STEPS" --output-dir "runs/$name" "$@" $mode
    echo "$SIZE" > "runs/$name.done"
  fi
}
train_run "$RUN"
with=()
if [ -n "$EXTRA_RUN" ]; then  # the intermediate head, trained apart and shipped beside the draft head
  train_run "$EXTRA_RUN" "${EXTRA_ARGS[@]}"
  hispec-export "runs/$EXTRA_RUN" --out "runs/heads-$EXTRA_RUN" --overwrite
  with=(--with-exits "runs/heads-$EXTRA_RUN")
fi

stamp "export to $OUT, tune"
hispec-export "runs/$RUN" --out "$OUT" --overwrite "${with[@]}"
hispec-tune "${BASE[@]}" --heads "$OUT" --dtypes "$TUNE_DTYPES" --num-prompts 8 --prompts "$TUNE_PROMPTS" --write-calibration
stamp "done: copy $OUT to hispec_decode/default_heads/${BASE[1]:-smollm2-135m} to ship it"
