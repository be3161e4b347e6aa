#!/usr/bin/env bash
# Qwen3-30B-A3B whole (48 layers, 30.5B parameters, 3.3B active) on FOUR
# GPUs of one host (issue 49's fifth row): full fine-tune, random weights,
# 2 x 2048 tokens per GPU, bf16 compute over fp32 masters.
#  1. `ft plan` for the shape: every strategy x expert-parallel degree,
#     predicted peak and step time; its recommendation.
#  2. `ft bench` with the plan's pick (PICK, default "shard_grad_op 4 off":
#     strategy, expert-parallel degree, activation checkpointing) and the
#     next row that leaves more room (full_shard, degree 4, checkpointing).
#  3. the peer in the same call: FSDP2 + transformers + torch.compile,
#     fp32 weights under bf16 mixed precision, fused AdamW; at 2 x 2048 with
#     gradient checkpointing (without, it holds every layer's activations
#     beside 122 GB of state a GPU), then 1 x 2048 where that does not fit.
# Env: FT (default .device/ft), LIMIT (seconds per peer run, default 420),
# SKIP_PEER=1.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
CONFIG=bench/configs/qwen3-30b-a3b.json
python3 -c 'import torch; print("== GPUs:", torch.cuda.device_count(), "x", torch.cuda.get_device_name(0), "torch", torch.__version__)'
"$FT" plan --model $CONFIG --gpus 4 --batch 2 --seq 2048 > $OUT/plan.txt 2>&1 || echo "== ft plan FAILED"
grep -E "^recommended|ep4 " $OUT/plan.txt
read -r strategy degree checkpointing <<< "${PICK:-shard_grad_op 4 off}"
for row in "$strategy $degree $checkpointing" "full_shard 4 on"; do
  set -- $row
  name=ft-$1-ep$2-ckpt-$3
  "$FT" bench --config $CONFIG --gpus 4 --strategy $1 --expert-parallel $2 $([ "$3" = on ] && echo --activation-checkpointing) \
    --batch 2 --seq 2048 --warmup 3 --steps 6 --json $OUT/$name.json > $OUT/$name.log 2>&1 \
    && summary "ft, $1, expert parallel $2, activation checkpointing $3" $OUT/$name.json \
    || { echo "== $name: FAILED"; grep -vE "^\[rank [1-9]" $OUT/$name.log | tail -4; }
done
[ -n "${SKIP_PEER:-}" ] && exit 0
peer() { timeout ${LIMIT:-420} torchrun --nproc-per-node 4 bench/peers/fsdp2_train_step.py --config $CONFIG --compile --checkpointing --warmup 2 --steps 5 "$@" 2>&1 | grep -E '^\{|Error' | tail -2; }
out=$(peer --batch 2 --seq 2048); echo "== peer 2x2048: $out"
echo "$out" | grep -q '^{' || { out=$(peer --batch 1 --seq 2048); echo "== peer 1x2048: $out"; }
