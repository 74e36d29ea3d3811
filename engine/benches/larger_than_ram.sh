#!/bin/bash
# A model larger than RAM: colibri streaming its experts against llama.cpp's mmap, same GGUF,
# same threads, cold and warm.
#   engine/benches/larger_than_ram.sh WORKDIR PYTHON_WITH_LLAMA_CPP
# Writes WORKDIR/big-$TYPE.gguf with `coli synth --format gguf` (tensor by tensor, no bf16
# copy) unless it exists: a Qwen3-MoE of LAYERS layers, hidden 2048, EXPERTS experts top-8,
# expert width 1024, sized so the file is ≥ 1.3× this machine's RAM (the script refuses a
# smaller one). Then per repetition: colibri with a RAM budget of RAM_FRACTION of the machine's
# memory, O_DIRECT reads, prefetch and learned pins (`cold` = page cache dropped and no usage
# history; `warm` = the second run, with the pins the first one learned), and llama.cpp
# (memory-mapped, which cannot be capped; `cold` after dropping the page cache, `warm` right
# after). Prefill PROMPT tokens, decode GEN. TTFT for both = load + prefill of the first
# prompt (llama.cpp without its warm-up eval). A run longer than TIMEOUT seconds (default 1200)
# is stopped and reported as `"timed_out": true` with the seconds it ran. One JSON line per run;
# needs root for /proc/sys/vm/drop_caches.
set -euo pipefail
W=$1; PY=$2
COLI=${COLI:-target/release/coli}
TYPE=${TYPE:-q8_0}
LAYERS=${LAYERS:-40}
EXPERTS=${EXPERTS:-128}
THREADS=${THREADS:-2}
PROMPT=${PROMPT:-32}
GEN=${GEN:-32}
REPS=${REPS:-1}
RAM_FRACTION=${RAM_FRACTION:-0.6}
TIMEOUT=${TIMEOUT:-1200}
mkdir -p "$W"
F="$W/big-$TYPE.gguf"
if [ ! -f "$F" ]; then
  $COLI synth --arch qwen3-moe --layers "$LAYERS" --hidden 2048 --heads 32 --kv-heads 4 \
    --experts "$EXPERTS" --top-k 8 --moe-intermediate 1024 --vocab 32000 \
    --format gguf --type "$TYPE" --out "$F" >&2
fi
ram=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) * 1024 )) # bytes (awk's %d stops at 2^31)
size=$(stat -c %s "$F")
if [ "$size" -lt $((ram * 13 / 10)) ]; then
  echo "larger_than_ram: $F is $size bytes, under 1.3× RAM ($ram bytes); raise LAYERS or EXPERTS" >&2
  exit 1
fi
budget=$(python3 -c "print(int($ram * $RAM_FRACTION))")
ONLY=${ONLY:-both} # colibri, llama.cpp or both
boost() { setsid timeout "$TIMEOUT" bash -c 'echo -10 > /proc/self/autogroup 2>/dev/null; exec "$@"' _ "$@"; }
# Runs "$@"; prints its JSON report, or a timed-out record with the seconds it ran.
report() {
  local t0 out rc
  t0=$(date +%s.%N)
  rc=0; out=$(boost "$@") || rc=$?
  if [ "$rc" = 124 ]; then
    echo "{\"timed_out\": true, \"seconds\": $(echo "$(date +%s.%N) - $t0" | bc)}"
  elif [ "$rc" != 0 ]; then
    echo "{\"failed\": $rc}"
  else
    echo "$out"
  fi
}
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
state=$(mktemp -d)
meta="\"file_bytes\": $size, \"ram_bytes\": $ram, \"type\": \"$TYPE\", \"threads\": $THREADS"
for rep in $(seq "$REPS"); do
  rm -rf "${state:?}"/*
  [ "$ONLY" = llama.cpp ] || for run in cold warm; do
    [ "$run" = cold ] && drop
    load=$(cut -d' ' -f1-3 /proc/loadavg)
    c=$(COLI_STATE_DIR="$state" report $COLI bench -m "$F" --ram "$budget" --direct-io \
      --threads "$THREADS" --prompt-tokens "$PROMPT" --gen-tokens "$GEN" --json 2>/dev/null)
    echo "{\"rep\": $rep, $meta, \"engine\": \"colibri --ram $budget --direct-io\", \"run\": \"$run\", \"loadavg\": \"$load\", \"report\": $c}"
  done
  [ "$ONLY" = colibri ] || for run in cold warm; do
    [ "$run" = cold ] && drop
    load=$(cut -d' ' -f1-3 /proc/loadavg)
    l=$(report "$PY" engine/benches/llama_cpp_speed.py "$F" --threads "$THREADS" \
      --prompt-tokens "$PROMPT" --gen-tokens "$GEN" --no-warmup)
    echo "{\"rep\": $rep, $meta, \"engine\": \"llama.cpp mmap\", \"run\": \"$run\", \"loadavg\": \"$load\", \"report\": $l}"
  done
done
rm -rf "$state"
