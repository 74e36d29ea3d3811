#!/bin/bash
# Q4_K products on the file's rows against the same rows interleaved in eights, alternating
# product by product in one process (`QMATMUL_AB=interleaved qmatmul_speed`, which also checks
# that both give the same bits), both layouts in ordinary heap buffers and both in huge-page maps
# (QMATMUL_HUGE=1); the AVX-512 VNNI kernels (default) and the AVX2 ones (COLI_ISA=avx2).
# One activation row in cache and streamed, several rows (prefill). Process CPU time, medians.
#   bash kernel.sh target/release/examples/qmatmul_speed > kernel.txt
set -euo pipefail
Q=$1
boost() { setsid bash -c 'echo -10 > /proc/self/autogroup 2>/dev/null; exec "$@"' _ "$@"; }
for rep in 1 2 3; do
  for s in "1024 2048 1 3000 1" "2048 1024 1 3000 1" "65536 2048 1 20 1" "65536 2048 1 20 2" \
           "1024 2048 4 1000 1" "1024 2048 16 200 1" "1024 2048 64 50 1" "1024 2048 512 6 2"; do
    for isa in avx512 avx2; do
      for huge in 0 1; do
        r=$(
          if [ $isa = avx2 ]; then export COLI_ISA=avx2; fi
          export QMATMUL_HUGE=$huge QMATMUL_AB=interleaved
          boost "$Q" q4_k $s
        )
        echo "rep $rep, $isa, load $(cut -d' ' -f1 /proc/loadavg): $r"
      done
    done
  done
done
