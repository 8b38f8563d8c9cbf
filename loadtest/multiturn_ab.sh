#!/bin/bash
# TTFT of the multi-turn chat load against `dspark serve` with prefix caching (A) and with
# --no-prefix-caching (B), run A B A B one after the other on loopback at the same load.
# Usage: loadtest/multiturn_ab.sh [PORT] [USERS] [SECONDS] [extra `dspark serve` flags...]
set -euo pipefail
PORT=${1:-8232}; USERS=${2:-4}; SECONDS_PER_RUN=${3:-60}; shift $(( $# < 3 ? $# : 3 ))
OUT=${OUT:-multiturn-ab}; mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
for round in 1 2; do
  for mode in caching no-caching; do
    flag=""; [ "$mode" = no-caching ] && flag="--no-prefix-caching"
    dspark serve --port "$PORT" --max-num-seqs 8 $flag "$@" > "$OUT/serve-$mode-$round.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do curl -sf "http://127.0.0.1:$PORT/ready" > /dev/null && break; sleep 1; done
    locust -f "$HERE/multiturn_locustfile.py" --headless --host "http://127.0.0.1:$PORT" \
      -u "$USERS" -r "$USERS" --run-time "${SECONDS_PER_RUN}s" --turns 4 --chat-max-tokens 32 \
      --multiturn-report "$OUT/$mode-$round.json" > "$OUT/locust-$mode-$round.log" 2>&1 || true
    hits=$(curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^vllm:prefix_cache_(queries|hits)_total" | tr '\n' ' ')
    p50=$(python3 -c "import json,sys; a=json.load(open(sys.argv[1]))['all']; print(f\"TTFT p50 {a['p50']:.3f} s  p95 {a['p95']:.3f} s  n {a['n']}\")" "$OUT/$mode-$round.json")
    echo "$mode round $round: $p50  $hits"
    kill -TERM "$pid"; wait "$pid" || true
  done
done
