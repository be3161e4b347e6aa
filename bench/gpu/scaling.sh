#!/usr/bin/env bash
# The scaling run, cut to what one short call on the largest lent machine
# allows (nvidia-h200-x4 here): ft comm-test beside torch.distributed on all
# GPUs (1 MiB - 1 GiB), then OPT-1.3B full_shard on 1, 2 and 4 GPUs and
# hybrid_shard (2 x 2) on 4 with `ft bench`, beside FSDP2 eager on 4.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
NPROC="${NPROC:-$(nvidia-smi -L | wc -l)}"
SWEEP=(--min-bytes 1M --max-bytes 1G --factor 8 --dtype f32 --warmup 3 --iters 10)
"$FT" launch --nproc-per-node "$NPROC" -- comm-test --backend nccl "${SWEEP[@]}" --json "$OUT/ft-comm.json" > $OUT/ft-comm.log 2>&1
torchrun --nproc-per-node "$NPROC" bench/peers/comm_bench.py "${SWEEP[@]}" --json "$OUT/torch-comm.json" > $OUT/torch-comm.log 2>&1
python3 bench/peers/compare_comm.py "$OUT/ft-comm.json" "$OUT/torch-comm.json" | tee "$OUT/comm.md" | tail -12
"$FT" bench --config $D/configs/opt-1.3b/config.json --gpus 1,2,$NPROC --strategy full_shard --batch 8 --seq 512 \
  --warmup 3 --steps 10 --json $OUT/ft-opt.json 2>&1 | grep -vE "^\[rank" | tail -8
"$FT" bench --config $D/configs/opt-1.3b/config.json --gpus $NPROC --strategy hybrid_shard --shard-group-size 2 \
  --batch 8 --seq 512 --warmup 3 --steps 10 --json $OUT/ft-opt-hybrid.json 2>&1 | grep -vE "^\[rank" | tail -3
fsdp2 $NPROC opt-1.3b --mode fsdp2 --batch 8 --seq 512 --warmup 3 --steps 10 | tee $OUT/fsdp2-opt.json
