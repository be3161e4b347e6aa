#!/usr/bin/env bash
# Every strategy (and the example plug-in) trains BLOOM-560m shape with
# `ft train` on 1 and 2 GPUs (bf16, SQuAD, 8 x <=512 tokens per GPU), and
# reports tokens/s, peak CUDA memory and the state each rank holds.
set -uo pipefail
source "$(dirname "$0")/env.sh"
D=.device
COMMON=(--plugin $D/libft_plugin_ddp_bf16_grads.so train --model $D/configs/bloom-560m/config.json
  --tokenizer $D/gpt2-tokenizer.json --train-file $D/squad.json --max-seq-len 512 --epochs 1
  --lr 5e-5 --dtype bf16 --batch-size 8 --eval-samples 0)
for gpus in 2 1; do
  steps=$([ $gpus = 2 ] && echo 20 || echo 10)
  for strategy in ddp zero1 shard_grad_op full_shard hybrid_shard ddp_bf16_grads; do
    run=$OUT/$strategy-$gpus
    "$FT" "${COMMON[@]}" --strategy $strategy --nproc-per-node $gpus --train-samples $((8 * gpus * steps)) \
      --output-dir $run > $run.log 2>&1 || { echo "FAILED $strategy on $gpus GPU(s)"; tail -20 $run.log; }
  done
done
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
print(f"| strategy | GPUs | steps | tokens/s/GPU | peak alloc GB/GPU | params MB | grads MB | optimizer MB | gathered peak MB | final loss |")
print("|---|---|---|---|---|---|---|---|---|---|")
for gpus in (1, 2):
    for s in ("ddp", "zero1", "shard_grad_op", "full_shard", "hybrid_shard", "ddp_bf16_grads"):
        path = f"{out}/{s}-{gpus}/summary.json"
        if not os.path.exists(path):
            print(f"| {s} | {gpus} | failed |"); continue
        j = json.load(open(path))
        m, h = j["memory_per_rank"][0], j["state_per_rank"][0]
        print(f"| {s} | {gpus} | {j['optimizer_steps']} | {j['train_tokens_per_s']/gpus:.0f} | {m['peak']/1e9:.2f} | "
              f"{h['params']/1e6:.0f} | {h['grads']/1e6:.0f} | {h['optimizer_state']/1e6:.0f} | {h['gathered_peak']/1e6:.0f} | {j['final_train_loss']:.4f} |")
PY
for d in $OUT/*-[12]; do tar czf $d.tgz -C $OUT $(basename $d)/summary.json $(basename $d)/metrics.jsonl 2>/dev/null; rm -rf $d; done
cat $OUT/*.log > $OUT/all.log; rm -f $OUT/*-[12].log
tar czf $OUT/summaries.tgz -C $OUT $(cd $OUT && ls *.tgz | grep -v summaries) && rm -f $(ls $OUT/*-[12].tgz)
