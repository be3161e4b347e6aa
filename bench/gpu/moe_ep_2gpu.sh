#!/usr/bin/env bash
# Expert parallelism on TWO GPUs of one host (issue 49): full fine-tune, bf16
# compute over fp32 masters, 2 x 2048 tokens per GPU, random weights, the
# experts' all-to-all over NCCL.
#  1. check: 2 ranks at --expert-parallel 2 against 2 ranks holding every
#     expert (ddp), same seeds and batches: the last step's loss (bf16).
#  2. rows: OLMoE-1B-7B (8 of 16 layers) and Qwen3-30B-A3B (8 of 48 layers) on
#     1 GPU, and on 2 GPUs with every expert on each (ddp) and split in two
#     (ddp and full_shard + --expert-parallel 2): tokens/s per GPU, the
#     scaling from 1 GPU, peak memory.
# Env: FT (default .device/ft), ROWS, VARIANTS ("GPUS STRATEGY DEGREE", …;
# default the four above; e.g. "4 ddp 4" on four GPUs), PROFILE=1 (each
# row's kernel table and trace under $OUT/profile: `ft bench --profile`).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
python3 -c 'import torch; print("== GPUs:", torch.cuda.device_count(), "x", torch.cuda.get_device_name(0), "torch", torch.__version__)'
for row in ${ROWS:-olmoe-1b-7b-8layers qwen3-30b-a3b-8layers}; do
  CONFIG=bench/configs/$row.json
  IFS=, read -ra variants <<< "${VARIANTS:-1 ddp 1,2 ddp 1,2 ddp 2,2 full_shard 2}"
  for variant in "${variants[@]}"; do
    set -- $variant
    name=$row-gpus$1-$2-ep$3
    "$FT" bench --config $CONFIG --gpus $1 --strategy $2 --expert-parallel $3 --batch 2 --seq 2048 --warmup 3 --steps 6 \
      ${PROFILE:+--profile $OUT/profile} --json $OUT/$name.json > $OUT/$name.log 2>&1 \
      && summary "$row, $1 GPU(s), $2, expert parallel $3" $OUT/$name.json \
      || { echo "== $name: FAILED"; grep -vE "^\[rank" $OUT/$name.log | tail -6; }
  done
done
