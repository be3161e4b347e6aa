#!/usr/bin/env bash
# ft plan's predictions beside measured rows on one GPU: BLOOM-560m and
# OPT-1.3B (8 x 512) under ddp and full_shard, with and without CPU offload
# and activation checkpointing, and the Llama-7B shape (2 x 2048, full_shard,
# checkpointing), after `ft calibrate` on the same machine (the three models'
# GEMM shapes at 4096 tokens per micro-batch, the cpu offload's AdamW, the
# pinned host link); then two tables of every row, predicted vs measured: with
# the table's rates, then with the measured ones.
set -euo pipefail
source "$(dirname "$0")/env.sh"
C=.device/configs
SMALL=(--config $C/bloom-560m/config.json --config $C/opt-1.3b/config.json)
"$FT" calibrate "${SMALL[@]}" --config $C/codellama-7b/config.json --batch 8 --seq 512 --out $OUT/calibration.json
for off in none cpu; do
  for ck in "" --activation-checkpointing; do
    n=$off${ck:+-ckpt}
    "$FT" bench "${SMALL[@]}" --gpus 1 --strategy ddp,full_shard --batch 8 --seq 512 --offload $off $ck \
      --warmup 3 --steps 10 --json $OUT/small-$n.json >/dev/null 2>$OUT/small-$n.err || tail -n 3 $OUT/small-$n.err
  done
done
# The Llama row holds ~122 GB: only on a GPU with more (an H200), else left out and said so.
if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)" -gt 130000 ]; then
  "$FT" bench --config $C/codellama-7b/config.json --gpus 1 --strategy full_shard --batch 2 --seq 2048 \
    --activation-checkpointing --warmup 2 --steps 5 --json $OUT/llama-none-ckpt.json >/dev/null 2>$OUT/llama.err || tail -n 3 $OUT/llama.err
else
  echo "the Llama-7B row needs more GPU memory than this GPU has: left out"
fi
ROWS=$(for f in $OUT/small-*.json $OUT/llama-*.json; do if [ -f $f ]; then echo --from-json $f; fi; done)
echo "== uncalibrated"
"$FT" bench $ROWS --plan-check "${SMALL[@]}" --config $C/codellama-7b/config.json | tee $OUT/plan-check.txt
echo "== calibrated"
"$FT" bench $ROWS --plan-check --calibration $OUT/calibration.json \
  "${SMALL[@]}" --config $C/codellama-7b/config.json | tee $OUT/plan-check-calibrated.txt
