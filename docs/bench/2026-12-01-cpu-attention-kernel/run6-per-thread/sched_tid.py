import re, sys
rows = []
for l in open(sys.argv[1]):
    p = l.split()
    if len(p) < 2: continue
    rows.append((p[0], {t.split(':')[0]: (int(t.split(':')[1]), int(t.split(':')[2])) for t in p[1:]}))
log = open(sys.argv[2]).read()
ts = re.findall(r'\[bench (\d\d:\d\d:\d\d) load [\d.]+\] (warm-up|express c=1 prompt=\d+|native  c=1 prompt=\d+)', log)
for (a, _), (b, name) in zip(ts, ts[1:]):
    ra = [r for r in rows if r[0][:8] >= a][0]; rb = [r for r in rows if r[0][:8] <= b][-1]
    d = []
    for tid, (run, wait) in rb[1].items():
        r0, w0 = ra[1].get(tid, (0, 0))
        d.append(((run - r0) / 1e9, (wait - w0) / 1e9, tid))
    d.sort(reverse=True)
    tot = sum(x[0] for x in d), sum(x[1] for x in d)
    print(f"{name} [{ra[0]}..{rb[0]}] all threads run {tot[0]:.2f}s wait {tot[1]:.2f}s; busiest: " +
          ", ".join(f"tid {t} run {r:.2f}s wait {w:.2f}s" for r, w, t in d[:3]))
