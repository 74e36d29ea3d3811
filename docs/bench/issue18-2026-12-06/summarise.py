import json, sys, statistics as st
from collections import defaultdict
recs=[]; buf=""
for line in open(sys.argv[1]):
    buf+=line
    try: recs.append(json.loads(buf)); buf=""
    except json.JSONDecodeError: pass
pp=defaultdict(list); tg=defaultdict(list); la=defaultdict(list)
for r in recs:
    k=(r['type'],r['threads'],r['engine']); rep=r['report']
    if r['engine'].startswith('llama-bench'):
        pp[k]+= [x['avg_ts'] for x in rep if x['n_prompt']>0]; tg[k]+=[x['avg_ts'] for x in rep if x['n_gen']>0]
    else:
        pp[k].append(rep['prefill_tok_per_s']); tg[k].append(rep['decode_tok_per_s'])
    la[k].append(r.get('loadavg','').split()[0])
engines=['colibri-base','colibri-tiled','llama.cpp','llama-bench-repack1','llama-bench-repack0']
print("| type | threads | " + " | ".join(f"{e} pp512 / tg64" for e in engines)+" | tiled÷llama.cpp pp | tiled÷llama.cpp tg |")
for t in ['q4_k_m','q8_0']:
    for th in [1,2]:
        row=[]
        for e in engines:
            k=(t,th,e)
            if k in pp: row.append(f"{st.median(pp[k]):.1f} / {st.median(tg[k]):.2f}")
            else: row.append("-")
        n=(t,th,'colibri-tiled'); l=(t,th,'llama.cpp')
        rp=st.median(pp[n])/st.median(pp[l]) if n in pp and l in pp else 0
        rt=st.median(tg[n])/st.median(tg[l]) if n in pp and l in pp else 0
        print(f"| {t} | {th} | "+" | ".join(row)+f" | {rp:.2f}× | {rt:.2f}× |")
print("runs per cell:", {f"{k[0]}/{k[1]}/{k[2]}": len(v) for k,v in tg.items()})
print("loadavg range:", min(x for v in la.values() for x in v), max(x for v in la.values() for x in v))
