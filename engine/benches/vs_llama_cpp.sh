#!/bin/bash
# colibri vs llama.cpp on the same GGUF files, same threads, interleaved repetitions.
#   engine/benches/vs_llama_cpp.sh WORKDIR PYTHON_WITH_LLAMA_CPP [LAYERS] [REPS]
# Builds a `coli synth` Qwen3-MoE (hidden 2048, 64 experts top-8, expert FFN 1024, vocab 32000),
# converts it to each of TYPES (default "q8_0 q4_k_m") with `coli convert` — or, with
# SYNTH=gguf, writes each type directly with `coli synth --format gguf` (no bf16 copy; any type
# `coli synth --type` accepts, e.g. TYPES="q4_k_m q8_0 q6_k q5_k_m") — then runs both engines
# fully resident (files in page cache, memory-mapped) at 1 and 2 threads: prefill 512 tokens,
# decode 64.
# Each run is in its own autogroup at raised priority (see docs/benchmarks.md); prints one
# JSON line per run. Summarise with engine/benches/summarise.py.
set -euo pipefail
W=$1; PY=$2; LAYERS=${3:-16}; REPS=${4:-3}
COLI=${COLI:-target/release/coli}
TYPES=${TYPES:-q8_0 q4_k_m}
SYNTH=${SYNTH:-bf16}
mkdir -p "$W"
shape=(--arch qwen3-moe --layers "$LAYERS" --hidden 2048 --heads 32 --kv-heads 4
  --experts 64 --top-k 8 --moe-intermediate 1024 --vocab 32000)
if [ "$SYNTH" != gguf ] && [ ! -f "$W/hf/config.json" ]; then
  $COLI synth "${shape[@]}" --dtype bf16 --out "$W/hf"
fi
for t in $TYPES; do
  [ -f "$W/moe-$t.gguf" ] && continue
  if [ "$SYNTH" = gguf ]; then
    $COLI synth "${shape[@]}" --format gguf --type "$t" --out "$W/moe-$t.gguf"
  else
    $COLI convert -m "$W/hf" -o "$W/moe-$t.gguf" -t "$t"
  fi
done
boost() { setsid bash -c 'echo -10 > /proc/self/autogroup 2>/dev/null; exec "$@"' _ "$@"; }
for rep in $(seq "$REPS"); do
  for t in $TYPES; do
    f="$W/moe-$t.gguf"; cat "$f" > /dev/null
    for th in 2 1; do
      c=$(boost $COLI bench -m "$f" --mmap --threads "$th" --prompt-tokens 512 --gen-tokens 64 --json 2>/dev/null)
      echo "{\"rep\": $rep, \"type\": \"$t\", \"threads\": $th, \"engine\": \"colibri\", \"loadavg\": \"$(cut -d' ' -f1-3 /proc/loadavg)\", \"report\": $c}"
      l=$(boost "$PY" engine/benches/llama_cpp_speed.py "$f" --threads "$th" --prompt-tokens 512 --gen-tokens 64)
      echo "{\"rep\": $rep, \"type\": \"$t\", \"threads\": $th, \"engine\": \"llama.cpp\", \"report\": $l}"
    done
  done
done
