#!/usr/bin/env bash
# The soak: one `coli serve` driven at and above saturation for DURATION seconds (30 minutes by
# default) while misbehaving clients (slowloris, disconnects mid-stream) hit it and a real
# Prometheus scrapes it with the project's alert rules loaded; then SIGTERM. Loopback only.
#
#   loadtest/soak.sh [COLI_BIN] [OUT_DIR]
#   target/soak-venv/bin/python loadtest/soak_report.py OUT_DIR   # summary.json and soak.png
#
# The server: the demo model (synthesized once under target/bench-cache when missing), THREADS
# compute threads, SLOTS slots, the default queue of 64 and a 300 s queue timeout, so an open-loop
# RATE well past what it answers (about 0.5-1 request/s on 2 shared cores) keeps the queue full
# (ColibriQueueSaturated's 51) and the rest is answered 429 at once; the long queue timeout keeps
# accepted requests from timing out (503), so ColibriHighErrorRate should stay quiet. Header
# timeout 10 s (the slowloris clients must be cut off by it).
# What runs beside it:
#   - loadtest.py, open loop at RATE req/s for DURATION s (SCENARIO, MAX_TOKENS with ignore_eos),
#     every answer checked (rate.json: every request's status, start and latency; its exit
#     status is 1 whenever any request got a 429, so the report, not it, judges the statuses);
#   - loadtest/abuse.py: 16 slowloris connections every 2 minutes, a client that resets its
#     connection at the first SSE event every 10 s (abuse.json);
#   - a sampler every 5 s: the server's VmRSS, /ready, and its coli_queue_depth, coli_active_slots
#     and expert cache counters read straight from /metrics (samples.csv), independent of
#     Prometheus, so the report can say which alerts should have fired;
#   - Prometheus (Debian's `prometheus`, installed when missing) scraping /metrics every 5 s and
#     evaluating k8s/monitoring/prometheus-rules.yaml every 5 s (after `promtool check rules`).
# At the end: the load stops, coli_active_slots and coli_queue_depth must return to 0 within 120 s
# (nothing leaked by the disconnects), SIGTERM must end the server with status 0, Prometheus
# scrapes the dead target for 30 s more (`up` 0, ColibriTargetDown pending), and its series
# (ALERTS, up, the queue depth, request rates) are saved as prom-*.json through its HTTP API.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
COLI=${1:-target/release/coli}
OUT=${2:-docs/bench/soak-$(date +%Y%m%d-%H%M)}
MODEL=${MODEL:-target/bench-cache/demo-olmoe-1g-v3}
PYTHON=${PYTHON:-target/soak-venv/bin/python}
DURATION=${DURATION:-1800}
RATE=${RATE:-2}
SCENARIO=${SCENARIO:-mixed}
MAX_TOKENS=${MAX_TOKENS:-32}
THREADS=${THREADS:-2}
SLOTS=${SLOTS:-4}
HEADER_TIMEOUT=10
SERVE_FLAGS=(--threads "$THREADS" --slots "$SLOTS" --queue-timeout-secs 300 --max-tokens-cap 64
  --header-timeout-secs "$HEADER_TIMEOUT")

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
RUN=$(mktemp -d /tmp/soak.XXXXXX)
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
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  echo "soak: installing prometheus" >&2
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
fi
RULES="$ROOT/k8s/monitoring/prometheus-rules.yaml"
promtool check rules "$RULES" >"$OUT/promtool-check.txt" 2>&1 || { cat "$OUT/promtool-check.txt" >&2; exit 1; }
echo "promtool: $(tr '\n' ' ' <"$OUT/promtool-check.txt")" >&2

# The binary is copied, so a rebuild during the run cannot change what is measured.
cp "$COLI" "$RUN/coli"
if [ ! -f "$MODEL/config.json" ]; then
  MODEL="$RUN/model"
  "$RUN/coli" synth --arch olmoe --layers 8 --hidden 1024 --experts 32 --top-k 4 \
    --moe-intermediate 640 --vocab 734 --out "$MODEL" >&2
