#!/bin/bash
# qs-knob = qmatmul_speed of 2d03506 with prefetch-knobs.patch applied (COLI_PF512: bytes ahead for the VNNI and 512-bit row kernels, 0 = their own distances); not committed code.
# Prefetch distance sweep for the 512-bit / VNNI kernels on this machine.
run() { setsid bash -c 'echo -10 > /proc/self/autogroup; exec "$@"' _ "$@"; }
for rep in 1 2 3; do
 for th in 1 2; do
  for t in q8_0 q6_k q5_k; do
   for pf in 0 1024 2048 3072 4096; do
     r=$(COLI_PF512=$pf run /work/bin/qs-knob $t 65536 2048 1 20 $th 2>&1 | tail -1)
     echo "rep=$rep th=$th pf=$pf load=$(cut -d' ' -f1 /proc/loadavg) $r"
   done
  done
 done
done
