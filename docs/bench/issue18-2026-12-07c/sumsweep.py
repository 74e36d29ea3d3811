import re,sys,statistics as st
from collections import defaultdict
d=defaultdict(list)
for l in open(sys.argv[1]):
    m=re.search(r'th=(\d) pf=(\d+) .*? (\S+) \d+×\d+ .*?: ([\d.]+) µs',l)
    if m: d[(m[1],m[3],int(m[2]))].append(float(m[4]))
keys=sorted(set((k[0],k[1]) for k in d))
for th,t in keys:
    pfs=sorted(p for (a,b,p) in d if a==th and b==t)
    base=st.median(d[(th,t,0)])
    print(th,t,' '.join(f"{p}:{st.median(d[(th,t,p)]):.0f}({base/st.median(d[(th,t,p)]):.2f}x,{'/'.join('%.0f'%v for v in d[(th,t,p)])})" for p in pfs))
