#!/bin/bash
# colibri streaming a quarter of the experts vs llama.cpp (mmap, which cannot be capped) on
# the same GGUF files made by vs_llama_cpp.sh.
#   engine/benches/streaming_vs_llama_cpp.sh WORKDIR PYTHON_WITH_LLAMA_CPP RAM_BUDGET
# Page cache: dropped before each "cold" run (needs root); colibri reads with O_DIRECT, so the
# page cache never holds more than its budget for it; llama.cpp maps the whole file.
set -euo pipefail
W=$1; PY=$2; RAM=$3
COLI=${COLI:-target/release/coli}
boost() { setsid bash -c 'echo -10 > /proc/self/autogroup 2>/dev/null; exec "$@"' _ "$@"; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
for t in q8_0 q4_k_m; do
  f="$W/moe-$t.gguf"
  for run in cold warm; do
    [ "$run" = cold ] && drop
    c=$(boost $COLI bench -m "$f" --ram "$RAM" --direct-io --threads 2 --prompt-tokens 64 --gen-tokens 64 --json 2>/dev/null)
    echo "{\"type\": \"$t\", \"engine\": \"colibri --ram $RAM --direct-io\", \"page_cache\": \"$run (colibri's second run uses learned pins)\", \"loadavg\": \"$(cut -d' ' -f1-3 /proc/loadavg)\", \"report\": $c}"
  done
  for run in cold warm; do
    [ "$run" = cold ] && drop
    l=$(boost "$PY" engine/benches/llama_cpp_speed.py "$f" --threads 2 --prompt-tokens 64 --gen-tokens 64)
    echo "{\"type\": \"$t\", \"engine\": \"llama.cpp mmap\", \"page_cache\": \"$run\", \"report\": $l}"
  done
done
