#!/usr/bin/env bash
# Issue 48's paths on a GPU (the CPU tests cannot reach them): a GPU libtorch
# does not see is refused; a batch too large for the GPU's memory is an error
# with the plan's explanation, not a panic; SIGTERM to a `--max-steps` run on
# the GPU saves and exits 75, and `--resume latest` continues it.
set -uo pipefail
source "$(dirname "$0")/env.sh"
run=$OUT/stops
mkdir -p $run
verdict() { # LABEL LOG EXIT EXPECTED
  local panics=$(grep -cE "panicked|stack backtrace|frame #" $2)
  echo "== $1: exit $3 (expected $4), panic lines $panics: $(grep -m1 -E "^error|internal error" $2 | cut -c1-300)"
}
"$FT" train --device cuda:7 --max-steps 2 --output-dir $run/unseen > $run/unseen.log 2>&1
verdict "--device cuda:7 on a machine with fewer GPUs" $run/unseen.log $? 1
"$FT" bench --config bench/configs/olmoe-1b-7b-8layers.json --gpus 1 --strategy ddp --batch 64 --seq 4096 --warmup 1 --steps 1 > $run/oom.log 2>&1
verdict "a batch too large for the GPU (ft bench, OLMoE shape, 64 x 4096)" $run/oom.log $? 1
"$FT" train --nproc-per-node 1 --max-steps 20000 --output-dir $run/sigterm > $run/sigterm.log 2>&1 &
pid=$!
for _ in $(seq 120); do grep -q "step 1/" $run/sigterm.log && break; sleep 1; done
sleep 20
kill -TERM $pid; wait $pid
code=$?
verdict "SIGTERM to a --max-steps 20000 run on the GPU" $run/sigterm.log $code 75
grep -m1 "stopped by SIGTERM" $run/sigterm.log
saved=$(grep -o 'after step [0-9]*' $run/sigterm.log | grep -o '[0-9]*' | head -1)
"$FT" train --nproc-per-node 1 --max-steps $(( ${saved:-0} + 5 )) --output-dir $run/sigterm --resume latest > $run/resume.log 2>&1
verdict "its --resume latest, 5 steps more" $run/resume.log $? 0
grep -m1 "resumed from" $run/resume.log
