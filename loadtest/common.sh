# Shell helpers the load scripts share (sourced, not run): lb_saturation.sh and soak.sh.
#
# The sourcing script sets RUN (a scratch directory), PIDS (processes to stop) and SAMPLER (a
# background sampler's pid, or empty) and calls `trap cleanup EXIT`.

# Stop the sampler and every process in PIDS, remove RUN.
cleanup() {
  [ -n "${SAMPLER:-}" ] && kill "$SAMPLER" 2>/dev/null || true
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  rm -rf "$RUN"
}

# Run "$@" in its own autogroup at nice -10 (where allowed; ../shared/reference/peer-bench.md).
boosted() {
  setsid -w bash -c 'echo -10 > /proc/self/autogroup 2>/dev/null; exec "$@"' _ "$@"
}

# Start `$RUN/coli serve --model MODEL --host 127.0.0.1 --port 0 FLAGS...` in the background,
# boosted, its stderr in LOG; prints nothing, sets SERVED_PID and appends it to PIDS.
start_coli() { # LOG MODEL FLAGS...
  local log=$1 model=$2
  shift 2
  setsid bash -c 'echo -10 > /proc/self/autogroup 2>/dev/null; exec "$@"' _ \
    "$RUN/coli" serve --model "$model" --host 127.0.0.1 --port 0 "$@" 2>"$log" &
  SERVED_PID=$!
  PIDS+=("$SERVED_PID")
}

# Wait until the server of LOG (process PID) has printed its address and /ready answers 200;
# sets SERVED_URL. Exits the script with the log if the server dies or is not ready in 300 s.
wait_coli_ready() { # LOG PID
  local log=$1 pid=$2 url=""
  for _ in $(seq 1 600); do
    url=$(sed -n 's/^coli: listening on \(http:[^ ]*\)$/\1/p' "$log" | head -1)
    if [ -n "$url" ] && curl -sf "$url/ready" >/dev/null 2>&1; then break; fi
    if ! kill -0 "$pid" 2>/dev/null; then cat "$log" >&2; exit 1; fi
    sleep 0.5 # polling readiness, not synchronising a test
  done
  curl -sf "$url/ready" >/dev/null || { echo "$0: server of $log not ready" >&2; exit 1; }
  SERVED_URL=$url
}
