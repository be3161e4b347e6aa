#!/usr/bin/env bash
# Where the time goes at the baseline's micro-batch (4 x ~200 tokens): ft's
# step with its phase breakdown beside transformers eager at the same shape.
set -euo pipefail
source "$(dirname "$0")/env.sh"
C=.device/configs
for seq in 200 512; do
  "$FT" bench --config $C/bloom-560m/config.json --batch 4 --seq $seq --warmup 5 --steps 20 --breakdown
  python3 bench/peers/hf_train_step.py --config $C/bloom-560m/config.json --batch 4 --seq $seq --warmup 5 --steps 20
done
