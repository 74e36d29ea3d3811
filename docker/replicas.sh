#!/usr/bin/env bash
# Replicas that fail safely: two `coli` containers behind nginx on a private Docker network,
# measured (issue 19 item 6; the figures are in docs/reliability.md "Replicas").
#
#   a. kill: one replica is killed (`docker kill`, SIGKILL) while requests run on it. Requests
#      routed to the survivor all succeed; requests in flight on the dead one either fail as an
#      error the client sees (a stream cut without its terminating chunk, a 502), or — when no
#      byte had reached the client yet — are answered whole by the survivor (nginx passes them
#      on); never a hang, never a wrong answer. After `docker start` the replica serves again
#      through nginx.
#   b. rolling restart: `docker stop -t STOP_TIMEOUT` (SIGTERM: the server drains) of one replica
#      after the other, each started again and ready before the next, under load: no accepted
#      request is lost (each gets its complete answer; a request a draining replica refuses with
#      503 is passed to the other one by nginx).
#   c. conversation affinity: two-turn conversations (turn 2 = turn 1's messages, the answer and
#      a new user message) through nginx hashing on the conversation key (x-session-id, else the
#      OpenAI `user` field) with `hash ... consistent`, and through nginx without affinity (round
#      robin, and least_conn): the share of second turns on their first turn's replica, with
#      cached_tokens > 0, and with cached_tokens covering turn 1's prompt (the chat template's
#      first tokens are shared by every conversation, so a slot of another conversation already
#      gives cached_tokens > 0). PASS: affinity sends every second turn to its first turn's
#      replica and reuses turn 1's prefix more often than round robin.
#
# Each scenario prints its counts and PASS or FAIL lines; the script exits 1 if any failed. Every
# answer is checked: greedy (temperature 0, ignore_eos) answers to a fixed set of prompts, which
# must equal the reference answers both replicas gave before the scenarios, complete (finish
# reason `length`, usage, a stream's [DONE]). The load is docker/replicas_driver.py (Python's
# standard library only), closed loop: REPLICAS_WORKERS clients (4), each sending its next
# request when the last one ended, alternately streamed and not.
#
# nginx's configuration: docker/replicas.sh writes the outer file (the two replicas' addresses
# and the balancing method); the conversation key and the proxying (retries, timeouts,
# buffering) are helm/colibri/files/router/*.conf, mounted as they are: the same files the
# chart's router uses.
#
# Images: colibri:replicas (docker/Dockerfile, target prebuilt, from COLI_DOCKER_BINARY: default
# target/release/coli, else target/debug/coli) on colibri-base:bookworm, and colibri-nginx:bookworm
# (Debian's nginx-light); both bases come from docker/build-base.sh (ONLY=cpu+nginx; needs root
# the first time). The model: `coli synth` (an OLMoE-shaped model with random weights), mounted
# read-only at /models. Containers run as non-root users with read-only root file systems. The
# replicas get `--threads 1` (REPLICAS_THREADS) and 4 slots each (REPLICAS_SLOTS). Containers and the network are
# removed at the end; images are kept. Without a Docker daemon it says "skipped" and exits 0.
#
#   bash docker/replicas.sh                       # all three scenarios (about 3 min on 2 cores)
#   SCENARIOS="kill affinity" bash docker/replicas.sh
#   REPLICAS_OUT=docs/bench/replicas-DATE bash docker/replicas.sh   # keep records and logs
set -euo pipefail
cd "$(dirname "$0")/.."

T0=$SECONDS
SCENARIOS=${SCENARIOS:-kill rolling affinity}
BIN=${COLI_DOCKER_BINARY:-}
if [ -z "$BIN" ]; then
  BIN=target/release/coli
  [ -x "$BIN" ] || BIN=target/debug/coli
fi
PY=${REPLICAS_PYTHON:-python3}
THREADS=${REPLICAS_THREADS:-1}
SLOTS=${REPLICAS_SLOTS:-4}
DRAIN_SECS=${REPLICAS_DRAIN_SECS:-20}
STOP_TIMEOUT=${REPLICAS_STOP_TIMEOUT:-30}
export REPLICAS_MAX_TOKENS=${REPLICAS_MAX_TOKENS:-24}
export REPLICAS_WORKERS=${REPLICAS_WORKERS:-4}
export REPLICAS_CONVERSATIONS=${REPLICAS_CONVERSATIONS:-24}
# The synthesized model: big enough that a request lasts about a second on one thread (so that
# requests are in flight when a replica dies), small enough to load in seconds.
SYNTH=${REPLICAS_SYNTH:---arch olmoe --layers 8 --hidden 1024 --experts 16 --top-k 4 --moe-intermediate 512 --vocab 2048}

