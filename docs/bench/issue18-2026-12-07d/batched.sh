#!/usr/bin/env bash
# Batched decode, colibri against llama.cpp in one run: `coli bench --streams N` (N sequences of
# a 32-token prompt, then 48 steps decoded together, one batch per step) and llama.cpp's
# `llama-batched-bench` (-npp 32 -ntg 48 -npl N, the same shape), 2 threads each, interleaved
# repetitions, each process in its own autogroup at raised priority, load average beside each.
#   batched.sh GGUF COLI BATCHED_BENCH [REPS] > batched.txt
set -euo pipefail
GGUF=$1 COLI=$2 BB=$3 REPS=${4:-2}
boost() { setsid bash -c 'echo -10 > /proc/self/autogroup 2>/dev/null; exec "$@"' _ "$@"; }
for rep in $(seq "$REPS"); do
  for n in 1 4 8; do
    echo "rep $rep streams $n load $(cut -d' ' -f1-3 /proc/loadavg)"
    if [ "$n" = 1 ]; then
      boost "$COLI" bench --model "$GGUF" --mmap --threads 2 --prompt-tokens 32 --gen-tokens 48 --json 2>/dev/null \
        | python3 -c 'import json,sys; r=json.load(sys.stdin); print("colibri 1 %.2f tok/s" % r["decode_tok_per_s"])'
    else
      boost "$COLI" bench --model "$GGUF" --mmap --threads 2 --prompt-tokens 32 --gen-tokens 48 --streams "$n" --json 2>/dev/null \
        | python3 -c 'import json,sys; r=json.load(sys.stdin)["streams"]; print("colibri %d %.2f tok/s" % (r["streams"], r["aggregate_decode_tok_per_s"]))'
    fi
    boost "$BB" -m "$GGUF" -t 2 -tb 2 -c 4096 -b 512 -ub 512 -npp 32 -ntg 48 -npl "$n" 2>/dev/null \
      | awk -F'|' -v n="$n" '$4+0 == n && $2+0 == 32 { gsub(/ /, "", $9); print "llama.cpp " n " " $9 " tok/s" }'
  done
done
