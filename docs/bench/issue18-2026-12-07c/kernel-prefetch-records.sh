#!/bin/bash
# qs-knob = qmatmul_speed of 2d03506 with prefetch-knobs.patch applied (COLI_PFREC: bytes ahead of the current record for the 512-bit interleaved Q4_K kernel, 0 = the current record); not committed code.
run() { setsid bash -c 'echo -10 > /proc/self/autogroup; exec "$@"' _ "$@"; }
for rep in 1 2 3; do
 for th in 1 2; do
   for pf in 0 1184 2368 3072 4096; do
     r=$(COLI_PFREC=$pf QMATMUL_AB=interleaved QMATMUL_HUGE=1 QMATMUL_DISTINCT_ROWS=8192 run /work/bin/qs-knob q4_k 65536 2048 1 20 $th 2>&1 | tail -1)
     echo "rep=$rep th=$th pf=$pf load=$(cut -d' ' -f1 /proc/loadavg) $r"
   done
 done
done
