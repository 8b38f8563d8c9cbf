#!/usr/bin/env bash
# Time to the first and second answer of the README's curl after `dspark serve` starts.
#
#   scripts/first_answer.sh          # cold: empty inductor cache, kernel build dir and profiles
#   scripts/first_answer.sh --warm   # the caches the previous cold run left (same CACHE_ROOT)
#
# The model must be pulled already (~/.cache/dspark/models, or $DSPARK_HOME/models); it is linked,
# not copied, into a fresh DSPARK_HOME, so no stored SPS profile is found. Extra arguments go to
# `dspark serve`. Prints the seconds from the server's start to each answer, then stops the server.
set -euo pipefail

warm=0
if [[ "${1:-}" == "--warm" ]]; then
  warm=1
  shift
fi
here="$(cd "$(dirname "$0")/.." && pwd)"
dspark="${DSPARK_BIN:-$here/.venv/bin/dspark}"
port="${PORT:-8000}"
models="${DSPARK_HOME:-$HOME/.cache/dspark}/models"
root="${CACHE_ROOT:-${TMPDIR:-/tmp}/dspark-first-answer}"
[[ -d "$models" ]] || { echo "no models under $models: run \`dspark models pull smollm2-135m\` first" >&2; exit 1; }
if [[ $warm == 0 ]]; then
  rm -rf "$root"
fi
mkdir -p "$root/home" "$root/inductor" "$root/extensions"
ln -sfn "$models" "$root/home/models"
log="$root/serve.log"

export DSPARK_HOME="$root/home" TORCHINDUCTOR_CACHE_DIR="$root/inductor" TORCH_EXTENSIONS_DIR="$root/extensions"
unset DSPARK_SPS_PROFILE
started=$(date +%s.%N)
"$dspark" serve --port "$port" "$@" >"$log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT

ask() {
  curl -sf --max-time 600 "http://127.0.0.1:$port/v1/chat/completions" \
    -H "Content-Type: application/json" \
    -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16, "temperature": 0}'
}

# The first curl is sent as soon as the port accepts connections, as a user would retry it.
until ask >"$root/first.json" 2>/dev/null; do
  kill -0 $server 2>/dev/null || { echo "dspark serve exited; see $log" >&2; tail -20 "$log" >&2; exit 1; }
  sleep 0.5
done
first=$(date +%s.%N)
ask >"$root/second.json"
second=$(date +%s.%N)

echo "caches: $([[ $warm == 1 ]] && echo warm || echo empty) ($root); server log: $log"
python3 - "$started" "$first" "$second" "$root/first.json" <<'EOF'
import json, sys
started, first, second = map(float, sys.argv[1:4])
text = json.load(open(sys.argv[4]))["choices"][0]["message"]["content"]
print(f"first answer {first - started:.1f} s after the start, second answer took {second - first:.2f} s")
print(f"answer: {text!r}")
EOF
