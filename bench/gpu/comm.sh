#!/usr/bin/env bash
# ft comm-test beside torch.distributed on this machine's GPUs, twice each,
# interleaved; then a Markdown comparison. Writes into $OUT.
set -euo pipefail
source "$(dirname "$0")/env.sh"
NPROC="${NPROC:-$(nvidia-smi -L | wc -l)}"
SWEEP=(--min-bytes 1M --max-bytes 1G --factor 4 --dtype f32 --warmup 5 --iters 20)
nvidia-smi -L
# Correctness over NCCL first: every collective and reduction, f32 and bf16, world and sub-groups.
"$FT" launch --nproc-per-node "$NPROC" -- comm-test --backend nccl --min-bytes 64K --max-bytes 4M \
  --factor 8 --dtype f32,bf16 --warmup 1 --iters 2 --group-size 1 --json "$OUT/ft-check.json" | tail -n 3
for run in 1 2; do
  "$FT" launch --nproc-per-node "$NPROC" -- comm-test --backend nccl "${SWEEP[@]}" --json "$OUT/ft-$run.json"
  torchrun --nproc-per-node "$NPROC" bench/peers/comm_bench.py "${SWEEP[@]}" --json "$OUT/torch-$run.json"
done
python3 bench/peers/compare_comm.py "$OUT/ft-1.json" "$OUT/torch-1.json" "$OUT/ft-2.json" "$OUT/torch-2.json" | tee "$OUT/comm.md"
