#!/usr/bin/env bash
# OPT-1.3B full_shard scaling 1 -> 2 GPUs (nvidia-h200-x2): with gradients
# reduced in bf16, and a profile of the fp32-reduce run on 2 GPUs that lists
# where the compute stream sits idle and which NCCL kernel runs meanwhile.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
C=$D/configs/opt-1.3b/config.json
"$FT" bench --config $C --gpus 1,2 --strategy full_shard --reduce-dtype compute --json $OUT/opt-bf16-reduce.json 2>&1 | grep -vE "^\[rank|DeviceProperties" | tail -5
"$FT" bench --config $C --gpus 2 --strategy full_shard --profile $OUT/prof --json $OUT/opt-fp32-profiled.json 2>&1 | grep -vE "^\[rank [1-9]|DeviceProperties" | tail -3
python3 - $OUT/prof/opt-full_shard-2gpu-8x512.trace.json <<'PY'
import collections, json, sys
t = json.load(open(sys.argv[1]))
ev = [e for e in t["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
# Per stream: busy time, and when compute (non-NCCL) kernels run vs NCCL kernels, over the profiled steps.
streams = collections.defaultdict(list)
for e in ev: streams[e["args"].get("stream")].append((e["ts"], e["ts"] + e["dur"], e["name"]))
start = min(e["ts"] for e in ev); end = max(e["ts"] + e["dur"] for e in ev)
print(f"span {(end-start)/1e3/3:.1f} ms per step")
comp = sorted((s, e) for st, v in streams.items() for s, e, n in v if "nccl" not in n)
nccl = sorted((s, e, n) for st, v in streams.items() for s, e, n in v if "nccl" in n)
# compute idle gaps > 50 us, with what NCCL op runs during them
merged = []
for s, e in comp:
    if merged and s <= merged[-1][1]: merged[-1][1] = max(merged[-1][1], e)
    else: merged.append([s, e])
busy = sum(e - s for s, e in merged)
print(f"compute busy {busy/1e3/3:.1f} ms per step; nccl kernels {sum(e-s for s,e,n in nccl)/1e3/3:.1f} ms per step")
gaps = [(merged[i][1], merged[i+1][0]) for i in range(len(merged)-1) if merged[i+1][0] - merged[i][1] > 50]
print(f"compute gaps > 50us: {len(gaps)}, total {sum(b-a for a,b in gaps)/1e3/3:.1f} ms per step")
for a, b in sorted(gaps, key=lambda g: g[0]-g[1])[:12]:
    during = [n[:40] for s, e, n in nccl if s < b and e > a]
    print(f"  gap {(b-a)/1e3:.2f} ms at +{(a-start)/1e3:.1f} ms; nccl during: {during[:2]}")
PY
