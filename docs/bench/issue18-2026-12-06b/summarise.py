"""Medians of run.sh's lines per (context, threads, engine): prefill at 512 tokens, decode at
each context, and after ÷ llama.cpp, before ÷ llama.cpp.   python3 summarise.py RUNS.jsonl"""
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
g = {}
for r in runs:
    g.setdefault((r["ctx"], r["threads"], r["engine"]), []).append(r["report"])
print("| context | threads | what | before | after | llama.cpp | after ÷ llama.cpp | before ÷ llama.cpp | reps |")
print("|---|---|---|---|---|---|---|---|---|")
for ctx in (512, 64, 1024, 4096):
    for th in (2, 1):
        key = "prefill_tok_per_s" if ctx == 512 else "decode_tok_per_s"
        m = {}
        for e in ("before", "after", "llama.cpp"):
            v = [x[key] for x in g.get((ctx, th, e), [])]
            m[e] = statistics.median(v) if v else None
        if None in m.values():
            continue
        n = len(g[(ctx, th, "after")])
        what = "prefill" if ctx == 512 else "decode"
        print(f"| {ctx} | {th} | {what} | {m['before']:.1f} | {m['after']:.1f} | {m['llama.cpp']:.1f} "
              f"| {m['after'] / m['llama.cpp']:.2f}× | {m['before'] / m['llama.cpp']:.2f}× | {n} |")
