#!/usr/bin/env bash
# Issue 18 sixth round: colibri before (4a9023b) / after (the tiled Q4_K and Q6_K prefill
# kernels), llama.cpp (Python binding, its defaults) and llama-bench (repacking on and off), same
# Q4_K_M GGUF, same threads, interleaved. Paths as on the machine of docs/benchmarks.md §19.
set -u
cd /work/main
PY=/work/peer/venv/bin/python
LB=/work/peer/build/bin/llama-bench
export LD_LIBRARY_PATH=/work/peer/build/bin
boost() { setsid bash -c 'echo -10 > /proc/self/autogroup 2>/dev/null; exec "$@"' _ "$@"; }
la() { cut -d' ' -f1-3 /proc/loadavg; }
REPS=${REPS:-2}
for rep in $(seq 1 "$REPS"); do
  for t in q4_k_m; do
    f=/work/bench/moe-$t.gguf; cat "$f" > /dev/null
    for th in 1 2; do
      for b in base tiled; do
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
