#!/bin/bash
# SmolLM2-135M-Instruct Q4_1: colibri and llama.cpp (flash attention off), same file, same
# threads, interleaved repetitions (issue 18, 2026-12-06, eighth round). Prefill of 512 tokens;
# decode of 32 tokens after prompts of 64, 1024 and 4096. Each run in its own autogroup at
# nice -10; the load average before each run is recorded.
#   REPS=3 COLI=coli PY=python-with-llama-cpp bash smollm2.sh MODEL.gguf > smollm2.jsonl
# CTXS="512 64" runs only those contexts (512 is the prefill run).
set -euo pipefail
F=$1
boost() { setsid bash -c 'echo -10 > /proc/self/autogroup 2>/dev/null; exec "$@"' _ "$@"; }
cat "$F" > /dev/null
for rep in $(seq "${REPS:-3}"); do
  for ctx in ${CTXS:-512 64 1024 4096}; do
    gen=32; [ "$ctx" = 512 ] && gen=16
    for th in 2 1; do
      for engine in colibri llama.cpp; do
        la=$(cut -d' ' -f1-3 /proc/loadavg)
        case $engine in
          colibri) r=$(boost "$COLI" bench -m "$F" --mmap --threads "$th" --prompt-tokens "$ctx" --gen-tokens "$gen" --json 2>/dev/null) ;;
          llama.cpp) r=$(boost "$PY" engine/benches/llama_cpp_speed.py "$F" --threads "$th" --prompt-tokens "$ctx" --gen-tokens "$gen") ;;
        esac
        echo "{\"rep\": $rep, \"ctx\": $ctx, \"threads\": $th, \"engine\": \"$engine\", \"loadavg\": \"$la\", \"report\": $r}"
      done
    done
  done
done
