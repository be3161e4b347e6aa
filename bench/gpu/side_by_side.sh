#!/usr/bin/env bash
# The performance issue's table, ft and its peers in the same call on
# nvidia-h200-x2, bf16, random weights of the real shapes, AdamW, clipping 1.0.
#   bash bench/gpu/side_by_side.sh bloom   # 1 GPU vs transformers eager/compiled; 2 GPUs vs DDP, FSDP2 eager/compiled
#   bash bench/gpu/side_by_side.sh zero    # BLOOM vs DeepSpeed ZeRO-2/3; OPT-1.3B vs FSDP2 eager/compiled
#   bash bench/gpu/side_by_side.sh llama   # Llama-7B (CodeLlama shape) 2 x 2048 vs FSDP2 compiled
# ft: `ft bench` (median-free mean of 20 timed steps after 5); peers: mean of 10 after 3.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
cfg() { echo $D/configs/$1/config.json; }
bench() { timeout ${LIMIT:-200} "$FT" bench "$@" 2>&1 | grep -vE "^\[rank|DeviceProperties" | tail -14; }
peer() { timeout ${LIMIT:-200} "$@" 2>&1 | grep -E '^\{|tokens/s|Error' | tail -2; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
case "${1:?bloom, zero or llama}" in
  bloom)
    bench --config $(cfg bloom-560m) --gpus 1 --strategy ddp --json $OUT/ft-bloom-1gpu.json
    bench --config $(cfg bloom-560m) --gpus 2 --strategy ddp,full_shard,shard_grad_op --json $OUT/ft-bloom-2gpu.json
    peer python3 bench/peers/hf_train_step.py --config $(cfg bloom-560m) --compile
    peer python3 bench/peers/hf_train_step.py --config $(cfg bloom-560m)
    peer torchrun --nproc-per-node 2 bench/peers/fsdp2_train_step.py --config $(cfg bloom-560m) --mode ddp
    peer torchrun --nproc-per-node 2 bench/peers/fsdp2_train_step.py --config $(cfg bloom-560m) --mode fsdp2
    peer torchrun --nproc-per-node 2 bench/peers/fsdp2_train_step.py --config $(cfg bloom-560m) --mode fsdp2 --compile
    peer torchrun --nproc-per-node 2 bench/peers/fsdp2_train_step.py --config $(cfg bloom-560m) --mode fsdp2 --no-reshard --compile
    ;;
  zero)
    install_deepspeed
    peer torchrun --nproc-per-node 2 bench/peers/deepspeed_train_step.py --config $(cfg bloom-560m) --stage 2
    peer torchrun --nproc-per-node 2 bench/peers/deepspeed_train_step.py --config $(cfg bloom-560m) --stage 3
    bench --config $(cfg opt-1.3b) --gpus 1,2 --strategy full_shard --json $OUT/ft-opt.json
    peer torchrun --nproc-per-node 2 bench/peers/fsdp2_train_step.py --config $(cfg opt-1.3b) --mode fsdp2
    peer torchrun --nproc-per-node 2 bench/peers/fsdp2_train_step.py --config $(cfg opt-1.3b) --mode fsdp2 --compile
    ;;
  llama)
    LIMIT=240 bench --config $(cfg codellama-7b) --gpus 2 --strategy full_shard --batch 2 --seq 2048 --warmup 3 --steps 8 --json $OUT/ft-llama.json
    LIMIT=300 peer torchrun --nproc-per-node 2 bench/peers/fsdp2_train_step.py --config $(cfg codellama-7b) --mode fsdp2 --compile --batch 2 --seq 2048 --warmup 2 --steps 6
    ;;
esac
