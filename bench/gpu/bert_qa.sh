#!/usr/bin/env bash
# Extractive QA's training step on one GPU, BERT-base shape (random weights):
# `ft bench` beside transformers' BertForQuestionAnswering under
# torch.compile (and eager with EAGER=1), in one call, interleaved twice: bf16 (autocast for the
# peers, fp32 masters for ft), batch 32 x 384, AdamW, clipping 1.0.
set -euo pipefail
source "$(dirname "$0")/env.sh"
python3 -c "from transformers import BertConfig; BertConfig(architectures=['BertForQuestionAnswering']).to_json_file('/tmp/bert-base.json')"
BENCH=(--batch 32 --seq 384 --warmup 5 --steps 20)
"$FT" bench --config /tmp/bert-base.json "${BENCH[@]}" --breakdown --profile $OUT/bert-profile --json $OUT/ft-bert-breakdown.json 2>&1 | tail -n 30
for run in 1 2; do
  "$FT" bench --config /tmp/bert-base.json "${BENCH[@]}" --json $OUT/ft-bert-$run.json
  if [ "${EAGER:-0}" = 1 ]; then python3 bench/peers/hf_bert_qa_step.py "${BENCH[@]}" --json $OUT/hf-eager-$run.json; fi
  python3 bench/peers/hf_bert_qa_step.py "${BENCH[@]}" --compile --json $OUT/hf-compiled-$run.json 2>&1 | tail -n 1
done
