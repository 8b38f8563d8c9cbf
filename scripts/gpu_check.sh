#!/usr/bin/env bash
# The device check for a GPU machine: CUDA tests, the SPS profile, bench decode and bench serve on the GPU.
# Results land in $OUT (default runs/gpu): log.txt, profile.json/png, steps/, bench-decode.json, serve/.
# Usage: bash scripts/gpu_check.sh   (DSPARK_SKIP_INSTALL=1: use the current Python environment)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1
if [ -z "${DSPARK_SKIP_INSTALL:-}" ]; then
  python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
  pip install -q --upgrade pip && pip install -q torch && pip install -q -e '.[dev]'
fi
step() { echo "== $* ($(date -u +%T))" | tee -a "$LOG"; }
step gpu
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$LOG"
step CUDA tests
pytest -q -p no:cacheprovider -rs tests/cuda tests/models tests/engine/test_verifier.py \
  tests/training/test_train_command.py 2>&1 | tail -25 | tee -a "$LOG"
# One engine shape for the profile and the serve bench, so the bench reuses the profile.
SERVE=(--device cuda --drafter dspark --max-num-seqs 64 --max-batch-tokens 2048)
step profile
dspark profile "${SERVE[@]}" --plot "$OUT/profile.png" 2>&1 | tail -4 | tee -a "$LOG"
cp "$(ls -t "${DSPARK_HOME:-$HOME/.cache/dspark}"/profiles/*.json | head -1)" "$OUT/profile.json"
step step profile
python3 scripts/step_profile.py --device cuda --out "$OUT/steps" 2>&1 | grep -v USDT | tail -8 | tee -a "$LOG"
step bench decode
dspark bench decode --device cuda --drafter dspark --policy dspark --num-prompts 4 --repeats 1 \
  --output "$OUT/bench-decode.json" 2>&1 | tail -30 | tee -a "$LOG"
step bench serve
dspark bench serve "${SERVE[@]}" --policies none,static:1,static:3,full,dspark,dspark-async \
  --concurrency 1,4,16,64 --requests 16 --output-dir "$OUT/serve" 2>&1 | grep -v '^ ' | tail -40 | tee -a "$LOG"
step done
