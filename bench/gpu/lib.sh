# Sourced by the side-by-side scripts: ft runs on packed text with
# steady-state figures from its metrics, and the PyTorch/DeepSpeed peers.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
D=.device

# Packed text for ft (every sequence exactly --max-seq-len tokens).
make_text() {
  python3 - > /tmp/words.txt <<'PY'
import random
random.seed(0)
words = [w.strip() for w in open(".device/squad.json").read().split() if w.isalpha()][:20000]
for _ in range(12000):
    print(" ".join(random.choice(words) for _ in range(60)))
PY
}

# GRPO's rows: 256 prompts of 48 random words (/tmp/prompts.jsonl) and a
# reward of the completion's ids alone (/tmp/reward.py:ids_reward).
make_grpo_prompts() {
  python3 - <<'PY'
import json, random
random.seed(0)
words = [w for w in open(".device/squad.json").read().split() if w.isalpha()][:20000]
with open("/tmp/prompts.jsonl", "w") as f:
    for _ in range(256):
        f.write(json.dumps({"prompt": " ".join(random.choice(words) for _ in range(48))}) + "\n")
PY
  printf 'def ids_reward(completion_ids, **kwargs):\n    return [float(sum(ids) %% 7) for ids in completion_ids]\n' > /tmp/reward.py
}

# ft_run NAME GPUS CONFIG_DIR SEQ BATCH STEPS [ft train flags…]: one JSON line,
# step time = median after 5 warm-up steps.
ft_run() {
  local name=$1 gpus=$2 model=$3 seq=$4 batch=$5 steps=$6; shift 6
  "$FT" train --model $D/configs/$model/config.json --tokenizer $D/gpt2-tokenizer.json --train-file /tmp/words.txt \
    --max-seq-len $seq --batch-size $batch --epochs 1 --train-samples $((batch * gpus * steps)) --eval-samples 0 \
    --dtype bf16 --lr 1e-5 --nproc-per-node $gpus --output-dir $OUT/$name "$@" > $OUT/$name.log 2>&1 \
    || { echo "FAILED $name"; tail -15 $OUT/$name.log; return; }
  python3 - $OUT/$name $gpus $batch $seq <<'PY'
import json, statistics, sys
d, gpus, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rows = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"step_seconds"' in l]
s = json.load(open(f"{d}/summary.json"))
step = statistics.median(r["step_seconds"] for r in rows[5:])
median = lambda key: (statistics.median(r[key] for r in rows[5:]) * 1e3) if key in rows[-1] else None
print(json.dumps({"ft": d.split("/")[-1], "gpus": gpus, "step_ms": step * 1e3, "tokens_per_s_per_gpu": batch * seq / step,
  "peak_allocated_gb": s["memory_per_rank"][0]["peak"] / 1e9, "host_peak_gb": s["host_peak_per_rank"][0] / 1e9,
  "cpu_step_ms": median("offload_cpu_step_seconds"), "wait_ms": median("offload_wait_seconds"),
  "state": s["state_per_rank"][0], "loss": s["final_train_loss"]}))
PY
  rm -rf $OUT/$name/final $OUT/$name/tensorboard $OUT/$name/metrics.csv $OUT/$name/predictions*.json
}

# fsdp2 GPUS CONFIG_DIR [fsdp2_train_step.py flags…] (stopped after LIMIT seconds, default 300)
fsdp2() { timeout ${LIMIT:-300} torchrun --nproc-per-node $1 bench/peers/fsdp2_train_step.py --config $D/configs/$2/config.json "${@:3}" 2>&1 | grep -E '^\{|Error' | tail -3; }

# DeepSpeed from the carried sdist and wheels (.whl), into /tmp/site.
install_deepspeed() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site .whl/deepspeed-*.tar.gz \
    && export PYTHONPATH=/tmp/site TORCH_CUDA_ARCH_LIST=9.0 || echo "FAILED deepspeed install"
}

# deepspeed GPUS CONFIG_DIR [deepspeed_train_step.py flags…] (stopped after LIMIT seconds, default 300)
deepspeed_peer() { timeout ${LIMIT:-300} torchrun --nproc-per-node $1 bench/peers/deepspeed_train_step.py --config $D/configs/$2/config.json "${@:3}" 2>&1 | grep -E '^\{|Error' | tail -3; }

# make_pairs COUNT: COUNT preference pairs in /tmp/prefs.jsonl, each a prompt
# and two completions of 250 of SQuAD's words in a seeded order.
make_pairs() {
  python3 - "$1" <<'PY'
import json, random, sys
random.seed(0)
words = [w for w in open(".device/squad.json").read().split() if w.isalpha()][:20000]
text = lambda n: " ".join(random.choice(words) for _ in range(n))
with open("/tmp/prefs.jsonl", "w") as f:
    for _ in range(int(sys.argv[1])):
        f.write(json.dumps({"prompt": text(250), "chosen": " " + text(250), "rejected": " " + text(250)}) + "\n")
PY
}

# summary LABEL JSON: one line from `ft bench --json` rows or a peer's --json
# (bench/peers/*_step.py): tokens/s (per GPU where given), peak allocated
# memory, and MFU, loss and bytes sent where the file has them.
summary() {
  python3 - "$@" <<'PY'
import json, sys
r = json.load(open(sys.argv[2]))
r = r[0] if isinstance(r, list) else r
parts = [f"{r.get('tokens_per_s_per_gpu', r.get('tokens_per_s')):,.0f} tokens/s", f"peak allocated {r['peak_allocated_gb']:.1f} GB"]
parts += [f"MFU {100 * r['mfu']:.1f}%"] if r.get("mfu") else []
parts += [f"loss {r['loss']:.5f}"] if r.get("loss") is not None else []
parts += [f"sent {r['comm_bytes_per_step'] / 1e6:,.0f} MB/step"] if r.get("comm_bytes_per_step") else []
print(f"== {sys.argv[1]}: " + ", ".join(parts))
PY
}
