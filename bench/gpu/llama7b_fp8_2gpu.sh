#!/usr/bin/env bash
# Llama-7B (CodeLlama-7B shape), full_shard on 2 GPUs, 2 x 2048 tokens per GPU,
# random weights, in one call: `ft bench --fp8 tensorwise` and bf16 at 1 and 2
# GPUs, and PyTorch FSDP2 + torch.compile + torchao float8 with float8
# all-gathers (torchtitan's recipe; torchao's wheel carried in .whl). The
# 1-GPU rows need an H200's memory.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
CONFIG=$D/configs/codellama-7b/config.json
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/torchao-*.whl \
  || { echo "FAILED torchao install"; exit 1; }
for fp8 in off tensorwise; do
  timeout ${FT_LIMIT:-280} "$FT" bench --config $CONFIG --gpus 1,2 --strategy full_shard --batch 2 --seq 2048 --warmup 3 --steps 5 \
    --fp8 $fp8 --json $OUT/ft-$fp8.json > $OUT/ft-$fp8.log 2>&1 || echo "FAILED ft --fp8 $fp8"
  grep -E "^\| llama" $OUT/ft-$fp8.log
done
export PYTHONPATH=/tmp/site
LIMIT=${LIMIT:-420} fsdp2 2 codellama-7b --mode fsdp2 --compile --float8 tensorwise --batch 2 --seq 2048 --warmup 8 --steps 6
