#!/usr/bin/env bash
# Where Llama-7B's full_shard step goes (nvidia-h200-x2, 2 x 2048 tokens per
# GPU): `ft bench --profile`, then rank 0's GPU time grouped by kind of kernel.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
timeout 240 "$FT" bench --config $D/configs/codellama-7b/config.json --gpus 2 --strategy full_shard --batch 2 --seq 2048 \
  --warmup 3 --steps 6 --profile $OUT/prof 2>&1 | grep -E "^llama" | head -2
rm -f $OUT/prof/*.trace.json
python3 - $OUT/prof/llama-full_shard-2gpu-2x2048.kernels.tsv <<'PY'
import collections, sys
groups = collections.Counter()
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])][1:]
for ms, share, calls, name in rows:
    ms = float(ms)
    if name.startswith("nccl:"): continue
    kind = ("NCCL (overlapped)" if "nccl" in name else "GEMM" if "nvjet" in name or "gemm" in name.lower() else
            "attention" if "sdpa" in name or "flash" in name or "cudnn" in name else
            "AdamW" if "adamw" in name or "FusedOptimizer" in name else
            "dtype casts and copies" if "copy" in name.lower() or "Cat" in name else
            "norms" if "norm" in name.lower() else "other elementwise and reductions")
    groups[kind] += ms
for kind, ms in groups.most_common(): print(f"{ms:8.1f} ms  {kind}")
for ms, share, calls, name in rows[:25]: print(f"{float(ms):8.2f} {calls:>5} {name[:110]}")
PY
