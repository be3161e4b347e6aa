#!/usr/bin/env bash
# The FSDP2 + torch.compile rows measured again with the repaired peer
# (`use_cache=False`, dynamo's cache past the blocks' count; see
# bench/results/2026-11-27-h100x2-fp8-peer.md), ft beside each in the same
# call, bf16 with fp32 masters, full_shard on 2 GPUs: BLOOM-560m and OPT-1.3B
# at 8 x 512 tokens per GPU, the Llama-7B shape at 2 x 2048.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
make_text
ft_run bloom-full_shard 2 bloom-560m 512 8 25 --strategy full_shard
LIMIT=${PEER_LIMIT:-130} fsdp2 2 bloom-560m --mode fsdp2 --compile
ft_run opt-full_shard 2 opt-1.3b 512 8 25 --strategy full_shard
LIMIT=${PEER_LIMIT:-130} fsdp2 2 opt-1.3b --mode fsdp2 --compile
timeout 150 "$FT" bench --config $D/configs/codellama-7b/config.json --gpus 2 --strategy full_shard --batch 2 --seq 2048 \
  --warmup 3 --steps 5 --json $OUT/ft-llama-full_shard.json > $OUT/ft-llama-full_shard.log 2>&1 || echo "FAILED ft llama"
grep -E "^\| llama" $OUT/ft-llama-full_shard.log
LIMIT=${LLAMA_PEER_LIMIT:-210} fsdp2 2 codellama-7b --mode fsdp2 --compile --batch 2 --seq 2048 --warmup 6 --steps 4
