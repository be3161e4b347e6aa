#!/usr/bin/env bash
# The communication seam and the cpu_offload crate against the build before
# them, in one call on one GPU: BLOOM-560m 8 x 512 (`ft bench`, the built-in
# collectives) and the Llama-7B shape with full_shard + --offload cpu
# (2 x 2048, `ft train`), each with both binaries, interleaved.
# Carry .device/ with ft (this build), ft-before (commit 922cd91's), configs.
# `seam_overhead.sh bloom` or `seam_overhead.sh offload` runs one half.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
CONFIG=$D/configs/bloom-560m/config.json
[ "${1:-all}" = offload ] || for repeat in 1 2; do
  for build in ft-before ft; do
    FT=$D/$build "$D/$build" bench --config $CONFIG --gpus 1 --strategy ddp --batch 8 --seq 512 --warmup 5 --steps 30 \
      --json $OUT/bloom-$build-$repeat.json 2>&1 | grep -E "tokens/s/GPU" | grep -v "^|" | sed "s/^/$build: /" | tail -1
  done
done
[ "${1:-all}" = bloom ] && exit 0
make_text
mkdir -p $D/configs/llama7b-gpt2vocab
python3 -c "import json; c = json.load(open('$D/configs/codellama-7b/config.json')); c['vocab_size'] = 50304; json.dump(c, open('$D/configs/llama7b-gpt2vocab/config.json', 'w'))"
for build in ft-before ft; do
  FT=$D/$build ft_run llama7b-offload-$build 1 llama7b-gpt2vocab 2048 2 12 --strategy full_shard --offload cpu
done
