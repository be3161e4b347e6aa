#!/usr/bin/env bash
# Llama-7B shape (CodeLlama with GPT-2's vocabulary, the tokenizer we carry),
# 1 GPU, full_shard + --offload cpu, 2 x 2048 tokens, bf16, on the one-GPU
# machine's 128 GiB host: tokens/s, the host's peak RSS (ft's summary) and
# the offload counters; then the host's memory as the kernel saw it.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
make_text
mkdir -p $D/configs/llama7b-gpt2vocab
python3 -c "import json; c = json.load(open('$D/configs/codellama-7b/config.json')); c['vocab_size'] = 50304; json.dump(c, open('$D/configs/llama7b-gpt2vocab/config.json', 'w'))"
free -g | head -2
ft_run llama7b-offload-1gpu 1 llama7b-gpt2vocab 2048 2 12 --strategy full_shard --offload cpu
grep -E "state held|offload \(rank|memory rank" $OUT/llama7b-offload-1gpu.log | sed 's/^\[rank 0\] //'
