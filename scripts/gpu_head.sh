#!/usr/bin/env bash
# More data for the EAGLE-3 head, where a GPU writes it in minutes (docs/heads.md: this CPU writes about 1,400 tokens
# a minute): the target writes new prompts and answers them (heads respond --written, resumable: a cut run keeps what
# it wrote), then its features are cached and the head is trained on the shipped head's data (every
# responses/w*-train.jsonl.gz beside its card) and the new responses together, as the tied 16,384-token run of
# docs/heads.md was. What comes back under OUT_DIR: the new responses (gzipped JSONL, to ship beside the card), the
# best save (config.json, model.safetensors) and its train_state.json and card.json; the features and the optimizer
# state stay in WORK (tens of GB, not copied back).
# Usage: scripts/gpu_head.sh OUT_DIR [respond|train|both]. Environment: MODELS (default), DEVICE (cuda), WORK
# (/tmp/head-work), PER_KIND (prompts written per kind, 400), SEED (5; 0-4 wrote the shipped data), BATCH (128),
# EPOCHS (3), TOKENS (new tokens per answer, 256), LAYERS (2,14,27), INIT (the head to start from, default the
# shipped one; empty: a new head of DRAFT_VOCAB tokens), WRITTEN (1; 0: the templates' prompts, for a model that
# cannot write requests).
# A dry run on the CPU: MODELS=tiny DEVICE=cpu LAYERS=0,1,1 INIT= DRAFT_VOCAB=64 WRITTEN=0 PER_KIND=1 BATCH=4
# TOKENS=16 EPOCHS=1.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${1:?usage: scripts/gpu_head.sh OUT_DIR [respond|train|both]}
WHAT=${2:-both}
PY=${PYTHON:-python3}
MODELS=${MODELS:-default}
DEVICE=${DEVICE:-cuda}
W=${WORK:-/tmp/head-work}
SHIPPED=assets/heads/qwen2.5-coder-1.5b-instruct
INIT=${INIT-$SHIPPED}
LAYERS=${LAYERS:-2,14,27}
if [ -n "$INIT" ]; then
  shape=(--init "$INIT" --tie-lm-head --grow-vocab 16384)
else
  shape=(--draft-vocab "${DRAFT_VOCAB:-16384}" --tie-lm-head)
fi
mkdir -p "$R" "$W"
NEW="$W/new.jsonl"
written=(--written --write-temperature 0.8)
[ "${WRITTEN:-1}" = 0 ] && written=()
if [ "$WHAT" != train ]; then
  "$PY" -m explorer heads respond --models "$MODELS" --device "$DEVICE" "${written[@]}" --per-kind "${PER_KIND:-400}" \
    --seed "${SEED:-5}" --batch "${BATCH:-128}" --max-new-tokens "${TOKENS:-256}" --out "$NEW"
  gzip -c "$NEW" > "$R/new-train.jsonl.gz"
fi
if [ "$WHAT" != respond ]; then
  features() {  # TEXTS NAME: the target's features of TEXTS cached in WORK/features/NAME (reused when it matches)
    "$PY" -m explorer heads features --models "$MODELS" --device "$DEVICE" --texts "$1" --data "$W/features/$2" \
      --layers "$LAYERS" --quiet
  }
  data=()
  for f in "$SHIPPED"/responses/w[0-9]*-train.jsonl.gz; do
    s=$(basename "$f" -train.jsonl.gz)
    features "$f" "$s"
    data+=(--data "$W/features/$s")
  done
  features "$NEW" new
  features assets/heads/gap/stop-answers.jsonl.gz stop
  "$PY" -m explorer heads train --models "$MODELS" --device "$DEVICE" --train-device "$DEVICE" "${shape[@]}" \
    "${data[@]}" --data "$W/features/new" --eval-data "$W/features/stop" --ttt 4 \
    --epochs "${EPOCHS:-3}" --lr 1e-4 --save-every 150 --patience 4 --loss-on answers --out "$W/head" --quiet
  mkdir -p "$R/head"
  cp "$W/head/card.json" "$W/head/train_state.json" "$R/head/"
  cp -r "$W/head/best" "$R/head/best"
fi