IMG=colibri:replicas
IMG_NGINX=colibri-nginx:bookworm
BASE=colibri-base:bookworm
NET=colibri-replicas
A=colibri-replica-a
B=colibri-replica-b
ROUTER=colibri-router          # hash on the conversation key (the chart's router)
ROUTER_RR=colibri-router-rr    # round robin: no affinity, for comparison
ROUTER_LC=colibri-router-lc    # least_conn: no affinity either
CONTAINERS=("$A" "$B" "$ROUTER" "$ROUTER_RR" "$ROUTER_LC")
SHARED=$PWD/helm/colibri/files/router

step() { printf '\n== replicas %s\n' "$*"; }
info() { printf '   %s\n' "$*"; }
fail() {
  printf '   FAIL: %s\n' "$*" >&2
  exit 1
}

if ! command -v docker >/dev/null 2>&1 || ! docker info >/dev/null 2>&1; then
  echo "replicas: skipped: no Docker daemon"
  exit 0
fi
if ! docker image inspect "$BASE" >/dev/null 2>&1 || ! docker image inspect "$IMG_NGINX" >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ]; then
    echo "replicas: skipped: $BASE or $IMG_NGINX is missing and building them (debootstrap) needs root;"
    echo "          run 'ONLY=cpu+nginx bash docker/build-base.sh' as root once"
    exit 0
  fi
fi
[ -x "$BIN" ] || fail "$BIN not found: build it (cargo build --release -p colibri-server) or set COLI_DOCKER_BINARY"
if docker buildx version >/dev/null 2>&1; then :; else export DOCKER_BUILDKIT=0; fi

