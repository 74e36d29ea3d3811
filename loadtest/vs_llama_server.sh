#!/usr/bin/env bash
# Many streams through one server: `coli serve` against llama.cpp's `llama-server` on the same
# GGUF, same threads, as many slots as streams (continuous batching on both), with 1, 4 and 8
# concurrent streaming clients (loadtest/loadtest.py, closed loop). Reports aggregate tok/s,
# TTFT and inter-token latency percentiles per engine, one JSON line per run.
#
#   loadtest/vs_llama_server.sh GGUF LLAMA_SERVER [OUT_DIR]
#
# Environment: COLI (default target/release/coli), PYTHON (an interpreter with `openai`,
# loadtest/requirements.txt), THREADS (2), STREAMS ("1 4 8"), REPS (2), GEN (64 generated tokens
# per request, end-of-sequence ignored on both), ROUNDS (3 requests per client per run),
# ENGINES ("colibri llama.cpp"; add `colibri-alt` for a second colibri run with the extra
# `coli serve` flags in ALT_ARGS, e.g. ENGINES="colibri colibri-alt llama.cpp"
# ALT_ARGS="--prefill-budget 100000").
# Repetitions interleave the engines; each server runs in its own autogroup at raised priority
# where allowed (../shared/reference/peer-bench.md) and the load average is recorded beside
# every number. Both read the file memory-mapped and fully resident (it is read into the page
# cache first, and one warm-up round per server precedes the measured one). Loopback only.
# Summarise with loadtest/summarise_servers.py OUT_DIR/runs.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF=${1:?usage: vs_llama_server.sh GGUF LLAMA_SERVER [OUT_DIR]}
LLAMA_SERVER=${2:?usage: vs_llama_server.sh GGUF LLAMA_SERVER [OUT_DIR]}
OUT=${3:-docs/bench/servers-$(date +%Y%m%d-%H%M)}
COLI=${COLI:-target/release/coli}
PYTHON=${PYTHON:-python3}
THREADS=${THREADS:-2}
STREAMS=${STREAMS:-1 4 8}
REPS=${REPS:-2}
GEN=${GEN:-64}
ROUNDS=${ROUNDS:-3}
CTX=${CTX:-1024} # tokens of context per slot
ENGINES=${ENGINES:-colibri llama.cpp}
ALT_ARGS=${ALT_ARGS:-}
mkdir -p "$OUT"
cat "$GGUF" >/dev/null

# serve PIDFILE CMD...: CMD in its own session and autogroup at raised priority, its PID (after
# exec, the server's own) in PIDFILE. `setsid` forks where it must, so `$!` is not the server.
serve() {
  local pidfile=$1
  shift
  setsid bash -c 'echo $$ > "$0"; echo -10 > /proc/self/autogroup 2>/dev/null; exec "$@"' "$pidfile" "$@"
}

# start_server ENGINE STREAMS LOG: starts the server in the background, sets PID and URL.
start_server() {
  local engine=$1 n=$2 log=$3
  rm -f "$OUT/pid"
  if [ "$engine" != llama.cpp ]; then
    local extra=()
    if [ "$engine" = colibri-alt ]; then read -r -a extra <<<"$ALT_ARGS"; fi
    serve "$OUT/pid" "$COLI" serve --model "$GGUF" --mmap --host 127.0.0.1 --port 0 --threads "$THREADS" \
      --slots "$n" --context "$CTX" --queue-limit 64 "${extra[@]}" 2>"$log" &
  else
    local port
    port=$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    serve "$OUT/pid" "$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port "$port" -t "$THREADS" -tb "$THREADS" \
      --parallel "$n" -c $((CTX * n)) --cont-batching --no-webui >"$log" 2>&1 &
    URL="http://127.0.0.1:$port"
  fi
  for _ in $(seq 1 100); do
    [ -s "$OUT/pid" ] && break
    sleep 0.1 # waiting for the forked session to write its PID, not synchronising a test
  done
  PID=$(cat "$OUT/pid")
  for _ in $(seq 1 1200); do
    if [ "$engine" != llama.cpp ]; then
      URL=$(sed -n 's/^coli: listening on \(http:[^ ]*\)$/\1/p' "$log" | head -1)
      if [ -n "$URL" ] && curl -sf "$URL/ready" >/dev/null 2>&1; then return 0; fi
    elif curl -sf "$URL/health" >/dev/null 2>&1; then
      return 0
    fi
    if ! kill -0 "$PID" 2>/dev/null; then
      echo "vs_llama_server: $engine exited before it was ready; its log ($log):" >&2
      tail -20 "$log" >&2
      exit 1
    fi
    sleep 0.5 # polling readiness of a server, not synchronising a test
  done
  echo "vs_llama_server: $engine not ready after 10 minutes ($log)" >&2
  exit 1
}

for rep in $(seq "$REPS"); do
  for n in $STREAMS; do
    for engine in $ENGINES; do
      tag="$engine-n$n-r$rep"
      start_server "$engine" "$n" "$OUT/$tag.log"
      # Warm-up round: page cache, expert cache, the servers' lazy allocations.
      "$PYTHON" loadtest/loadtest.py --url "$URL" --users "$n" --requests "$n" \
        --max-tokens 16 --ignore-eos >/dev/null || true
      load=$(cut -d' ' -f1-3 /proc/loadavg)
      "$PYTHON" loadtest/loadtest.py --url "$URL" --users "$n" --requests $((n * ROUNDS)) \
        --max-tokens "$GEN" --ignore-eos --temperature 0.8 --out "$OUT/$tag.json" >/dev/null || true
      load_after=$(cut -d' ' -f1-3 /proc/loadavg)
      kill -TERM "$PID"
      # The server is not this shell's child: wait for it to exit (it drains, then stops);
      # after a minute, kill it.
      for _ in $(seq 1 300); do
        kill -0 "$PID" 2>/dev/null || break
        sleep 0.2 # polling a process's exit, not synchronising a test
      done
      kill -KILL "$PID" 2>/dev/null || true
      echo "{\"rep\": $rep, \"streams\": $n, \"engine\": \"$engine\", \"threads\": $THREADS, \"loadavg_before\": \"$load\", \"loadavg_after\": \"$load_after\", \"summary\": $("$PYTHON" -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["summary"]))' "$OUT/$tag.json")}" \
        | tee -a "$OUT/runs.jsonl"
    done
  done
done
"$PYTHON" loadtest/summarise_servers.py "$OUT/runs.jsonl" | tee "$OUT/table.md"
