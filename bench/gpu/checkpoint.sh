#!/usr/bin/env bash
# Checkpoint save and resume at OPT-1.3B's size on GPUS GPUs (default 1;
# random init, SQuAD prompts, bf16, fp32 masters, ddp): 8 steps saving every
# 4, then a resume that trains a second epoch. Wall time, peak host RSS (GNU
# time) and ft's own save/resume lines (GB, seconds, GB/s, time training
# was blocked).
set -euo pipefail
source "$(dirname "$0")/env.sh"
RUN=(--model .device/configs/opt-1.3b/config.json --tokenizer .device/gpt2-tokenizer.json
  --train-file .device/squad.json --train-samples $((64 * ${GPUS:-1})) --batch-size 8 --max-seq-len 512
  --nproc-per-node ${GPUS:-1} --device cuda --dtype bf16 --save-every 4 --output-dir /tmp/ckpt --report-to jsonl)
for phase in "train --epochs 1" "resume --epochs 2 --resume latest"; do
  set -- $phase; name=$1; shift
  /usr/bin/time -v "$FT" train "${RUN[@]}" "$@" > $OUT/$name.log 2>&1 || tail -n 5 $OUT/$name.log
  echo "== $name"
  grep -E "checkpoint|resum|Elapsed|Maximum resident|train samples/s|steps per epoch" $OUT/$name.log | sed 's/^\s*//' | cut -c1-200
  du -sh /tmp/ckpt/checkpoints/* 2>/dev/null | tail -n 2
done
