#!/usr/bin/env bash
# Two `coli serve` processes behind nginx, driven past saturation by an open-loop ladder of offered
# loads: does overload turn into 429/503 (and never into other 5xx, hangs or broken answers), is
# every accepted request answered, does memory stay bounded?
#
#   loadtest/lb_saturation.sh [COLI_BIN] [OUT_DIR]
#   python3 loadtest/chart.py OUT_DIR            # latency_vs_load.png and summary.json
#
# Each server: the demo model (synthesized once under target/bench-cache when missing), one compute
# thread, 2 slots, a queue of 4, a 10 s queue timeout and max_tokens capped at 64, so a 2-core
# machine saturates at a few requests per second. nginx (Debian's nginx-light, installed when
# missing) runs from a generated config with every path under OUT_DIR or a scratch directory:
#   - least_conn: a stream holds its connection for its whole life, so the number of open
#     connections is the number of requests a backend is working on or queueing;
#   - proxy_buffering off (SSE passes through token by token), 600 s read timeout;
#   - proxy_next_upstream error timeout http_429 non_idempotent, 2 tries: a 429 means the backend
#     queued nothing, so the request is safely offered to the other backend once; when both are
#     full the client gets the second 429. max_fails=0, or nginx would count those 429s as
#     failures and take a busy backend out of rotation (and answer 502 with both out).
#     LB_RETRY_429=0 leaves 429s to the client instead.
# Per offered load (RATES, each for DURATION seconds; scenario SCENARIO, MAX_TOKENS tokens with
# ignore_eos) it runs loadtest.py through nginx and keeps its JSON (rate-R.json), samples both
# servers' VmRSS every 0.5 s (rss.csv), records the load average before and after (rates.csv) and
# the servers' request counters (metrics.txt). Servers, nginx and the load generator each run in
# their own autogroup at raised priority where allowed (../shared/reference/peer-bench.md).
# At the end both servers get SIGTERM and must exit 0.
set -euo pipefail
cd "$(dirname "$0")/.."
COLI=${1:-target/release/coli}
OUT=${2:-docs/bench/lb-$(date +%Y%m%d-%H%M)}
MODEL=${MODEL:-target/bench-cache/demo-olmoe-1g-v3}
PYTHON=${PYTHON:-target/api-venv/bin/python}
RATES=${RATES:-0.5 1 2 4 8 16}
DURATION=${DURATION:-20}
SCENARIO=${SCENARIO:-mixed}
MAX_TOKENS=${MAX_TOKENS:-32}
LB_RETRY_429=${LB_RETRY_429:-1}
SERVE_FLAGS=(--threads 1 --slots 2 --queue-limit 4 --queue-timeout-secs 10 --max-tokens-cap 64)

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
RUN=$(mktemp -d /tmp/lb-saturation.XXXXXX)
chmod 755 "$RUN" # nginx workers (nobody when started as root) look up their temp paths here
PIDS=()
SAMPLER=""
cleanup() {
  [ -n "$SAMPLER" ] && kill "$SAMPLER" 2>/dev/null || true
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  rm -rf "$RUN"
}
trap cleanup EXIT

boosted() { # run "$@" in its own autogroup at nice -10 (where allowed)
  setsid -w bash -c 'echo -10 > /proc/self/autogroup 2>/dev/null; exec "$@"' _ "$@"
}

# nginx from Debian's packages.
if ! command -v nginx >/dev/null 2>&1; then
  echo "lb_saturation: installing nginx-light" >&2
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq nginx-light >/dev/null
  else
    sudo apt-get update -qq && sudo apt-get install -y -qq nginx-light >/dev/null
  fi
fi

# The binary is copied, so a rebuild during the run cannot change what is measured.
cp "$COLI" "$RUN/coli"
if [ ! -f "$MODEL/config.json" ]; then
  MODEL="$RUN/model"
  "$RUN/coli" synth --arch olmoe --layers 8 --hidden 1024 --experts 32 --top-k 4 \
    --moe-intermediate 640 --vocab 734 --out "$MODEL" >&2
fi

