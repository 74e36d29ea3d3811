#!/usr/bin/env bash
# Issue 18 fifth round on this machine: colibri before/after, llama.cpp (Python binding, repack on),
# llama-bench with repack on and off; same GGUF, same threads, interleaved.
set -u
cd /work/main
PY=/work/peer/venv/bin/python
LB=/work/peer/build/bin/llama-bench
export LD_LIBRARY_PATH=/work/peer/build/bin
boost() { setsid bash -c 'echo -10 > /proc/self/autogroup 2>/dev/null; exec "$@"' _ "$@"; }
la() { cut -d' ' -f1-3 /proc/loadavg; }
for rep in 1 2; do
  for t in q4_k_m q8_0; do
    f=/work/bench/moe-$t.gguf; cat "$f" > /dev/null
    for th in 1 2; do
      for b in h n; do
        c=$(boost /work/bin/coli-$b bench -m "$f" --mmap --threads "$th" --prompt-tokens 512 --gen-tokens 64 --json 2>/dev/null)
        echo "{\"rep\": $rep, \"type\": \"$t\", \"threads\": $th, \"engine\": \"colibri-$b\", \"loadavg\": \"$(la)\", \"report\": $c}"
      done
      l=$(boost "$PY" engine/benches/llama_cpp_speed.py "$f" --threads "$th" --prompt-tokens 512 --gen-tokens 64)
      echo "{\"rep\": $rep, \"type\": \"$t\", \"threads\": $th, \"engine\": \"llama.cpp\", \"loadavg\": \"$(la)\", \"report\": $l}"
      for rp in 1 0; do
        o=$(boost $LB -m "$f" -t "$th" -p 512 -n 64 -r 1 --repack $rp -o jsonl 2>/dev/null | tr '\n' ',' | sed 's/,$//')
        echo "{\"rep\": $rep, \"type\": \"$t\", \"threads\": $th, \"engine\": \"llama-bench-repack$rp\", \"loadavg\": \"$(la)\", \"report\": [$o]}"
      done
    done
  done
done
