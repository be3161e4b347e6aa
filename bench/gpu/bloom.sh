#!/usr/bin/env bash
# BLOOM-560m training step on one GPU, 8 x 512, bf16 (ft: fp32 masters;
# peers: fp32 weights under autocast): `ft bench` (with its breakdown and
# kernel profile first) beside transformers + torch.compile, twice each.
set -uo pipefail
source "$(dirname "$0")/env.sh"
CONFIG=.device/configs/bloom-560m/config.json
"$FT" bench --config $CONFIG --batch 8 --seq 512 --breakdown --profile $OUT/bloom-profile --json $OUT/ft-bloom-breakdown.json 2>&1 | tail -n 30
for run in 1 2; do
  "$FT" bench --config $CONFIG --batch 8 --seq 512 --json $OUT/ft-bloom-$run.json 2>&1 | grep -E "tok|MFU" | tail -n 2
  timeout 300 python3 bench/peers/hf_train_step.py --config $CONFIG --batch 8 --seq 512 --compile --json $OUT/hf-compiled-$run.json 2>&1 | tail -n 1
done
