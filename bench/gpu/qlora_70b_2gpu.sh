#!/usr/bin/env bash
# QLoRA on the Llama-2-70B shape (bench/configs/llama-2-70b.json), 2 GPUs,
# full_shard, LoRA r=16 alpha=32 on every linear layer of the blocks, one
# sequence of 2048 tokens per GPU, activation checkpointing: `ft bench
# --quantize nf4` with random weights quantized unit by unit as they are made
# (a 70B checkpoint does not fit the GPU machine's disk), without and with
# --offload cpu. tokens/s/GPU, peak per GPU, held state and host peak.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
CONFIG=bench/configs/llama-2-70b.json
for offload in none cpu; do
  # The host peak: the largest resident set of the launcher's worker processes, sampled each second.
  ( while sleep 1; do ps -C ft -o rss= | sort -n | tail -1; done ) > $OUT/rss-$offload.txt 2>/dev/null &
  sampler=$!
  "$FT" bench --config $CONFIG --gpus 2 --strategy full_shard --offload $offload \
    --batch 1 --seq 2048 --activation-checkpointing --lora-r 16 --lora-alpha 32 --lora-targets q,k,v,o,gate,up,down \
    --quantize nf4 --warmup 2 --steps 4 --json $OUT/ft-qlora-70b-$offload.json 2>&1 | grep -vE "^\[rank" | tail -4
  kill $sampler
  echo "host peak of one ft process: $(sort -n $OUT/rss-$offload.txt | tail -1) KB"
done
