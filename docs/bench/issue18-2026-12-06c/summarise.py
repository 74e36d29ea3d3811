"""Medians of smollm2.sh's lines per (context, threads, engine): prefill at 512 tokens, decode
at each context, colibri ÷ llama.cpp, and the load averages seen.   python3 summarise.py RUNS"""
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../engine/benches"))
from bench_runs import read_runs  # noqa: E402

runs = read_runs(sys.argv[1])
g = {}
for r in runs:
    g.setdefault((r["ctx"], r["threads"], r["engine"]), []).append(r)
print("| context | threads | what | colibri | llama.cpp | colibri ÷ llama.cpp | reps | load average (1 min) |")
print("|---|---|---|---|---|---|---|---|")
for ctx in (512, 64, 1024, 4096):
    for th in (2, 1):
        key = "prefill_tok_per_s" if ctx == 512 else "decode_tok_per_s"
        c = g.get((ctx, th, "colibri"), [])
        l = g.get((ctx, th, "llama.cpp"), [])
        if not c or not l:
            continue
        mc = statistics.median(x["report"][key] for x in c)
        ml = statistics.median(x["report"][key] for x in l)
        la = [float(x["loadavg"].split()[0]) for x in c + l]
        what = "prefill" if ctx == 512 else "decode"
        print(f"| {ctx} | {th} | {what} | {mc:.1f} | {ml:.1f} | {mc / ml:.2f}× | {len(c)} "
              f"| {min(la):.2f}–{max(la):.2f} |")
