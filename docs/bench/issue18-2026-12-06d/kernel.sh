#!/bin/bash
# Q4_K products on the file's rows against the same rows interleaved in eights, alternating
# product by product in one process (`QMATMUL_AB=interleaved qmatmul_speed`, which also checks
# that both give the same bits): one activation row (decode) in cache and streamed from memory,
# and several rows (prefill), 1 and 2 threads. Process CPU time, medians.
#   bash kernel.sh target/release/examples/qmatmul_speed > kernel.txt
set -euo pipefail
Q=$1
boost() { setsid bash -c 'echo -10 > /proc/self/autogroup 2>/dev/null; exec "$@"' _ "$@"; }
for rep in 1 2 3; do
  for s in "1024 2048 1 3000 1" "2048 1024 1 3000 1" "65536 2048 1 20 1" "65536 2048 1 20 2" \
           "1024 2048 4 1000 1" "1024 2048 64 50 1" "1024 2048 512 6 2"; do
    echo "rep $rep, load $(cut -d' ' -f1 /proc/loadavg): $(QMATMUL_AB=interleaved boost "$Q" q4_k $s)"
  done
done
