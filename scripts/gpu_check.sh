#!/usr/bin/env bash
# The device check for a GPU machine: CUDA tests, then the SPS profile and the benches on the GPU.
# Results land in $OUT (or runs/gpu). Usage: bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
pip install -q --upgrade pip && pip install -q torch && pip install -q -e '.[dev]'
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
pytest -q tests/cuda tests/models tests/engine/test_verifier.py tests/training/test_train_command.py 2>&1 | tee "$OUT/pytest.txt"
dspark profile --device cuda --output "$OUT/profile.json" --plot "$OUT/profile.png" 2>&1 | tail -3
dspark bench decode --device cuda --num-prompts 4 --output "$OUT/bench-decode.json" | tee "$OUT/bench-decode.txt"
