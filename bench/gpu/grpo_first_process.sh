#!/usr/bin/env bash
# Why the first GRPO process on a fresh GPU machine samples slower at steps
# 2 and 4 (issue 50): the 1.5B row (grpo_1gpu.sh's ft-1.5b, 6 steps) run
# twice in a row, the GPU's clocks, power, temperature and memory logged
# every 100 ms beside them (nvidia-smi), each step's wall-clock end in the
# metrics. RUNS names the runs in order (default: first second); a run
# named nocache compiles ft's kernels in its own process, its cache off
# (FT_KERNEL_CACHE empty), as the machine's first process does.
# A run named nojitcache turns the CUDA driver's cache of the machine code
# it compiles from PTX off (CUDA_CACHE_DISABLE=1).
# PREREAD=1 reads PyTorch's and the CUDA libraries' files once before the
# first run (into the page cache). OUT gets each run's metrics and smi.csv.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
make_grpo_prompts
if [ "${PREREAD:-}" = 1 ]; then
  date +"== reading the libraries %s.%N"
  cat "$SITE"/torch/lib/*.so* "$SITE"/nvidia/*/lib/*.so* > /dev/null
  date +"== read %s.%N"
fi
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,memory.used,clocks_event_reasons.active \
  --format=csv,noheader,nounits -lms 100 > $OUT/smi.csv &
smi=$!
for name in ${RUNS:-first second}; do
  date +"== $name starts %s.%N"
  cache=("FT_KERNEL_CACHE=${FT_KERNEL_CACHE-$HOME/.cache/ft/kernels}")
  [ $name != nocache ] || cache=(FT_KERNEL_CACHE=)
  [ $name != nojitcache ] || cache+=(CUDA_CACHE_DISABLE=1)
  env "${cache[@]}" timeout ${LIMIT:-200} "$FT" train --task grpo --model bench/configs/qwen2.5-1.5b.json --tokenizer $D/gpt2-tokenizer.json \
    --train-file /tmp/prompts.jsonl --reward /tmp/reward.py:ids_reward --batch-size 8 --grad-accum 4 --max-steps 6 --dtype bf16 \
    --lr 1e-6 --max-seq-len 640 --set task.num_generations=8 --set task.max_completion_length=512 --set data.shuffle=false \
    --set train.log_every=1 --report-to jsonl --output-dir $OUT/$name > $OUT/$name.log 2>&1 || { echo "FAILED $name"; tail -5 $OUT/$name.log; }
  date +"== $name ends %s.%N"
  python3 - $OUT/$name <<'PY'
import json, sys
for l in open(f"{sys.argv[1]}/metrics.jsonl"):
    r = json.loads(l)
    if "step_seconds" in r:
        print(r["step"], round(r["step_seconds"], 3), round(r.get("rollout/seconds", 0), 3), {k: r[k] for k in r if "time" in k or "memory" in k})
PY
  rm -rf $OUT/$name/final $OUT/$name/checkpoints $OUT/$name/base-model
done
kill $smi
