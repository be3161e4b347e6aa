#!/usr/bin/env bash
# Sharded training side by side (one call), bf16, 8 x 512 tokens per GPU:
# BLOOM-560m — ft on 1 GPU, ft ddp / shard_grad_op on 2, torch DDP, FSDP2
# eager (reshard and not) and compiled; OPT-1.3B — ft full_shard on 1 and 2
# GPUs, FSDP2 eager and compiled on 2. (ft full_shard on BLOOM and DeepSpeed
# ZeRO-2/3 are in offload.sh's call.)
set -uo pipefail
source "$(dirname "$0")/lib.sh"
make_text
ft_run bloom-1gpu 1 bloom-560m 512 8 25 --strategy ddp
ft_run bloom-ddp 2 bloom-560m 512 8 25 --strategy ddp
ft_run bloom-zero2 2 bloom-560m 512 8 25 --strategy shard_grad_op
fsdp2 2 bloom-560m --mode ddp
fsdp2 2 bloom-560m --mode fsdp2
fsdp2 2 bloom-560m --mode fsdp2 --no-reshard
fsdp2 2 bloom-560m --mode fsdp2 --compile
ft_run opt-zero3-1gpu 1 opt-1.3b 512 8 25 --strategy full_shard
ft_run opt-zero3 2 opt-1.3b 512 8 25 --strategy full_shard
fsdp2 2 opt-1.3b --mode fsdp2
fsdp2 2 opt-1.3b --mode fsdp2 --compile
