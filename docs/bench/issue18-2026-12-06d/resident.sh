#!/bin/bash
# The resident MoE GGUFs of §18.2 (qwen3-moe, 8 layers, hidden 2048, 64 experts top-8, expert
# width 1024, vocab 32000; `coli synth --format gguf`): colibri with the file's layout only (BASE: a
# wrapper running `COLI_INTERLEAVE=never coli`) and with Q4_K rows interleaved (NEW: `coli`), and
# llama.cpp (its Python binding, defaults), same file, same threads, interleaved; prefill of 512
# tokens, decode of 64. Each run in its own autogroup at nice -10.
#   REPS=3 BASE=coli-before NEW=coli-after PY=python-with-llama-cpp bash resident.sh DIR > resident.jsonl
# DIR holds moe-q4_k_m.gguf and moe-q8_0.gguf.
set -euo pipefail
W=$1
boost() { setsid bash -c 'echo -10 > /proc/self/autogroup 2>/dev/null; exec "$@"' _ "$@"; }
for rep in $(seq "${REPS:-3}"); do
  for t in ${TYPES:-q4_k_m q8_0}; do
    f="$W/moe-$t.gguf"; cat "$f" > /dev/null
    for th in 2 1; do
      for engine in before after llama.cpp; do
        la=$(cut -d' ' -f1-3 /proc/loadavg)
        case $engine in
          before) r=$(boost "$BASE" bench -m "$f" --mmap --threads "$th" --prompt-tokens 512 --gen-tokens 64 --json 2>/dev/null) ;;
          after) r=$(boost "$NEW" bench -m "$f" --mmap --threads "$th" --prompt-tokens 512 --gen-tokens 64 --json 2>/dev/null) ;;
          llama.cpp) r=$(boost "$PY" engine/benches/llama_cpp_speed.py "$f" --threads "$th" --prompt-tokens 512 --gen-tokens 64) ;;
        esac
        echo "{\"rep\": $rep, \"type\": \"$t\", \"threads\": $th, \"engine\": \"$engine\", \"loadavg\": \"$la\", \"report\": $r}"
      done
    done
  done
done
