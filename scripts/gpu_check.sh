#!/usr/bin/env bash
# The device check for a GPU machine: CUDA tests, the SPS profile, bench decode and bench serve on the GPU.
# Results land in $OUT (default runs/gpu): log.txt, profile.json/png, serve/, bench-decode.json, steps/.
# Each stage has a time limit, so one stuck stage leaves the others' results (about 6 minutes on an H200).
# Usage: bash scripts/gpu_check.sh   (DSPARK_SKIP_INSTALL=1: use the current Python environment;
#   POLICIES, LEVELS, PROMPTS: bench serve's policies and concurrency levels, bench decode's prompts per domain)
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
timeout 120 pytest -q -p no:cacheprovider -rs tests/cuda tests/models tests/engine/test_verifier.py \
  tests/training/test_train_command.py 2>&1 | tail -25 | tee -a "$LOG"
# One engine shape for the profile and the serve bench, so the bench reuses the profile.
SERVE=(--device cuda --drafter dspark --max-num-seqs 64 --max-batch-tokens 2048)
step profile
timeout 90 dspark profile "${SERVE[@]}" --plot "$OUT/profile.png" 2>&1 | tail -4 | tee -a "$LOG"
cp "$(ls -t "${DSPARK_HOME:-$HOME/.cache/dspark}"/profiles/*.json | head -1)" "$OUT/profile.json"
step bench serve
timeout 240 dspark bench serve "${SERVE[@]}" --policies "${POLICIES:-none,static:1,full,dspark,dspark-async}" \
  --concurrency "${LEVELS:-1,4,16,32,64}" --requests 12 --output-dir "$OUT/serve" 2>&1 | tee "$OUT/serve.log" | grep -v '^ ' | tail -40 | tee -a "$LOG"
step bench decode
timeout 100 dspark bench decode "${SERVE[@]}" --policy dspark --num-prompts "${PROMPTS:-4}" --repeats 1 --no-hf \
  --output "$OUT/bench-decode.json" 2>&1 | tail -30 | tee -a "$LOG"
step step profile
timeout 60 python3 scripts/step_profile.py --device cuda --out "$OUT/steps" 2>&1 | grep -v USDT | tail -8 | tee -a "$LOG"
step done
