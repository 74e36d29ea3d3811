"""Summarise vs_llama_cpp.sh output: median prefill/decode per (type, threads, engine) and the
colibri / llama.cpp ratio, and decode's share of the memory roofline for both engines: colibri's
from its own report (active weight bytes per token × decode tok/s ÷ the machine's measured memory
bandwidth); llama.cpp's the same bytes and bandwidth at its decode tok/s, since both read the same
file's weights.   python summarise.py RUNS.jsonl"""
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_runs import read_runs  # noqa: E402

runs = read_runs(sys.argv[1])
groups = {}
for r in runs:
    rep = r["report"]
    groups.setdefault((r["type"], r["threads"], r["engine"]), []).append(
        (rep["prefill_tok_per_s"], rep["decode_tok_per_s"], rep.get("memory_bandwidth_fraction")))
print("| type | threads | colibri pp512 | llama.cpp pp512 | ratio | colibri tg64 | llama.cpp tg64 | ratio | roofline colibri | roofline llama.cpp | reps |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for (t, th) in sorted({(k[0], k[1]) for k in groups}, key=lambda x: (x[0], -x[1])):
    c = groups.get((t, th, "colibri"), [])
    l = groups.get((t, th, "llama.cpp"), [])
    if not c or not l:
        continue
    cp, cd = statistics.median(x[0] for x in c), statistics.median(x[1] for x in c)
    lp, ld = statistics.median(x[0] for x in l), statistics.median(x[1] for x in l)
    fr = [x[2] / x[1] for x in c if x[2] is not None and x[1] > 0]
    share = statistics.median(fr) if fr else None
    rc = f"{100 * share * cd:.0f} %" if share else "–"
    rl = f"{100 * share * ld:.0f} %" if share else "–"
    print(f"| {t} | {th} | {cp:.1f} | {lp:.1f} | {cp/lp:.2f}× | {cd:.2f} | {ld:.2f} | {cd/ld:.2f}× | {rc} | {rl} | {len(c)} |")
