#!/bin/bash
# SmolLM2-135M-Instruct Q4_1: colibri before and after this round's attention change, and
# llama.cpp (flash attention off), same file, same threads, interleaved (issue 18, 2026-12-06
# second round). Prefill of 512 tokens; decode of 32 tokens after prompts of 64, 1024 and 4096.
#   REPS=3 BASE=coli-before NEW=coli-after PY=python-with-llama-cpp bash run.sh MODEL.gguf
# CTXS="512 64" runs only those contexts (512 is the prefill run).
set -euo pipefail
F=$1
boost() { setsid bash -c 'echo -10 > /proc/self/autogroup 2>/dev/null; exec "$@"' _ "$@"; }
cat "$F" > /dev/null
for rep in $(seq "${REPS:-3}"); do
  for ctx in ${CTXS:-512 64 1024 4096}; do
    gen=32; [ "$ctx" = 512 ] && gen=16
    for th in 2 1; do
      for engine in before after llama.cpp; do
        la=$(cut -d' ' -f1-3 /proc/loadavg)
        case $engine in
          before) r=$(boost "$BASE" bench -m "$F" --mmap --threads "$th" --prompt-tokens "$ctx" --gen-tokens "$gen" --json 2>/dev/null) ;;
          after) r=$(boost "$NEW" bench -m "$F" --mmap --threads "$th" --prompt-tokens "$ctx" --gen-tokens "$gen" --json 2>/dev/null) ;;
          llama.cpp) r=$(boost "$PY" engine/benches/llama_cpp_speed.py "$F" --threads "$th" --prompt-tokens "$ctx" --gen-tokens "$gen") ;;
        esac
        echo "{\"rep\": $rep, \"ctx\": $ctx, \"threads\": $th, \"engine\": \"$engine\", \"loadavg\": \"$la\", \"report\": $r}"
      done
    done
  done
done
