#!/usr/bin/env bash
# BLOOM-560m and OPT-1.3B on 1 and 2 GPUs (full_shard), 8 x 512 tokens per GPU,
# random weights: `ft bench` in bf16 and with `--fp8 tensorwise` at its default
# layer choice (`train.fp8_layers=auto`: a layer runs in float8 where its weight
# has at least 4096 x 4096 elements; float8 gathers where a block qualifies), in
# one call. The issue's row: float8 never slower than ft's bf16.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
for model in bloom-560m opt-1.3b; do
  for fp8 in off tensorwise; do
    timeout ${FT_LIMIT:-150} "$FT" bench --config $D/configs/$model/config.json --gpus 1,2 --strategy full_shard --batch 8 --seq 512 \
      --warmup 5 --steps 20 --fp8 $fp8 --json $OUT/$model-$fp8.json > $OUT/$model-$fp8.log 2>&1 || echo "FAILED $model --fp8 $fp8"
    grep -E "^\| (bloom|opt)" $OUT/$model-$fp8.log | sed "s/^/$fp8 /"
    grep -E "stay in the compute dtype|gathered as float8" $OUT/$model-$fp8.log | grep -v "rank 1" | head -2
  done
done
