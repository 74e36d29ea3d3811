"""Medians of resident.sh's runs per (type, threads, engine): prefill / decode tok/s, after ÷
llama.cpp, and decode's share of the memory roofline (active weight bytes per token × decode
tok/s ÷ the memory bandwidth `coli bench` measured).   python3 summarise_resident.py RUNS"""
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../engine/benches"))
from bench_runs import read_runs  # noqa: E402

runs = read_runs(sys.argv[1])
g = {}
for r in runs:
    g.setdefault((r["type"], r["threads"], r["engine"]), []).append(r)
print("| type | threads | before | after | llama.cpp | after ÷ llama.cpp prefill | decode | roofline after / llama.cpp | reps | load average (1 min) |")
print("|---|---|---|---|---|---|---|---|---|---|")
for t in ("q4_k_m", "q8_0", "q6_k", "q5_k_m"):
    for th in (2, 1):
        m = {}
        for e in ("before", "after", "llama.cpp"):
            rs = g.get((t, th, e), [])
            if not rs:
                break
            m[e] = (statistics.median(x["report"]["prefill_tok_per_s"] for x in rs),
                    statistics.median(x["report"]["decode_tok_per_s"] for x in rs))
        if len(m) < 3:
            continue
        after = g[(t, th, "after")]
        active = statistics.median(x["report"]["active_gb_per_token"] for x in after)
        bw = statistics.median(x["report"]["memory_gb_per_s"] for x in after)
        roof = lambda d: active * d / bw
        la = [float(x["loadavg"].split()[0]) for e in ("before", "after", "llama.cpp") for x in g[(t, th, e)]]
        cell = lambda e: f"{m[e][0]:.1f} / {m[e][1]:.2f}"
        print(f"| {t} | {th} | {cell('before')} | {cell('after')} | {cell('llama.cpp')} "
              f"| {m['after'][0] / m['llama.cpp'][0]:.2f}× | {m['after'][1] / m['llama.cpp'][1]:.2f}× "
              f"| {100 * roof(m['after'][1]):.0f} % / {100 * roof(m['llama.cpp'][1]):.0f} % "
              f"| {len(after)} | {min(la):.2f}–{max(la):.2f} |")
