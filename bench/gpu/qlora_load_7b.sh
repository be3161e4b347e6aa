#!/usr/bin/env bash
# QLoRA from files (issue 37's loading row): a Llama-7B checkpoint (the
# CodeLlama-7B config) of random bf16 weights, written to the GPU machine's
# disk as transformers writes one (two safetensors shards and their index),
# then `ft train --quantize nf4` on real text, reading it a unit at a time.
# Prints the run's host peak (VmHWM of the rank), GPU peak, tokens/s and the
# bound the issue sets: one unit in fp32 + the 4-bit model + 2 GB.
set -uo pipefail
source "$(dirname "$0")/env.sh"
D=.device
CONFIG=${CONFIG:-$D/configs/codellama-7b/config.json}
CKPT=/tmp/llama7b-bf16 STEPS=${STEPS:-12} SEQ=${SEQ:-2048}
python3 - "$CONFIG" "$CKPT" <<'PY'
import json, os, sys, time, torch
from safetensors.torch import save_file
config, out = json.load(open(sys.argv[1])), sys.argv[2]
os.makedirs(out, exist_ok=True)
json.dump(config, open(f"{out}/config.json", "w"))
h, i, layers, vocab = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"], config["vocab_size"]
kv = h // config["num_attention_heads"] * config.get("num_key_value_heads", config["num_attention_heads"])
shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
for l in range(layers):
    p = f"model.layers.{l}."
    shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                   p + "self_attn.o_proj.weight": (h, h), p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
device = "cuda" if torch.cuda.is_available() else "cpu"
start, g, names, index = time.time(), torch.Generator(device).manual_seed(0), list(shapes), {}
for shard, part in enumerate([names[: len(names) // 2], names[len(names) // 2 :]]):
    file = f"model-{shard + 1:05d}-of-00002.safetensors"
    tensors = {n: (torch.ones(shapes[n]) if len(shapes[n]) == 1 else torch.randn(shapes[n], generator=g, device=device) * 0.02).to(torch.bfloat16).cpu() for n in part}
    save_file(tensors, f"{out}/{file}", metadata={"format": "pt"})
    index.update({n: file for n in part})
    del tensors
json.dump({"metadata": {}, "weight_map": index}, open(f"{out}/model.safetensors.index.json", "w"))
print(f"checkpoint: {sum(torch.Size(s).numel() for s in shapes.values()) / 1e9:.2f}B bf16 parameters in {time.time() - start:.0f} s")
PY
du -sh $CKPT
# Real text (the GPU machine's transformers sources) and a 32,000-token byte-level BPE trained on it.
python3 - <<'PY'
import glob, os, transformers
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
root, total, out = os.path.dirname(transformers.__file__), 0, open("/tmp/text.txt", "w")
for path in sorted(glob.glob(f"{root}/**/*.py", recursive=True)):
    for line in open(path, encoding="utf-8", errors="replace"):
        if line.strip() and total < 4_000_000:
            out.write(line.rstrip() + "\n")
            total += len(line)
out.close()
tokenizer = Tokenizer(models.BPE())
tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
tokenizer.train(["/tmp/text.txt"], trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>"]))
tokenizer.save("/tmp/tokenizer.json")
PY
"$FT" train --model $CKPT --tokenizer /tmp/tokenizer.json --train-file /tmp/text.txt --max-seq-len $SEQ --batch-size 2 \
  --max-steps $STEPS --eval-samples 0 --dtype bf16 --lr 1e-4 --lora-r 16 --lora-alpha 32 --lora-targets q,k,v,o,gate,up,down \
  --quantize nf4 --report-to jsonl --output-dir $OUT/qlora-load > $OUT/qlora-load.log 2>&1 || { echo "FAILED"; tail -20 $OUT/qlora-load.log; }
grep -E "causal_lm: |LoRA r=|memory rank 0" $OUT/qlora-load.log | cut -c1-220
"$FT" plan --model $CKPT --gpus 1 --gpu h100 --batch 2 --seq $SEQ --activation-checkpointing off --lora-r 16 --lora-alpha 32 \
  --lora-targets q,k,v,o,gate,up,down --quantize nf4 2>&1 | grep -E "^ddp +none"
python3 - $OUT/qlora-load $CONFIG $SEQ <<'PY'
import json, statistics, sys
d, config, seq = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3])
s = json.load(open(f"{d}/summary.json"))
rows = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"step_seconds"' in l]
step = statistics.median(r["step_seconds"] for r in rows[len(rows) // 3:])
state = s["state_per_rank"][0]
h, i, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
kv = h // heads * config.get("num_key_value_heads", heads)
unit_fp32 = (3 * i * h + 2 * h * h + 2 * kv * h + 2 * h) * 4
bound = unit_fp32 + state["frozen"] + 2e9
print(json.dumps({"host_peak_gb": s["host_peak_per_rank"][0] / 1e9, "bound_gb": bound / 1e9, "largest_block_fp32_gb": unit_fp32 / 1e9,
  "four_bit_model_gb": state["frozen"] / 1e9, "gpu_peak_gb": s["memory_per_rank"][0]["peak"] / 1e9, "step_ms": step * 1e3,
  "tokens_per_s": 2 * seq / step, "final_loss": s.get("final_train_loss")}))
PY
