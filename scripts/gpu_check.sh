#!/usr/bin/env bash
# The GPU figures of docs/speed.md and docs/bench.md in one unattended run, each part after the last, on a CUDA machine
# whose $SPEC_EXPLORER_CACHE/gguf/ holds the embedded pair's two GGUF files (docs/bench.md, "Running on a GPU"):
#   prepare     convert the pair to bf16 safetensors (once; later runs load the cache)
#   bench-*     the bench grid: HumanEval 0-2 and MT-bench 0-2, T 0 and 0.7, 128 new tokens, CUDA graphs,
#               transformers' baselines in the same run (OUT_DIR/bench-<set>/bench.json: assets/bench/gpu-<set>.json)
#   chain-*     the model-drafting methods with and without chain replays (several draft levels in one graph,
#               bench --chain-levels / +chain=N) on the same sets, ar in the same run
#   fused-*     ar and the chained model-drafting methods with the models' norms, MLPs and rotary embedding compiled
#               into fused kernels (--fused-kernels on) and without, one bench run each (ratios within a run)
#   pearl       PEARL beside sd and ar on the kinds set, greedy, both models on the GPU: the two lanes simulated
#               from the forwards each round measured (docs/bench.md, "PEARL on two lanes")
#   pearl-split the same with the draft on the CPU (--draft-device cpu): sd and PEARL on one lane, and PEARL's
#               draft in a thread of its own while the GPU verifies (+lanes=threads), time measured
#   syncs       host synchronisations per step and the step's phases, ar and eagle (scripts/gpu_syncs.py)
#   cuda-real   the CUDA tests on the embedded pair (the tiny-pair CUDA tests: pytest -m "cuda and not real")
#   lessons     every lesson's runs and ar timed on this machine (OUT_DIR/lessons/*.json: assets/lessons/)
#   app         the app headless on the GPU, steps against the CLI's, peak GPU memory (scripts/app_device_check.py)
# Usage: scripts/gpu_check.sh OUT_DIR. A part that fails or runs out of time does not stop the next; each part's
# output is OUT_DIR/<part>.log and OUT_DIR/progress says where the run is. Environment: DEADLINE (epoch seconds: no
# part runs past it), WAIT_FOR (a file whose existence means the GPU is free; waited for before the timed parts),
# MODELS (default; tiny for a dry run), DEVICE (cuda), SETS, RANGE, TOKENS, BENCH_METHODS, CHAIN_METHODS,
# FUSED_METHODS, FUSED_TEMPS, SYNC_METHODS, PEARL_METHODS, SPLIT_METHODS, PEARL_SET, PARTS (the parts to run, default all:
# prepare bench chain fused pearl syncs cuda-real lessons app).
set -uo pipefail
cd "$(dirname "$0")/.."
R=${1:?usage: scripts/gpu_check.sh OUT_DIR}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
MODELS=${MODELS:-default}
DEVICE=${DEVICE:-cuda}
DEADLINE=${DEADLINE:-$(( $(date +%s) + 3600 ))}
M=${BENCH_METHODS:-ar,hf-assisted,hf-prompt-lookup,sd,mcsd,mcsd-improved,prompt-lookup,token-recycling,hybrid,eagle}
C=${CHAIN_METHODS:-ar,sd,sd+chain=4,mcsd-improved,mcsd-improved+chain=16,hybrid,hybrid+chain=16}
F=${FUSED_METHODS:-ar,sd+chain=4,mcsd-improved+chain=16,hybrid+chain=16}
P=${PEARL_METHODS:-ar,sd,pearl,pearl+gamma=8}
S=${SPLIT_METHODS:-ar,sd,pearl,pearl+lanes=threads,pearl+gamma=8+lanes=threads}
PARTS=${PARTS:-prepare bench chain fused pearl syncs cuda-real lessons app}

part() {
  local name=$1 left=$(( DEADLINE - $(date +%s) ))
  shift
  case " $PARTS " in *" $name "* | *" ${name%%-*} "*) ;; *) return ;; esac
  if (( left < 10 )); then echo "$name skipped: past the deadline" >> "$R/progress"; return; fi
  echo "$name start $(date -u +%T)" >> "$R/progress"
  timeout "$left" "$@" > "$R/$name.log" 2>&1
  echo "$name rc=$? $(date -u +%T)" >> "$R/progress"
}

part prepare "$PY" -c "from explorer.models.loading import prepare_default_pair; prepare_default_pair()"
if [ -n "${WAIT_FOR:-}" ]; then
  while [ ! -e "$WAIT_FOR" ] && (( $(date +%s) < DEADLINE )); do sleep 2; done
  echo "waited for $WAIT_FOR until $(date -u +%T)" >> "$R/progress"
fi
for set in ${SETS:-humaneval mt-bench}; do
  part "bench-$set" "$PY" -m explorer bench --models "$MODELS" --device "$DEVICE" --prompt-file "$set" \
    --range "${RANGE:-0:3}" --temperatures 0,0.7 --max-new-tokens "${TOKENS:-128}" --graphs --methods "$M" \
    --out "$R/bench-$set"
done
for set in ${SETS:-humaneval mt-bench}; do
  part "chain-$set" "$PY" -m explorer bench --models "$MODELS" --device "$DEVICE" --prompt-file "$set" \
    --range "${RANGE:-0:3}" --temperatures 0,0.7 --max-new-tokens "${TOKENS:-128}" --graphs --methods "$C" \
    --out "$R/chain-$set"
done
for set in ${SETS:-humaneval mt-bench}; do
  for fused in off on; do
    part "fused-$set-$fused" "$PY" -m explorer bench --models "$MODELS" --device "$DEVICE" --prompt-file "$set" \
      --range "${RANGE:-0:3}" --temperatures "${FUSED_TEMPS:-0,0.7}" --max-new-tokens "${TOKENS:-128}" --graphs \
      --methods "$F" --fused-kernels "$fused" --out "$R/fused-$set-$fused"
  done
done
part pearl "$PY" -m explorer bench --models "$MODELS" --device "$DEVICE" --prompt-file "${PEARL_SET:-kinds}" --temperatures 0 \
  --max-new-tokens "${TOKENS:-128}" --graphs --methods "$P" --out "$R/pearl"
part pearl-split "$PY" -m explorer bench --models "$MODELS" --device "$DEVICE" --draft-device cpu \
  --prompt-file "${PEARL_SET:-kinds}" --temperatures 0 --max-new-tokens 64 --methods "$S" --out "$R/pearl-split"
part syncs "$PY" scripts/gpu_syncs.py --models "$MODELS" --methods "${SYNC_METHODS:-ar,eagle}" --graphs \
  --max-new-tokens "${TOKENS:-128}"
part cuda-real "$PY" -m pytest -q -p no:cacheprovider --continue-on-collection-errors -m "cuda and real" tests
rm -rf "$R/lessons" && cp -r assets/lessons "$R/lessons"
part lessons "$PY" -m explorer lessons time --models "$MODELS" --device "$DEVICE" --graphs --out "$R/lessons"
part app env SPEC_EXPLORER_PAIR="$MODELS" "$PY" scripts/app_device_check.py --out "$R/app"
echo "done $(date -u +%T)" >> "$R/progress"
