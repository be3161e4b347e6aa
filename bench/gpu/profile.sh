#!/usr/bin/env bash
# Where ft's step goes (one call, nvidia-h200-x2): `ft bench --breakdown
# --profile` on BLOOM-560m (1 GPU; 2 GPUs full_shard and shard_grad_op),
# OPT-1.3B full_shard on 1 and 2 GPUs, Llama-7B full_shard on 2 GPUs, and
# the compiled single-GPU peer beside them. Kernel tables and Chrome traces
# land in $OUT/profile.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
P=$OUT/profile
bench() { timeout ${LIMIT:-150} "$FT" bench --profile $P "$@" 2>&1 | grep -vE "^\[rank [1-9]|DeviceProperties" | tail -45; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
bench --config $D/configs/bloom-560m/config.json --gpus 1 --strategy ddp --breakdown --json $OUT/bloom-1gpu.json
bench --config $D/configs/bloom-560m/config.json --gpus 2 --strategy full_shard,shard_grad_op --json $OUT/bloom-2gpu.json
timeout 240 python3 bench/peers/hf_train_step.py --config $D/configs/bloom-560m/config.json --batch 8 --seq 512 --compile 2>&1 | grep -E '^\{|Error' | tail -3
bench --config $D/configs/opt-1.3b/config.json --gpus 1,2 --strategy full_shard --json $OUT/opt.json
LIMIT=200 bench --config $D/configs/codellama-7b/config.json --gpus 2 --strategy full_shard --batch 2 --seq 2048 --warmup 3 --steps 6 --json $OUT/llama.json
