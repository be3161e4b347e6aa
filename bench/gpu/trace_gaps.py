# Where a profiled step's GPU time goes between kernels (`ft train
# --profile-steps N:N`'s trace.json): the GPU's busy share per 50 ms, the
# idle gaps by length, and one decoding step's kernels (a step is found by a
# kernel that runs once per decoding step: ~511 calls in a rollout of 512
# tokens). Usage: trace_gaps.py TRACE.json
import json, sys, collections
t = json.load(open(sys.argv[1]))
ev = [e for e in t["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
ev.sort(key=lambda e: e["ts"])
start, end = ev[0]["ts"], max(e["ts"] + e["dur"] for e in ev)
busy = sum(e["dur"] for e in ev)
print(f"kernels {len(ev)} span {(end-start)/1e3:.1f} ms busy {busy/1e3:.1f} ms ({busy/(end-start):.1%})")
# 50 ms windows
w = 50_000; buckets = collections.defaultdict(float)
for e in ev: buckets[int((e["ts"] - start) // w)] += e["dur"]
print("busy per 50 ms window:", " ".join(f"{buckets[i]/w:.0%}" for i in range(int((end - start) // w) + 1)))
gaps = collections.defaultdict(lambda: [0, 0.0]); last = ev[0]["ts"] + ev[0]["dur"]
for e in ev[1:]:
    g = e["ts"] - last
    if g > 0:
        k = "<2us" if g < 2 else "2-5us" if g < 5 else "5-20us" if g < 20 else "20-100us" if g < 100 else "0.1-1ms" if g < 1000 else ">1ms"
        gaps[k][0] += 1; gaps[k][1] += g
    last = max(last, e["ts"] + e["dur"])
for k in ["<2us", "2-5us", "5-20us", "20-100us", "0.1-1ms", ">1ms"]:
    print(f"gap {k:>9}: {gaps[k][0]:7d} gaps {gaps[k][1]/1e3:9.1f} ms")
# decode steps: marker = a kernel name occurring ~511 times
names = collections.Counter(e["name"] for e in ev)
marker = [n for n, c in names.items() if 505 <= c <= 515]
print("markers:", [m[:60] for m in marker][:5])
if marker:
    m = marker[0]; idx = [i for i, e in enumerate(ev) if e["name"] == m]
    per = [idx[i + 1] - idx[i] for i in range(len(idx) - 1)]
    spans = [ev[idx[i + 1]]["ts"] - ev[idx[i]]["ts"] for i in range(len(idx) - 1)]
    b = [sum(e["dur"] for e in ev[idx[i]:idx[i + 1]]) for i in range(len(idx) - 1)]
    mid = len(per) // 2
    print(f"decode step (mid): {per[mid]} kernels, span {spans[mid]/1e3:.3f} ms, busy {b[mid]/1e3:.3f} ms; mean span {sum(spans)/len(spans)/1e3:.3f} ms")
    step = ev[idx[mid]:idx[mid + 1]]
    small = [e for e in step if e["dur"] < 5]
    print(f"  kernels < 5 us: {len(small)} summing {sum(e['dur'] for e in small)/1e3:.3f} ms")
    c = collections.defaultdict(lambda: [0, 0.0])
    for e in step: c[e["name"][:90]][0] += 1; c[e["name"][:90]][1] += e["dur"]
    for n, (k, d) in sorted(c.items(), key=lambda x: -x[1][1]):
        print(f"  {d:8.1f} us {k:4d}x {n}")
