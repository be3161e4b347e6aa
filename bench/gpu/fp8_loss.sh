#!/usr/bin/env bash
# Float8 against bf16 on real text from the same start (issue 35's loss row):
# a Llama of about 1B parameters (hidden 2048, 16 layers, GPT-2's
# tokenizer), random weights from seed 1, 300 steps of 8 x 1024 packed
# tokens, trained twice with the same data order: `--dtype bf16` and
# `--fp8 tensorwise` with every block layer in float8. Prints the
# final losses (mean of the last 20 steps) and writes both curves to
# $OUT/fp8-loss.png and $OUT/fp8-loss.json. Then BLOOM-560m and OPT-1.3B:
# `ft calibrate --fp8` (float8 against bf16 per layer shape) and their steps in
# bf16 and float8 (`ft bench`, one GPU, its default choice of float8 layers).
set -uo pipefail
source "$(dirname "$0")/env.sh"
D=.device
# Real text that 300 steps do not repeat: the Python sources of the GPU
# machine's transformers package (code, comments, docstrings), a line an
# example, packed; the first 14 million characters in file order (about
# 3.5M tokens, of which the run reads 2.5M).
python3 - > /tmp/text.txt <<'PY'
import glob, os, transformers
root, total = os.path.dirname(transformers.__file__), 0
for path in sorted(glob.glob(f"{root}/**/*.py", recursive=True)):
    for line in open(path, encoding="utf-8", errors="replace"):
        if line.strip() and total < 14_000_000:
            print(line.rstrip())
            total += len(line)
PY
cat > /tmp/llama-1b.json <<'JSON'
{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 50257, "hidden_size": 2048,
 "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
 "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false,
 "hidden_act": "silu", "bos_token_id": 50256, "eos_token_id": 50256}
JSON
for run in bf16 fp8; do
  flags=(); [ "$run" = fp8 ] && flags=(--fp8 tensorwise --set train.fp8_layers=all)
  timeout ${FT_LIMIT:-200} "$FT" train --model /tmp/llama-1b.json --tokenizer $D/gpt2-tokenizer.json --train-file /tmp/text.txt \
    --max-seq-len 1024 --batch-size 8 --max-steps 300 --eval-samples 0 --dtype bf16 --lr 3e-4 --set train.warmup_steps=30 --seed 1 \
    --report-to jsonl --output-dir /tmp/loss-$run "${flags[@]}" > $OUT/loss-$run.log 2>&1 || { echo "FAILED $run"; tail -5 $OUT/loss-$run.log; }
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
curves = {}
for run in ("bf16", "fp8"):
    try:
        rows = [json.loads(l) for l in open(f"/tmp/loss-{run}/metrics.jsonl")]
    except OSError:
        continue
    curves[run] = {r["step"]: r["loss"] for r in rows if "loss" in r}
    seconds = [r["step_seconds"] for r in rows if "step_seconds" in r][20:]
    last = [curves[run][s] for s in sorted(curves[run])[-20:]]
    print(json.dumps({"run": run, "steps": len(curves[run]), "first_loss": curves[run][min(curves[run])], "final_loss_mean_last_20": sum(last) / len(last),
                      "median_step_ms": sorted(seconds)[len(seconds) // 2] * 1e3 if seconds else None}))
json.dump(curves, open(f"{out}/fp8-loss.json", "w"))
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(8, 4.5))
for run, curve in curves.items():
    steps = sorted(curve)
    ax.plot(steps, [curve[s] for s in steps], label={"bf16": "bf16", "fp8": "--fp8 tensorwise"}[run], linewidth=1)
ax.set_xlabel("step"); ax.set_ylabel("training loss"); ax.set_yscale("log"); ax.legend()
ax.set_title("Llama ~1B (hidden 2048, 16 layers), 8 x 1024 tokens of Python source a step, same start")
fig.tight_layout(); fig.savefig(f"{out}/fp8-loss.png", dpi=110)
PY
for model in bloom-560m opt-1.3b; do
  "$FT" calibrate --fp8 --config $D/configs/$model/config.json --batch 8 --seq 1024 --host-elements 1048576 --out /tmp/calibration-$model.json 2>&1 | grep -E "GEMM|rror"
  for fp8 in off tensorwise; do
    "$FT" bench --config $D/configs/$model/config.json --gpus 1 --strategy ddp --batch 8 --seq 1024 --warmup 3 --steps 6 --fp8 $fp8 \
      --json $OUT/bench-$model-$fp8.json > /tmp/bench-$model-$fp8.log 2>&1 || { echo "FAILED $model $fp8"; tail -5 /tmp/bench-$model-$fp8.log; }
    grep -E "^\| [a-z]" /tmp/bench-$model-$fp8.log | tail -1
  done
done
