#!/usr/bin/env bash
# The communication plug-ins over NCCL between two GPUs of one host
# (BLOOM-560m, 8 x 512 per GPU, bf16): ft's ddp with the built-in all-reduce,
# powersgd (rank 4, compressing from step 2) and bf16; full_shard with the
# built-in gathers and int8. Each row's step time, bytes each rank sends per
# step and loss after 35 steps (the hooks' kernels checked in training
# against the built-in); torch's DDP with and without its hooks beside, in
# the same call. Carry .device/ as for comm_hooks.sh.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
CONFIG=$D/configs/bloom-560m/config.json
PLUGINS="--plugin $D/libpowersgd.so --plugin $D/libint8.so --plugin $D/libbf16.so"
nvidia-smi --query-gpu=name --format=csv,noheader
"$FT" $PLUGINS bench --config $CONFIG --gpus 2 --strategy ddp --batch 8 --seq 512 --warmup 5 --steps 30 \
  --comm builtin,powersgd,bf16 --comm-option comm.powersgd.rank=4 --comm-option comm.powersgd.start_iter=2 \
  --json $OUT/ft-2gpu-ddp.json 2>&1 | grep -E "^\| |rror" | tail -5
"$FT" $PLUGINS bench --config $CONFIG --gpus 2 --strategy full_shard --batch 8 --seq 512 --warmup 5 --steps 30 \
  --comm builtin,int8 --json $OUT/ft-2gpu-full-shard.json 2>&1 | grep -E "^\| |rror" | tail -4
torchrun --nproc-per-node 2 bench/peers/ddp_comm_hook.py --config $CONFIG --batch 8 --seq 512 --json $OUT/torch-2gpu-hooks.json 2>&1 | grep -E "torch DDP|Error" | tail -4
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
print("\n| run | step ms | tokens/s/GPU | sent MB/step/rank | loss after 35 steps |\n|---|---|---|---|---|")
for name in ("ddp", "full-shard"):
    for r in json.load(open(f"{out}/ft-2gpu-{name}.json")):
        if r.get("step_ms") is None:
            print(f"| ft {r['strategy']} + {r['comm']} | failed | | | |")
            continue
        print(f"| ft {r['strategy']} + {r['comm']} | {r['step_ms']:.1f} | {r['tokens_per_s_per_gpu']:,.0f} | {r['comm_bytes_per_step'] / 1e6:,.1f} | {r['loss']:.4f} |")
t = json.load(open(f"{out}/torch-2gpu-hooks.json"))
for hook in ("none", "bf16", "powersgd"):
    print(f"| torch DDP + {hook} | {t[hook]:.1f} | {8 * 512 / t[hook] * 1e3:,.0f} | — | — |")
PY
