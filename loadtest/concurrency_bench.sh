#!/usr/bin/env bash
# Concurrent streams against `coli serve`: aggregate and per-stream tok/s, TTFT and inter-token
# latency for 1, 4 and 8 concurrent clients, with as many slots as clients (continuous batching,
# expert batch-union) and, for comparison, with one slot (requests served one after another).
#
#   loadtest/concurrency_bench.sh [COLI_BIN] [MODEL_DIR] [OUT_DIR]
#
# MODEL_DIR defaults to the demo model (OLMoE-shaped: 8 layers, hidden 1024, 32 experts top-4;
# every token id is text, so each token shows up as its own SSE chunk), synthesized once under
# target/bench-cache. Served from its directory it gets the default RAM budget, so every expert
# stays resident after the warm-up round. Needs python with `openai`
# (loadtest/requirements.txt); PYTHON selects the interpreter. Each configuration runs in its own
# autogroup at raised priority where allowed (see ../shared/reference/peer-bench.md) and records
# the load average beside its numbers.
set -euo pipefail
cd "$(dirname "$0")/.."
COLI=${1:-target/release/coli}
MODEL=${2:-target/bench-cache/demo-olmoe-1g-v3}
OUT=${3:-docs/bench/concurrency-$(date +%Y%m%d-%H%M)}
PYTHON=${PYTHON:-python3}
GEN=${GEN:-64}
mkdir -p "$OUT"

if [ ! -f "$MODEL/config.json" ]; then
  COLI_CACHE_DIR="$PWD/target/bench-cache" "$COLI" run --model demo --prompt hi --max-tokens 1 >/dev/null
fi

run_config() { # users slots
  local users=$1 slots=$2 log="$OUT/serve-u$1-s$2.log"
  setsid bash -c 'echo -10 > /proc/self/autogroup 2>/dev/null; exec "$@"' _ \
    "$COLI" serve --model "$MODEL" --port 0 --slots "$slots" --queue-limit 64 \
    --max-tokens-cap 4096 2>"$log" &
  local pid=$!
  local url=""
  for _ in $(seq 1 600); do
    url=$(sed -n 's/^coli: listening on \(http:[^ ]*\)$/\1/p' "$log" | head -1)
    if [ -n "$url" ] && curl -sf "$url/ready" >/dev/null 2>&1; then break; fi
    if ! kill -0 "$pid" 2>/dev/null; then cat "$log"; exit 1; fi
    sleep 0.5 # polling readiness, not synchronising a test
  done
  # Warm the expert cache and the page cache with one round first.
  "$PYTHON" loadtest/loadtest.py --url "$url" --users "$users" --requests "$users" \
    --max-tokens 32 --ignore-eos >/dev/null
  local load
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  "$PYTHON" loadtest/loadtest.py --url "$url" --users "$users" --requests $((users * 3)) \
    --max-tokens "$GEN" --ignore-eos --temperature 0.8 --out "$OUT/u$users-s$slots.json" \
    >"$OUT/u$users-s$slots.summary.json"
  echo "users=$users slots=$slots load=[$load] $(python3 - "$OUT/u$users-s$slots.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))["summary"]
print(f"aggregate {s['aggregate_tok_s']:.1f} tok/s | per-stream decode p50 {s['per_stream_decode_tok_s']['p50']:.1f} tok/s"
      f" | TTFT p50 {s['ttft_s']['p50']*1000:.0f} ms p90 {s['ttft_s']['p90']*1000:.0f} ms"
      f" | ITL p50 {s['itl_s']['p50']*1000:.1f} ms p90 {s['itl_s']['p90']*1000:.1f} ms | errors {s['errors_by_status']}")
EOF
)" | tee -a "$OUT/table.txt"
  kill -TERM "$pid"
  wait "$pid" || true
}

for users in 1 4 8; do
  run_config "$users" "$users"
  if [ "$users" -gt 1 ]; then run_config "$users" 1; fi
done
echo "results in $OUT"