start_server() { # name -> sets URL_<name>, PID_<name>
  local name=$1 log="$OUT/serve-$1.log"
  setsid bash -c 'echo -10 > /proc/self/autogroup 2>/dev/null; exec "$@"' _ \
    "$RUN/coli" serve --model "$MODEL" --host 127.0.0.1 --port 0 "${SERVE_FLAGS[@]}" 2>"$log" &
  local pid=$!
  PIDS+=("$pid")
  eval "PID_$name=$pid"
}
wait_ready() { # name
  local name=$1 log="$OUT/serve-$1.log" pid url=""
  eval "pid=\$PID_$name"
  for _ in $(seq 1 600); do
    url=$(sed -n 's/^coli: listening on \(http:[^ ]*\)$/\1/p' "$log" | head -1)
    if [ -n "$url" ] && curl -sf "$url/ready" >/dev/null 2>&1; then break; fi
    if ! kill -0 "$pid" 2>/dev/null; then cat "$log" >&2; exit 1; fi
    sleep 0.5 # polling readiness, not synchronising a test
  done
  curl -sf "$url/ready" >/dev/null || { echo "lb_saturation: server $name not ready" >&2; exit 1; }
  eval "URL_$name=$url"
}
start_server a
start_server b
wait_ready a
wait_ready b
echo "servers: a=$URL_a (pid $PID_a) b=$URL_b (pid $PID_b)" >&2

