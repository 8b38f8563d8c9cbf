#!/usr/bin/env bash
# The device check for a GPU machine: CUDA tests, the SPS profile, bench decode and bench serve on the GPU
# (CUDA graphs on, the default), then step times and a short bench serve with graphs on and off.
# Results land in $OUT (default runs/gpu): log.txt, profile.json/png, serve/, bench-decode.json, steps/,
# steps-eager/, serve-graphs/, serve-eager/.
# Each stage has a time limit, so one stuck stage leaves the others' results (about 9 minutes on an H200).
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
timeout 180 pytest -q -p no:cacheprovider -rs tests/cuda tests/models tests/engine/test_verifier.py \
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
step step profile without CUDA graphs
timeout 60 python3 scripts/step_profile.py --device cuda --concurrency 1,64 --no-cuda-graphs --out "$OUT/steps-eager" \
  2>&1 | grep -v USDT | tail -6 | tee -a "$LOG"
step CUDA graphs on and off: step times
python3 - "$OUT/steps/steps.json" "$OUT/steps-eager/steps.json" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
on, off = (json.load(open(p)) for p in sys.argv[1:3])
print(f"{'step':>10} {'graphs ms':>10} {'eager ms':>10} {'speed-up':>9}")
for key in off:
    if key in on:
        a, b = on[key]["step_ms"], off[key]["step_ms"]
        print(f"{key:>10} {a:10.2f} {b:10.2f} {b / a:8.2f}x  (graphs captured: {on[key]['cuda_graphs']})")
PY
for mode in graphs eager; do
  step bench serve, CUDA graphs "$mode"
  flag=(); [ "$mode" = eager ] && flag=(--no-cuda-graphs)
  timeout 120 dspark bench serve "${SERVE[@]}" "${flag[@]}" --policies none,dspark --concurrency 1,64 --requests 8 \
    --output-dir "$OUT/serve-$mode" 2>&1 | tee "$OUT/serve-$mode.log" | grep -v '^ ' | tail -12 | tee -a "$LOG"
done
step done
