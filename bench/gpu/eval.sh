#!/usr/bin/env bash
# Generation-based evaluation on one GPU, BLOOM-560m shape (random weights),
# SQuAD prompts, greedy 16 new tokens, bf16: `ft eval` (decoding steps
# replayed as a CUDA graph, and once with task.cuda_graph=false) beside
# transformers' `generate` (left padding, KV cache) at the same batch sizes,
# prompts sorted by length on both sides; examples/s of the scoring alone,
# twice each. The graph's predictions must equal the step-by-step ones.
set -euo pipefail
source "$(dirname "$0")/env.sh"
"$FT" init-model --config .device/configs/bloom-560m/config.json --out /tmp/bloom --tokenizer .device/gpt2-tokenizer.json >/dev/null
ft_eval() {  # NAME BATCH SAMPLES [env…]
  local name=$1 batch=$2 samples=$3; shift 3
  env FT_TASK__MAX_NEW_TOKENS=16 "$@" "$FT" eval --model /tmp/bloom --eval-file .device/squad.json --eval-samples $samples \
    --batch-size $batch --max-seq-len 512 --output-dir /tmp/ft-eval-$name > $OUT/$name.log 2>&1 || tail -n 5 $OUT/$name.log
  grep -E "^scored|CUDA graph|error" $OUT/$name.log | sed "s/^/$name: /"
}
for run in "1 ${B1_SAMPLES:-128}" "32 512" "64 512"; do
  set -- $run
  for repeat in 1 2; do
    ft_eval ft-b$1-graph-$repeat $1 $2
    python3 bench/peers/hf_generate.py --model /tmp/bloom --tokenizer .device/gpt2-tokenizer.json --squad .device/squad.json \
      --samples $2 --batch $1 --max-new-tokens 16 --json $OUT/hf-generate-b$1-$repeat.json 2>&1 | tail -n 1
  done
  ft_eval ft-b$1-eager $1 $2 FT_TASK__CUDA_GRAPH=false
  cmp -s /tmp/ft-eval-ft-b$1-eager/predictions.json /tmp/ft-eval-ft-b$1-graph-1/predictions.json \
    && echo "batch $1: graph predictions equal step-by-step" || echo "batch $1: graph predictions DIFFER from step-by-step"
done
