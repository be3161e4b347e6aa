#!/usr/bin/env bash
# Checkpoint save and resume at OPT-1.3B's size on GPUS GPUs (default 1;
# random init, SQuAD prompts, bf16, fp32 masters, ddp): 8 steps saving every
# 4, then a resume that trains a second epoch. Wall time, peak host RSS (GNU
# time) and ft's own save/resume lines (GB, seconds, GB/s, time training
# was blocked); after the first run, the disk's own sequential write rate
# beside it (same directory, same size as one save, fsynced) and each save's
# write rate as a share of it.
set -euo pipefail
source "$(dirname "$0")/env.sh"
RUN=(--model .device/configs/opt-1.3b/config.json --tokenizer .device/gpt2-tokenizer.json
  --train-file .device/squad.json --train-samples $((64 * ${GPUS:-1})) --batch-size 8 --max-seq-len 512
  --nproc-per-node ${GPUS:-1} --device cuda --dtype bf16 --save-every 4 --output-dir /tmp/ckpt --report-to jsonl)

# GB/s of writing $1 bytes of random data (nothing for the filesystem to
# compress) into a fresh file in /tmp/ckpt in 64 MiB blocks, fsynced, as a save is.
disk_rate() {
  python3 - "$1" <<'PY'
import os, sys, time
size, block = int(sys.argv[1]), os.urandom(64 << 20)
path = "/tmp/ckpt/disk-rate.tmp"
start = time.perf_counter()
with open(path, "wb") as f:
    left = size
    while left > 0:
        left -= f.write(block if left >= len(block) else block[:left])
    f.flush()
    os.fsync(f.fileno())
seconds = time.perf_counter() - start
os.remove(path)
print(f"{size / seconds / 1e9:.2f}")
PY
}

for phase in "train --epochs 1" "resume --epochs 2 --resume latest"; do
  set -- $phase; name=$1; shift
  /usr/bin/time -v "$FT" train "${RUN[@]}" "$@" > $OUT/$name.log 2>&1 || tail -n 5 $OUT/$name.log
  echo "== $name"
  grep -E "checkpoint|resum|Elapsed|Maximum resident|train samples/s|steps per epoch" $OUT/$name.log | sed 's/^\s*//' | cut -c1-200
  du -sh /tmp/ckpt/checkpoints/* 2>/dev/null | tail -n 2
  if [ $name = train ]; then
    # One save: every rank's file of the newest checkpoint.
    SAVE=$(stat -c %s $(ls -d /tmp/ckpt/checkpoints/step-* | tail -n 1)/rank-*.safetensors | awk '{ s += $1 } END { print s }')
    DISK=$(disk_rate $SAVE)
    echo "disk: $(awk -v b=$SAVE 'BEGIN { printf "%.2f", b / 1e9 }') GB written and fsynced in /tmp/ckpt at $DISK GB/s"
  fi
  # ft's rate per save beside the disk's: "written in S s (R GB/s)".
  grep -oE "written in [0-9.]+ s \([0-9.]+ GB/s\)" $OUT/$name.log | grep -oE "[0-9.]+ GB/s" | while read -r rate _; do
    awk -v ft=$rate -v disk=$DISK 'BEGIN { printf "save: ft %.2f GB/s, disk %.2f GB/s: %.0f%% of the disk\n", ft, disk, 100 * ft / disk }'
  done || true  # no save line: the run failed, and its log's tail is above
done