TMP=$(mktemp -d "${TMPDIR:-/tmp}/colibri-replicas.XXXXXX")
chmod 755 "$TMP"
OUT=${REPLICAS_OUT:-$TMP/out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
FAILED=()
LOAD_PID=""
cleanup() {
  local rc=$?
  set +e
  # A load generator still running (a scenario failed): it is this script's own child.
  if [ -n "$LOAD_PID" ] && kill -0 "$LOAD_PID" 2>/dev/null; then
    kill "$LOAD_PID"
    wait "$LOAD_PID" 2>/dev/null
  fi
  for c in "${CONTAINERS[@]}"; do
    if docker container inspect "$c" >/dev/null 2>&1; then
      docker logs "$c" >"$OUT/$c.log" 2>&1
      if [ "$rc" != 0 ] && [ "${#FAILED[@]}" = 0 ]; then
        printf '\n-- last log lines of %s:\n' "$c" >&2
        tail -n 15 "$OUT/$c.log" | sed 's/^/   /' >&2
      fi
    fi
  done
  docker rm -f -v "${CONTAINERS[@]}" >/dev/null 2>&1
  docker network rm "$NET" >/dev/null 2>&1
  if [ -z "${REPLICAS_OUT:-}" ]; then rm -rf "$TMP"; else rm -rf "$TMP/model" "$TMP/router"; fi
  printf '\nreplicas: %s in %d s\n' "$([ "$rc" = 0 ] && echo "all passed" || echo "FAILED (exit $rc)")" "$((SECONDS - T0))"
}
trap cleanup EXIT
docker rm -f -v "${CONTAINERS[@]}" >/dev/null 2>&1 || true
docker network rm "$NET" >/dev/null 2>&1 || true

# The published host address of container $1's port 8080 (it changes when the container restarts).
url_of() { echo "http://$(docker port "$1" 8080/tcp | head -n 1)"; }
# Waits until GET /ready on container $1 answers 200, for at most $2 seconds.
wait_ready() {
  local c=$1 deadline=$((SECONDS + $2)) url
  while [ "$SECONDS" -lt "$deadline" ]; do
    [ "$(docker inspect -f '{{.State.Running}}' "$c")" = true ] || fail "$c exited: $(docker logs --tail 5 "$c" 2>&1)"
    url=$(url_of "$c")
    curl -fsS -o /dev/null "$url/ready" 2>/dev/null && return 0
    sleep 0.2 # polling a condition under a deadline
  done
  fail "$c not ready after $2 s"
}
# Polls `replicas_driver.py count FILE SINCE [UPSTREAM]` until it reaches $4, for at most $5 s.
wait_records() {
  local file=$1 since=$2 upstream=$3 want=$4 deadline=$((SECONDS + $5)) n=0
  while [ "$SECONDS" -lt "$deadline" ]; do
    n=$("$PY" docker/replicas_driver.py count "$file" "$since" "$upstream")
    [ "$n" -ge "$want" ] && return 0
    sleep 0.2 # polling a condition under a deadline
  done
  fail "only $n of $want requests${upstream:+ on $upstream} completed in $5 s (records: $file)"
}
now() { date +%s.%N; }
# The value of the first /metrics sample of container $1 whose line starts with $2.
metric() {
  local body
  body=$(curl -fsS "$(url_of "$1")/metrics") || return 1
  awk -v m="$2" 'index($0, m) == 1 && !done { print $2; done = 1 }' <<<"$body"
}
verdict() { # NAME COMMAND...: runs an analysis, records a failed scenario
  if "${@:2}"; then :; else FAILED+=("$1"); fi
}

printf 'replicas: docker %s; %s; %s; load %s\n' "$(docker version -f '{{.Server.Version}}' 2>/dev/null)" \
  "$(nproc) cores" "$("$BIN" --version)" "$(cut -d' ' -f1-3 /proc/loadavg)"

# ---------------------------------------------------------------------------------------------
step "1. images ($IMG, $IMG_NGINX)"
ONLY=cpu+nginx bash docker/build-base.sh | sed 's/^/   /'
mkdir -p docker/prebuilt
# Without debug info, replaced only when it changed (the build cache holds); docker/test.sh
# does the same.
if command -v strip >/dev/null 2>&1; then
  strip --strip-debug -o docker/prebuilt/coli.new "$BIN"
else
  cp "$BIN" docker/prebuilt/coli.new
fi
chmod 0755 docker/prebuilt/coli.new
if cmp -s docker/prebuilt/coli.new docker/prebuilt/coli; then rm docker/prebuilt/coli.new; else mv docker/prebuilt/coli.new docker/prebuilt/coli; fi
docker build -f docker/Dockerfile --target prebuilt --build-arg BASE="$BASE" -t "$IMG" . >"$TMP/build.log" 2>&1 ||
  { tail -n 30 "$TMP/build.log" >&2; fail "docker build (log above)"; }
info "$IMG ($(docker run --rm "$IMG" --version)), $IMG_NGINX ($(docker run --rm "$IMG_NGINX" -v 2>&1))"

# ---------------------------------------------------------------------------------------------
step "2. network, two replicas, three routers"
MODEL=$TMP/model
# shellcheck disable=SC2086 # SYNTH is a list of flags
"$BIN" synth $SYNTH --out "$MODEL" >"$TMP/synth.log" 2>&1 || { cat "$TMP/synth.log" >&2; fail "coli synth"; }
chmod -R a+rX "$MODEL"
# A user-defined subnet, so that each container keeps its address across `docker start` (nginx
# resolves its upstream addresses once, at start; the chart's router re-resolves DNS names).
SUBNET=${REPLICAS_SUBNET:-}
for prefix in ${SUBNET:+"${SUBNET%.0/24}"} 10.213.71 10.213.72 10.213.73 172.30.213 172.30.214; do
  if docker network create --subnet "$prefix.0/24" "$NET" >/dev/null 2>&1; then
    SUBNET=$prefix.0/24
    break
  fi
done
docker network inspect "$NET" >/dev/null 2>&1 || fail "could not create the network $NET (set REPLICAS_SUBNET=a free x.y.z.0/24)"
P=${SUBNET%.0/24}
declare -A IP=([$A]=$P.10 [$B]=$P.11 [$ROUTER]=$P.20 [$ROUTER_RR]=$P.21 [$ROUTER_LC]=$P.22)
info "network $NET, $SUBNET"

start_replica() {
  docker run -d --name "$1" --network "$NET" --ip "${IP[$1]}" -p 127.0.0.1::8080 \
    --read-only --tmpfs /tmp -v "$MODEL:/models:ro" --stop-timeout "$STOP_TIMEOUT" "$IMG" \
    serve --host 0.0.0.0 --port 8080 --model /models --served-model-name replicas \
    --threads "$THREADS" --slots "$SLOTS" --context 1024 --max-tokens-cap 256 \
    --drain-secs "$DRAIN_SECS" >/dev/null
}
start_replica "$A"
start_replica "$B"

# The routers' nginx.conf: this file's part; the shared snippets are included as they are.
mkdir -p "$TMP/router"
router_conf() { # BALANCE_DIRECTIVE
  cat <<EOF
# Written by docker/replicas.sh; the included snippets are helm/colibri/files/router/*.conf.
worker_processes 1;
pid /tmp/nginx.pid;
events { worker_connections 1024; }
http {
    log_format colibri '\$msec \$status up=\$upstream_addr ust=\$upstream_status rt=\$request_time '
                       'key=\$colibri_conversation_key "\$request"';
    access_log /dev/stdout colibri;
    client_body_temp_path /tmp/client_body;
    proxy_temp_path /tmp/proxy;
    fastcgi_temp_path /tmp/fastcgi;
    uwsgi_temp_path /tmp/uwsgi;
    scgi_temp_path /tmp/scgi;

    include /etc/nginx/colibri/conversation-key.conf;
    map \$remote_addr \$colibri_key_fallback { default \$remote_addr; }

    upstream colibri {
        $1
        server ${IP[$A]}:8080 max_fails=1 fail_timeout=5s;
        server ${IP[$B]}:8080 max_fails=1 fail_timeout=5s;
        keepalive 16;
    }
    server {
        listen 8080;
        # For the driver: which replicas nginx tried, in order (not in the chart's router).
        add_header X-Colibri-Upstream \$upstream_addr always;
        location / {
            include /etc/nginx/colibri/proxy.conf;
        }
    }
}
EOF
}
# shellcheck disable=SC2016 # an nginx variable, not a shell one
router_conf 'hash $colibri_conversation_key consistent;' >"$TMP/router/hash.conf"
router_conf '# round robin (the default)' >"$TMP/router/round_robin.conf"
router_conf 'least_conn;' >"$TMP/router/least_conn.conf"
chmod -R a+rX "$TMP/router"
start_router() { # NAME CONF
  docker run -d --name "$1" --network "$NET" --ip "${IP[$1]}" -p 127.0.0.1::8080 \
    --user 33:33 --read-only --tmpfs /tmp --stop-signal SIGQUIT \
    -v "$SHARED:/etc/nginx/colibri:ro" -v "$TMP/router:/etc/colibri-router:ro" \
    "$IMG_NGINX" -c "/etc/colibri-router/$2" >/dev/null
}
start_router "$ROUTER" hash.conf
start_router "$ROUTER_RR" round_robin.conf
start_router "$ROUTER_LC" least_conn.conf
wait_ready "$A" 120
wait_ready "$B" 120
wait_ready "$ROUTER" 30
wait_ready "$ROUTER_RR" 30
wait_ready "$ROUTER_LC" 30
# (The log is read whole before grep looks at it: with pipefail, `docker logs | grep -m1` can fail
# when grep stops reading early.)
log_a=$(docker logs "$A" 2>&1)
info "replicas ${IP[$A]} ($A), ${IP[$B]} ($B): uid $(docker exec "$A" id -u), $(grep -m1 -oE 'device: (cpu$|(vulkan|cuda) .*)' <<<"$log_a" || echo 'device ?')"
info "routers ${IP[$ROUTER]} (hash on the conversation key), ${IP[$ROUTER_RR]} (round robin), ${IP[$ROUTER_LC]} (least_conn): uid $(docker exec "$ROUTER" id -u)"
if docker exec "$A" sh -c 'echo x > /models/probe' 2>/dev/null; then fail "a replica could write /models"; fi
LB=$(url_of "$ROUTER")
LB_RR=$(url_of "$ROUTER_RR")
LB_LC=$(url_of "$ROUTER_LC")
"$PY" docker/replicas_driver.py reference "$(url_of "$A")" "$OUT/reference.json" | sed 's/^/   /'
"$PY" docker/replicas_driver.py same "$(url_of "$B")" "$OUT/reference.json" | sed 's/^/   /; s/^   /   replica b: /'
"$PY" docker/replicas_driver.py same "$LB" "$OUT/reference.json" | sed 's/^/   through the router: /'

# Runs the load through $1 into $2 in the background; sets LOAD_PID and STOP_FILE.
start_load() {
  STOP_FILE=$TMP/stop-$RANDOM
  : >"$2"
  "$PY" docker/replicas_driver.py load "$1" "$OUT/reference.json" "$2" "$STOP_FILE" &
  LOAD_PID=$!
}
stop_load() {
  touch "$STOP_FILE"
  wait "$LOAD_PID" || fail "the load generator failed"
  LOAD_PID=""
}

# ---------------------------------------------------------------------------------------------
if [[ " $SCENARIOS " == *" kill "* ]]; then
  step "a. docker kill $A mid-load, then docker start"
  t=$SECONDS
  REC=$OUT/kill.jsonl
  start_load "$LB" "$REC"
  wait_records "$REC" 0 "" 8 120
  # Kill while the replica has a request running (its own gauge; polled under a deadline).
  deadline=$((SECONDS + 30))
  until [ "$(metric "$A" coli_active_slots)" -ge 1 ] 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; do sleep 0.05; done
  running=$(metric "$A" coli_active_slots || echo "?")
  kill_at=$(now)
  docker kill "$A" >/dev/null
  info "killed $A with $running request(s) running on it ($(cut -d' ' -f1-3 /proc/loadavg))"
  # The survivor carries the load for a while.
  wait_records "$REC" "$kill_at" "" 12 120
  docker start "$A" >/dev/null
  wait_ready "$A" 120
  ready_at=$(now)
  info "$A started again, ready $(awk -v a="$kill_at" -v b="$ready_at" 'BEGIN { printf "%.1f", b - a }') s after the kill"
  wait_records "$REC" "$ready_at" "${IP[$A]}:8080" 3 60
  stop_load
  verdict kill "$PY" docker/replicas_driver.py kill "$REC" "${IP[$A]}:8080" "${IP[$B]}:8080" "$kill_at" "$ready_at"
  info "($((SECONDS - t)) s, load $(cut -d' ' -f1-3 /proc/loadavg))"
fi

# ---------------------------------------------------------------------------------------------
if [[ " $SCENARIOS " == *" rolling "* ]]; then
  step "b. rolling restart: docker stop -t $STOP_TIMEOUT (SIGTERM, drain_secs $DRAIN_SECS) of each replica under load"
  t=$SECONDS
  REC=$OUT/rolling.jsonl
  start_load "$LB" "$REC"
  wait_records "$REC" 0 "" 8 120
  events="["
  for c in "$A" "$B"; do
    t_stop=$(now)
    docker stop -t "$STOP_TIMEOUT" "$c" >/dev/null
    t_exit=$(now)
    code=$(docker inspect -f '{{.State.ExitCode}}' "$c")
    drained=$(docker logs "$c" 2>&1 | grep -c 'coli: stopped' || true)
    docker start "$c" >/dev/null
    wait_ready "$c" 120
    t_ready=$(now)
    info "$c: stopped (exit $code, 'coli: stopped' logged $drained time(s)), started, ready"
    events+="{\"replica\": \"$c\", \"t_stop\": $t_stop, \"t_exit\": $t_exit, \"t_ready\": $t_ready, \"exit_code\": $code},"
    # Both replicas serve again before the next one stops.
    wait_records "$REC" "$t_ready" "${IP[$c]}:8080" 2 60
  done
  events="${events%,}]"
  stop_load
  verdict rolling "$PY" docker/replicas_driver.py rolling "$REC" "$events"
  info "($((SECONDS - t)) s, load $(cut -d' ' -f1-3 /proc/loadavg))"
fi

# ---------------------------------------------------------------------------------------------
if [[ " $SCENARIOS " == *" affinity "* ]]; then
  step "c. conversation affinity: $REPLICAS_CONVERSATIONS two-turn conversations, $REPLICAS_WORKERS at a time"
  t=$SECONDS
  "$PY" docker/replicas_driver.py conversations "$LB_RR" "$OUT/affinity-round-robin.json" "without affinity (round robin)"
  "$PY" docker/replicas_driver.py conversations "$LB_LC" "$OUT/affinity-least-conn.json" "without affinity (least_conn)"
  "$PY" docker/replicas_driver.py conversations "$LB" "$OUT/affinity-hash.json" "with affinity (hash on the key)"
  verdict affinity "$PY" docker/replicas_driver.py affinity "$OUT/affinity-hash.json" "$OUT/affinity-round-robin.json"
  info "($((SECONDS - t)) s, load $(cut -d' ' -f1-3 /proc/loadavg))"
fi

# ---------------------------------------------------------------------------------------------
step "summary"
for c in "$A" "$B"; do
  body=$(curl -fsS "$(url_of "$c")/metrics" || true)
  info "$c since its last start: $(awk '/^coli_requests_total\{/ { n += $2 } END { print n + 0 }' <<<"$body") requests, $(awk '/^coli_cached_prompt_tokens_total / { print $2 }' <<<"$body") cached prompt tokens"
done
if [ "${#FAILED[@]}" -gt 0 ]; then
  info "FAILED: ${FAILED[*]}"
  exit 1
fi
info "PASS: $SCENARIOS"
