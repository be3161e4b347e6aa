#!/usr/bin/env bash
# Llama-7B (CodeLlama-7B shape), 2 GPUs, full_shard, 2 x 2048 tokens per GPU,
# bf16: `ft bench` beside PyTorch FSDP2 eager and compiled, in one call
# (EAGER=0 skips the eager peer).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
"$FT" bench --config $D/configs/codellama-7b/config.json --gpus 2 \
  --strategy full_shard --batch 2 --seq 2048 --warmup 3 --steps 8 --json $OUT/ft-llama7b.json 2>&1 | grep -vE "^\[rank" | tail -6
[ "${EAGER:-1}" = 1 ] && fsdp2 2 codellama-7b --mode fsdp2 --batch 2 --seq 2048 --warmup 2 --steps 6
fsdp2 2 codellama-7b --mode fsdp2 --compile --batch 2 --seq 2048 --warmup 2 --steps 6
