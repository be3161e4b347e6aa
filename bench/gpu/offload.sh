#!/usr/bin/env bash
# CPU offload side by side (one call): BLOOM-560m, 2 GPUs, full_shard/ZeRO-3,
# 8 x 512 tokens per GPU, bf16 — ft with and without --offload cpu, PyTorch
# FSDP2 with CPUOffloadPolicy, DeepSpeed ZeRO-3 with offload_optimizer (and
# ZeRO-2/3 without, for the performance issue); then Llama-7B shape
# (CodeLlama with GPT-2's vocabulary, the tokenizer we carry) full_shard +
# offload on 1 GPU. Peers run 10 timed steps after 3 (offloaded: 6 after 2).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
make_text
ft_run bloom-zero3-offload 2 bloom-560m 512 8 25 --strategy full_shard --offload cpu
ft_run bloom-zero3 2 bloom-560m 512 8 25 --strategy full_shard
fsdp2 2 bloom-560m --mode fsdp2 --offload --steps 6 --warmup 2
install_deepspeed
deepspeed_peer 2 bloom-560m --stage 3 --offload --steps 6 --warmup 2
deepspeed_peer 2 bloom-560m --stage 3
deepspeed_peer 2 bloom-560m --stage 2
if [ "${LLAMA7B:-1}" = 1 ]; then
  mkdir -p $D/configs/llama7b-gpt2vocab
  python3 -c "import json; c = json.load(open('$D/configs/codellama-7b/config.json')); c['vocab_size'] = 50304; json.dump(c, open('$D/configs/llama7b-gpt2vocab/config.json', 'w'))"
  ft_run llama7b-offload-1gpu 1 llama7b-gpt2vocab 2048 2 8 --strategy full_shard --offload cpu
fi
