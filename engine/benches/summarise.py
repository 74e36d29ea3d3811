"""Summarise vs_llama_cpp.sh output: median prefill/decode per (type, threads, engine) and the
colibri / llama.cpp ratio.   python summarise.py RUNS.jsonl"""
import json
import statistics
import sys

text = open(sys.argv[1]).read()
dec = json.JSONDecoder()
runs, i = [], 0
while i < len(text):
    if text[i].isspace():
        i += 1
        continue
    obj, i = dec.raw_decode(text, i)
    runs.append(obj)
groups = {}
for r in runs:
    rep = r["report"]
    groups.setdefault((r["type"], r["threads"], r["engine"]), []).append(
        (rep["prefill_tok_per_s"], rep["decode_tok_per_s"]))
print("| type | threads | colibri pp512 | llama.cpp pp512 | ratio | colibri tg64 | llama.cpp tg64 | ratio | reps |")
print("|---|---|---|---|---|---|---|---|---|")
for (t, th) in sorted({(k[0], k[1]) for k in groups}, key=lambda x: (x[0], -x[1])):
    c = groups.get((t, th, "colibri"), [])
    l = groups.get((t, th, "llama.cpp"), [])
    if not c or not l:
        continue
    cp, cd = statistics.median(x[0] for x in c), statistics.median(x[1] for x in c)
    lp, ld = statistics.median(x[0] for x in l), statistics.median(x[1] for x in l)
    print(f"| {t} | {th} | {cp:.1f} | {lp:.1f} | {cp/lp:.2f}× | {cd:.2f} | {ld:.2f} | {cd/ld:.2f}× | {len(c)} |")