fi

log="$OUT/serve.log"
setsid bash -c 'echo -10 > /proc/self/autogroup 2>/dev/null; exec "$@"' _ \
  "$RUN/coli" serve --model "$MODEL" --host 127.0.0.1 --port 0 "${SERVE_FLAGS[@]}" 2>"$log" &
SERVER=$!
PIDS+=("$SERVER")
URL=""
for _ in $(seq 1 600); do
  URL=$(sed -n 's/^coli: listening on \(http:[^ ]*\)$/\1/p' "$log" | head -1)
  if [ -n "$URL" ] && curl -sf "$URL/ready" >/dev/null 2>&1; then break; fi
  kill -0 "$SERVER" 2>/dev/null || { cat "$log" >&2; exit 1; }
  sleep 0.5 # polling readiness, not synchronising a test
done
curl -sf "$URL/ready" >/dev/null || { echo "soak: server not ready" >&2; exit 1; }
MODEL_ID=$(curl -sf "$URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
echo "server: $URL (pid $SERVER), model $MODEL_ID" >&2

PROM_PORT=$(free_port)
PROM="http://127.0.0.1:$PROM_PORT"
cat >"$OUT/prometheus.yml" <<EOF
# Generated by loadtest/soak.sh.
global:
  scrape_interval: 5s
  evaluation_interval: 5s
rule_files:
  - $RULES
scrape_configs:
  - job_name: colibri
    metrics_path: /metrics
    static_configs:
      - targets: ["${URL#http://}"]
EOF
setsid prometheus --config.file="$OUT/prometheus.yml" --storage.tsdb.path="$RUN/tsdb" \
  --web.listen-address="127.0.0.1:$PROM_PORT" --log.level=warn 2>"$OUT/prometheus.log" &
PROMPID=$!
PIDS+=("$PROMPID")
for _ in $(seq 1 120); do
  curl -sf "$PROM/-/ready" >/dev/null 2>&1 && break
  kill -0 "$PROMPID" 2>/dev/null || { cat "$OUT/prometheus.log" >&2; exit 1; }
  sleep 0.5 # polling readiness
done
echo "prometheus: $PROM ($(prometheus --version 2>&1 | head -1))" >&2

# Warm up (experts into memory, grammars compiled) before the clock starts.
"$PYTHON" loadtest/loadtest.py --url "$URL" --scenario mixed --users 2 --requests 4 \
  --max-tokens "$MAX_TOKENS" --ignore-eos >/dev/null || true

metric() { # text name -> the value of an unlabelled sample, or empty
  awk -v n="$2" '$1 == n { print $2 }' <<<"$1"
}
echo "unix_s,rss_kb,ready,queue_depth,active_slots,cache_hits,cache_misses,loadavg1" >"$OUT/samples.csv"
(
  while true; do
    m=$(curl -s --max-time 4 "$URL/metrics" || true)
    rss=$(awk '/^VmRSS/ {print $2}' "/proc/$SERVER/status" 2>/dev/null || echo "")
    ready=$(curl -s -o /dev/null -w '%{http_code}' --max-time 4 "$URL/ready" || true)
    echo "$(date +%s.%N | cut -c1-14),$rss,$ready,$(metric "$m" coli_queue_depth),$(metric "$m" coli_active_slots),$(metric "$m" coli_expert_cache_hits_total),$(metric "$m" coli_expert_cache_misses_total),$(cut -d' ' -f1 /proc/loadavg)" >>"$OUT/samples.csv"
    sleep 5 # a sampling period (measurement, not synchronisation)
  done
) &
SAMPLER=$!

T0=$(date +%s)
{
  echo "start_unix=$T0"
  echo "coli=$COLI sha256=$(sha256sum "$COLI" | cut -c1-12) commit=$(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "model=$MODEL"
  echo "serve ${SERVE_FLAGS[*]} (queue_limit default)"
  echo "load rate=$RATE scenario=$SCENARIO max_tokens=$MAX_TOKENS duration=$DURATION"
  echo "machine: $(nproc) CPUs, $(awk '/MemTotal/ {printf "%.1f GB", $2/1e6}' /proc/meminfo), $(sed -n 's/^model name\t: //p' /proc/cpuinfo | head -1)"
  echo "loadavg_before=$(cut -d' ' -f1-3 /proc/loadavg)"
} >"$OUT/run.txt"
echo "soak: ${DURATION}s at $RATE req/s from $(date -u +%T)" >&2

"$PYTHON" loadtest/abuse.py --url "$URL" --model "$MODEL_ID" --duration "$DURATION" \
  --header-timeout "$HEADER_TIMEOUT" --out "$OUT/abuse.json" >"$OUT/abuse.log" 2>&1 &
ABUSE=$!
rc=0
boosted "$PYTHON" loadtest/loadtest.py --url "$URL" --rate "$RATE" --duration "$DURATION" \
  --scenario "$SCENARIO" --max-tokens "$MAX_TOKENS" --ignore-eos --out "$OUT/rate.json" \
  >"$OUT/loadtest.log" 2>&1 || rc=$?
arc=0
wait "$ABUSE" || arc=$?
T1=$(date +%s)
echo "end_unix=$T1 loadtest_rc=$rc abuse_rc=$arc loadavg_after=$(cut -d' ' -f1-3 /proc/loadavg)" >>"$OUT/run.txt"

# Nothing left behind: the slots and the queue empty once the load is gone.
idle=0
for _ in $(seq 1 120); do
  m=$(curl -s --max-time 4 "$URL/metrics" || true)
  if [ "$(metric "$m" coli_active_slots)" = 0 ] && [ "$(metric "$m" coli_queue_depth)" = 0 ]; then idle=1; break; fi
  sleep 1 # polling for the server to go idle
done
echo "idle_after_load=$idle" >>"$OUT/run.txt"
curl -s "$URL/metrics" >"$OUT/metrics-end.txt" || true

sleep 12 # two more samples and scrapes of the idle server
kill "$SAMPLER" 2>/dev/null || true
wait "$SAMPLER" 2>/dev/null || true
SAMPLER=""

kill -TERM "$SERVER"
src=0
wait "$SERVER" || src=$?
TDOWN=$(date +%s)
echo "server_exit_status=$src down_unix=$TDOWN" >>"$OUT/run.txt"
sleep 30 # Prometheus scrapes the dead target (up == 0, ColibriTargetDown pending)

TEND=$(date +%s)
q() { # name query -> prom-NAME.json over the whole run at a 5 s step
  curl -s -G "$PROM/api/v1/query_range" --data-urlencode "query=$2" \
    --data-urlencode "start=$T0" --data-urlencode "end=$TEND" --data-urlencode "step=5" >"$OUT/prom-$1.json"
}
q alerts 'ALERTS'
q up 'up{job="colibri"}'
q queue 'max(coli_queue_depth)'
q requests 'sum by (status) (rate(coli_requests_total[1m]))'
q hit_rate 'sum(rate(coli_expert_cache_hits_total[15m])) / (sum(rate(coli_expert_cache_hits_total[15m])) + sum(rate(coli_expert_cache_misses_total[15m])))'
curl -s "$PROM/api/v1/rules" >"$OUT/prom-rules.json"
kill -TERM "$PROMPID" 2>/dev/null || true
wait "$PROMPID" 2>/dev/null || true
PIDS=()
tail -n 200 "$log" >"$RUN/log" && mv "$RUN/log" "$log"
echo "results in $OUT (loadtest rc $rc, abuse rc $arc, server exit $src, idle after load $idle)" >&2
[ -s "$OUT/rate.json" ] && [ "$arc" = 0 ] && [ "$src" = 0 ] && [ "$idle" = 1 ]
