#!/usr/bin/env bash
# Rebuild SmolLM2's default heads end to end, resumably (each stage resumes or is skipped once done):
#   self-distilled data -> feature store -> heads -> adapter -> tuned policy.
# Hours of CPU; run it in the background and rerun it after an interruption:
#   nohup scripts/default_heads.sh > runs/default_heads.log 2>&1 &
# Stages write under runs/ (ignored by git); the data set is kept in data/ and committed.
# Env: TOKENS (answer tokens, default 2000000), STEPS (training steps, default 1500), OUT (adapter dir).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_setup.sh
TOKENS=${TOKENS:-2000000}
STEPS=${STEPS:-1500}
OUT=${OUT:-runs/heads-smollm2}
stamp() { echo "=== $(date +%H:%M:%S) $*"; }

stamp "self-distilled data: $TOKENS answer tokens (data/selfdistill-smollm2)"
hispec-selfdistill --out data/selfdistill-smollm2 --max-tokens "$TOKENS" --batch-size 48 --shard-records 128 \
  --shard-seconds 240 --resume

# runs/<stage>.done holds the data size a finished stage was built from; runs/<stage>.building the size of
# the one in progress (an interrupted stage of the same size resumes, anything else starts again)
mode_for() { [ -e "runs/$1" ] && [ "$(cat "runs/$1.building" 2>/dev/null)" = "$TOKENS" ] && echo --resume || echo --overwrite; }

stamp "feature store (runs/store-smollm2)"
if [ "$(cat runs/store-smollm2.done 2>/dev/null)" != "$TOKENS" ]; then
  mode=$(mode_for store-smollm2)
  echo "$TOKENS" > runs/store-smollm2.building
  hispec-store --dataset data/selfdistill-smollm2 --out runs/store-smollm2 --layers 2,8 --eval-sequences 64 $mode
  echo "$TOKENS" > runs/store-smollm2.done
fi

stamp "heads: $STEPS steps (runs/smollm2-135m)"
if [ "$(cat runs/smollm2-135m.done 2>/dev/null)" != "$TOKENS" ]; then
  mode=$(mode_for smollm2-135m)
  echo "$TOKENS" > runs/smollm2-135m.building
  hispec-train --recipe recipes/smollm2-135m.yaml --max-steps "$STEPS" $mode
  echo "$TOKENS" > runs/smollm2-135m.done
fi

stamp "export to $OUT, tune"
hispec-export runs/smollm2-135m --out "$OUT" --overwrite
hispec-tune --heads "$OUT" --dtypes bfloat16,float32 --num-prompts 8
stamp "done: copy $OUT to hispec_decode/default_heads/smollm2-135m to ship it"