# nginx on a free loopback port.
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
NEXT="proxy_next_upstream error timeout http_429 non_idempotent;"
[ "$LB_RETRY_429" = 1 ] || NEXT="proxy_next_upstream error timeout;"
USER_LINE=""
[ "$(id -u)" = 0 ] && USER_LINE="user nobody nogroup;"
mkdir -p "$RUN/nginx"
cat >"$OUT/nginx.conf" <<EOF
# Generated by loadtest/lb_saturation.sh; run as: nginx -c nginx.conf -p SCRATCH -g 'daemon off;'
$USER_LINE
worker_processes 1;
pid $RUN/nginx/nginx.pid;
error_log $OUT/nginx-error.log warn;
events { worker_connections 4096; }
http {
  log_format lb '\$msec \$status up=\$upstream_addr ust=\$upstream_status rt=\$request_time urt=\$upstream_response_time "\$request"';
  access_log $OUT/nginx-access.log lb;
  client_body_temp_path $RUN/nginx/body;
  proxy_temp_path $RUN/nginx/proxy;
  fastcgi_temp_path $RUN/nginx/fastcgi;
  uwsgi_temp_path $RUN/nginx/uwsgi;
  scgi_temp_path $RUN/nginx/scgi;
  client_max_body_size 4m;
  client_body_buffer_size 1m;   # request bodies stay in memory, so a retry can resend them

  upstream coli {
    least_conn;
    server ${URL_a#http://} max_fails=0;
    server ${URL_b#http://} max_fails=0;
    keepalive 32;
  }
  server {
    listen 127.0.0.1:$PORT;
    location / {
      proxy_pass http://coli;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;          # SSE: every event goes out as it comes
      proxy_read_timeout 600s;
      proxy_send_timeout 600s;
      $NEXT
      proxy_next_upstream_tries 2;
    }
  }
}
EOF
: >"$OUT/nginx-access.log"
: >"$OUT/nginx-error.log"
setsid bash -c 'echo -10 > /proc/self/autogroup 2>/dev/null; exec "$@"' _ \
  nginx -c "$OUT/nginx.conf" -p "$RUN/nginx" -g 'daemon off;' 2>>"$OUT/nginx-error.log" &
NGINX=$!
PIDS+=("$NGINX")
LB="http://127.0.0.1:$PORT"
for _ in $(seq 1 100); do
  curl -sf "$LB/ready" >/dev/null 2>&1 && break
  kill -0 "$NGINX" 2>/dev/null || { cat "$OUT/nginx-error.log" >&2; exit 1; }
  sleep 0.2 # polling readiness
done
echo "nginx: $LB (pid $NGINX, $(nginx -v 2>&1))" >&2

# Warm both servers directly (experts into memory, grammars compiled) before measuring.
for u in "$URL_a" "$URL_b"; do
  "$PYTHON" loadtest/loadtest.py --url "$u" --scenario mixed --users 2 --requests 4 \
    --max-tokens "$MAX_TOKENS" --ignore-eos >/dev/null || true
done

# RSS sampler: one row every 0.5 s (measurement, not synchronisation).
echo warmup >"$RUN/phase"
echo "unix_s,phase,rss_a_kb,rss_b_kb" >"$OUT/rss.csv"
(
  while true; do
    ra=$(awk '/^VmRSS/ {print $2}' "/proc/$PID_a/status" 2>/dev/null || echo "")
    rb=$(awk '/^VmRSS/ {print $2}' "/proc/$PID_b/status" 2>/dev/null || echo "")
    echo "$(date +%s.%N | cut -c1-14),$(cat "$RUN/phase"),$ra,$rb" >>"$OUT/rss.csv"
    sleep 0.5
  done
) &
SAMPLER=$!
sleep 1.5 # a few baseline samples

{
  echo "# $(date -u +%FT%TZ) coli=$COLI ($(sha256sum "$COLI" | cut -c1-12)) model=$MODEL"
  echo "# serve ${SERVE_FLAGS[*]}; nginx least_conn, retry_429=$LB_RETRY_429; scenario=$SCENARIO max_tokens=$MAX_TOKENS duration=${DURATION}s"
  echo "rate,start_unix,end_unix,loadavg_before,loadavg_after,loadtest_rc,max_rss_a_kb,max_rss_b_kb,alive_a,alive_b"
} >"$OUT/rates.csv"
: >"$OUT/metrics.txt"
for rate in $RATES; do
  echo "$rate" >"$RUN/phase"
  before=$(cut -d' ' -f1-3 /proc/loadavg)
  t0=$(date +%s.%N | cut -c1-14)
  rc=0
  boosted "$PYTHON" loadtest/loadtest.py --url "$LB" --rate "$rate" --duration "$DURATION" \
    --scenario "$SCENARIO" --max-tokens "$MAX_TOKENS" --ignore-eos \
    --out "$OUT/rate-$rate.json" >/dev/null || rc=$?
  t1=$(date +%s.%N | cut -c1-14)
  after=$(cut -d' ' -f1-3 /proc/loadavg)
  echo "idle" >"$RUN/phase"
  sleep 1 # one more RSS sample inside the phase window
  read -r ma mb < <(awk -F, -v r="$rate" '$2 == r { if ($3 > a) a = $3; if ($4 > b) b = $4 } END { print a + 0, b + 0 }' "$OUT/rss.csv")
  aa=$(kill -0 "$PID_a" 2>/dev/null && echo 1 || echo 0)
  ab=$(kill -0 "$PID_b" 2>/dev/null && echo 1 || echo 0)
  echo "$rate,$t0,$t1,$before,$after,$rc,$ma,$mb,$aa,$ab" >>"$OUT/rates.csv"
  for s in a b; do
    eval "u=\$URL_$s"
    curl -s "$u/metrics" | grep -E '^coli_(requests_total|generated_tokens_total|queue_depth|active_slots)' \
      | sed "s/^/rate=$rate server=$s /" >>"$OUT/metrics.txt" || true
  done
  "$PYTHON" - "$OUT/rate-$rate.json" "$rate" "$before" "$ma" "$mb" <<'EOF' >&2
import json, sys
s = json.load(open(sys.argv[1]))["summary"]
lat = lambda k: "-" if s[k]["p50"] is None else f"{s[k]['p50']:.2f}/{s[k]['p90']:.2f}"
print(f"rate {sys.argv[2]:>4}: {s['requests']} requests, {s['ok']} ok, errors {s['errors_by_status']}, "
      f"{s['aggregate_tok_s']:.1f} tok/s, TTFT p50/p90 {lat('ttft_s')} s, "
      f"RSS a/b {int(sys.argv[4])//1024}/{int(sys.argv[5])//1024} MiB, load [{sys.argv[3]}]")
EOF
  [ "$aa$ab" = 11 ] || { echo "lb_saturation: a server died at rate $rate" >&2; exit 1; }
done

kill "$SAMPLER" 2>/dev/null || true
wait "$SAMPLER" 2>/dev/null || true
SAMPLER=""

# Stop: SIGTERM to both servers, each must exit 0; then nginx.
status=0
for s in a b; do
  eval "p=\$PID_$s"
  kill -TERM "$p"
  rc=0
  wait "$p" || rc=$?
  echo "server $s exit status $rc" | tee -a "$OUT/rates.csv" >&2
  [ "$rc" = 0 ] || status=1
done
kill -QUIT "$NGINX" 2>/dev/null || true
wait "$NGINX" 2>/dev/null || true
PIDS=()
for s in a b; do # keep the logs short
  tail -n 50 "$OUT/serve-$s.log" >"$RUN/log" && mv "$RUN/log" "$OUT/serve-$s.log"
done
echo "results in $OUT" >&2
exit $status
