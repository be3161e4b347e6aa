#!/usr/bin/env bash
# The communication plug-ins on one GPU (BLOOM-560m, 8 x 512, bf16):
# - ft's int8 and low-rank kernels against ATen's ops (differences, time);
# - what each hook's compression and decompression of every unit's gradient
#   and parameters costs per step (`ft bench`'s comm_hook_ms), as a share of
#   the step it would join;
# - torch's own hooks under DDP (bench/peers/ddp_comm_hook.py) beside, in
#   the same call;
# - BLOOM-560m through the seam at 1 GPU with the built-in collectives,
#   twice, for the ±2% check against the committed tables.
# Carry .device/ with: ft, libpowersgd.so, libint8.so, libbf16.so, configs/bloom-560m/config.json.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
CONFIG=$D/configs/bloom-560m/config.json
PLUGINS="--plugin $D/libpowersgd.so --plugin $D/libint8.so --plugin $D/libbf16.so"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for repeat in 1 2; do
  "$FT" $PLUGINS bench --config $CONFIG --gpus 1 --strategy ddp --batch 8 --seq 512 --warmup 5 --steps 20 \
    --comm builtin,powersgd,int8,bf16 --comm-option comm.powersgd.rank=4 --json $OUT/ft-hooks-$repeat.json 2>&1 | grep -vE "^\[rank" | tail -6
done
# ft's int8 and low-rank kernels beside the ATen ops over 64M values: time and differences.
"$FT" bench --config $CONFIG --gpus 1 --strategy ddp --batch 8 --seq 512 --warmup 3 --steps 5 --breakdown \
  --json $OUT/ft-kernels.json 2>&1 | grep -oE "(int8 round trip|low-rank products)[^;]*" | head -2
python3 bench/peers/ddp_comm_hook.py --config $CONFIG --batch 8 --seq 512 --json $OUT/torch-hooks.json 2>&1 | grep -E "torch DDP|Error" | tail -4
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
print("\n| run | step ms | hook ms per step | share of the step |\n|---|---|---|---|")
for repeat in (1, 2):
    for r in json.load(open(f"{out}/ft-hooks-{repeat}.json")):
        if r.get("step_ms") is None:
            print(f"| ft {r['comm']} (run {repeat}) | failed | | |")
            continue
        hook = r.get("comm_hook_ms")
        share = f"{100 * hook / r['step_ms']:.1f}%" if hook is not None else "—"
        print(f"| ft {r['comm']} (run {repeat}) | {r['step_ms']:.1f} | {hook if hook is None else round(hook, 2)} | {share} |")
t = json.load(open(f"{out}/torch-hooks.json"))
for hook in ("bf16", "powersgd"):
    print(f"| torch DDP + {hook} hook | {t[hook]:.1f} | {t[hook] - t['none']:.1f} | {100 * (t[hook] / t['none'] - 1):.1f}% |")
print(f"| torch DDP, no hook | {t['none']:.1f} | — | — |")
PY
