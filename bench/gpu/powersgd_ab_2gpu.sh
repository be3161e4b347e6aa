#!/usr/bin/env bash
# PowerSGD before and after one change, on two GPUs of one host, in one call:
# `ft bench` (BLOOM-560m, 8 x 512 per GPU, bf16, ddp, rank 4 from step 2)
# with the built-in all-reduce, then the old plug-in and the new one in
# turn, twice each. Carry .device/ with ft, libpowersgd.so (new) and
# libpowersgd_old.so (the plug-in built from the commit before the change,
# e.g. `git show REV:plugins/comm/powersgd/src/lib.rs`), and
# configs/bloom-560m/config.json.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
CONFIG=$D/configs/bloom-560m/config.json
nvidia-smi --query-gpu=name --format=csv,noheader
row() {
  "$FT" --plugin "$D/$1" bench --config $CONFIG --gpus 2 --strategy ddp --batch 8 --seq 512 --warmup 5 --steps 30 \
    --comm "$2" --comm-option comm.powersgd.rank=4 --comm-option comm.powersgd.start_iter=2 \
    --json "$OUT/$3.json" 2>&1 | grep -E "rror" | tail -3
}
row libpowersgd.so builtin builtin
for round in 1 2; do
  row libpowersgd_old.so powersgd old-$round
  row libpowersgd.so powersgd new-$round
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
print("| run | step ms | tokens/s/GPU | sent MB/step/rank | loss after 35 steps |\n|---|---|---|---|---|")
for name in ["builtin"] + [f"{v}-{r}" for r in (1, 2) for v in ("old", "new")]:
    for r in json.load(open(f"{out}/{name}.json")):
        print(f"| {name} | {r['step_ms']:.1f} | {r['tokens_per_s_per_gpu']:,.0f} | {r['comm_bytes_per_step'] / 1e6:,.1f} | {r['loss']:.4f} |")
PY
