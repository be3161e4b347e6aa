#!/usr/bin/env bash
# Qwen3-30B-A3B whole (48 layers, 30.5B parameters, 3.3B active) on FOUR
# GPUs of one host (issue 49's fifth row): full fine-tune, random weights,
# 2 x 2048 tokens per GPU, bf16 compute over fp32 masters.
#  1. `ft plan` for the shape: every strategy x expert-parallel degree,
#     predicted peak and step time; its recommendation.
#  2. `ft bench` for each of ROWS ("strategy degree checkpointing", ';'
#     between rows; checkpointing: off, on, or N = the first N blocks
#     recomputed, --checkpoint-layers), each stopped after RUN_LIMIT seconds
#     (default 170: a run near the memory's edge can stall in NCCL rather
#     than fail).
#  3. the peer in the same call: FSDP2 + transformers + torch.compile,
#     fp32 weights under bf16 mixed precision, fused AdamW; at 2 x 2048 with
#     gradient checkpointing (without, it holds every layer's activations
#     beside 122 GB of state a GPU), then 1 x 2048 where that does not fit.
# Env: FT (default .device/ft), ROWS (default "full_shard 4 on"), RUN_LIMIT,
# LIMIT (seconds per peer run, default 420), SKIP_PEER=1.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
CONFIG=bench/configs/qwen3-30b-a3b.json
python3 -c 'import torch; print("== GPUs:", torch.cuda.device_count(), "x", torch.cuda.get_device_name(0), "torch", torch.__version__)'
"$FT" plan --model $CONFIG --gpus 4 --batch 2 --seq 2048 > $OUT/plan.txt 2>&1 || echo "== ft plan FAILED"
grep -E "^recommended|ep4 " $OUT/plan.txt
IFS=';' read -ra rows <<< "${ROWS:-full_shard 4 on}"
for row in "${rows[@]}"; do
  set -- $row
  case $3 in
    on) checkpointing=--activation-checkpointing ;;
    off) checkpointing= ;;
    *) checkpointing="--activation-checkpointing --checkpoint-layers $3" ;;
  esac
  name=ft-$1-ep$2-ckpt-$3
  timeout ${RUN_LIMIT:-170} "$FT" bench --config $CONFIG --gpus 4 --strategy $1 --expert-parallel $2 $checkpointing \
    --batch 2 --seq 2048 --warmup 3 --steps 6 --json $OUT/$name.json > $OUT/$name.log 2>&1 \
    && summary "ft, $1, expert parallel $2, activation checkpointing $3" $OUT/$name.json \
    || { echo "== $name: FAILED or stopped"; grep -vE "^\[rank [1-9]" $OUT/$name.log | tail -4; }
done
[ -n "${SKIP_PEER:-}" ] && exit 0
peer() { timeout ${LIMIT:-420} torchrun --nproc-per-node 4 bench/peers/fsdp2_train_step.py --config $CONFIG --compile --checkpointing --warmup 2 --steps 5 "$@" 2>&1 | grep -E '^\{|Error' | tail -2; }
out=$(peer --batch 2 --seq 2048); echo "== peer 2x2048: $out"
echo "$out" | grep -q '^{' || { out=$(peer --batch 1 --seq 2048); echo "== peer 1x2048: $out"; }
