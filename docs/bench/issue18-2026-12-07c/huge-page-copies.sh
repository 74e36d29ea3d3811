#!/bin/bash
# coli-hugecopy = coli of 6aa771a with an experiment (not committed): with COLI_HUGECOPY set, Tensor::interleaved_for_cpu_all also copied every quantized matrix it did not interleave into Storage::huge_pages maps (same bytes), within the interleaving grant.
boost() { setsid bash -c 'echo -10 > /proc/self/autogroup 2>/dev/null; exec "$@"' _ "$@"; }
for rep in 1 2 3; do
 for t in ${TYPES:-q8_0 q6_k}; do
  for th in 1 2; do
   for hc in 0 1; do
     la=$(cut -d' ' -f1 /proc/loadavg)
     if [ $hc = 1 ]; then export COLI_HUGECOPY=1; else unset COLI_HUGECOPY; fi
     r=$(boost /work/bin/coli-hugecopy bench -m /work/bench/moe-$t.gguf --mmap --threads $th --prompt-tokens 512 --gen-tokens 64 --json 2>/dev/null | python3 -c 'import json,sys; d=json.load(sys.stdin); print("%.1f %.2f load=%.2f"%(d["prefill_tok_per_s"],d["decode_tok_per_s"],d["load_seconds"]))')
     echo "rep=$rep $t th=$th hc=$hc la=$la $r"
   done
  done
 done
done
