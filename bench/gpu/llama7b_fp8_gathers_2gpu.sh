#!/usr/bin/env bash
# Llama-7B (CodeLlama-7B shape), full_shard on 2 GPUs, 2 x 2048 tokens per GPU,
# random weights, `--fp8 tensorwise` with float8 gathers (`--fp8-gathers true`)
# and with bf16 gathers (`--fp8-gathers false`, the default), in one call.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
CONFIG=$D/configs/codellama-7b/config.json
for gathers in true false; do
  timeout ${FT_LIMIT:-170} "$FT" bench --config $CONFIG --gpus 2 --strategy full_shard --batch 2 --seq 2048 --warmup 3 --steps 5 \
    --fp8 tensorwise --fp8-gathers $gathers --json $OUT/ft-fp8-gathers-$gathers.json > $OUT/ft-fp8-gathers-$gathers.log 2>&1 \
    || { echo "FAILED ft --fp8-gathers $gathers"; tail -20 $OUT/ft-fp8-gathers-$gathers.log; }
  grep -E "^\| llama|comm|gather" $OUT/ft-fp8-gathers-$gathers.log | head -8
done
