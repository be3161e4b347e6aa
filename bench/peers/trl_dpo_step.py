"""TRL's side of bench/gpu/dpo_1gpu.sh: DPOTrainer (TRL 1.16) on a
preference file, a causal LM from a config.json with random weights, fp32
parameters under bf16 mixed precision (as `ft train --dtype bf16`), the
sigmoid loss, AdamW; step times from the Trainer's own steps (after
--warmup), CUDA-synchronised; the peak from torch.cuda.max_memory_allocated.

    python3 bench/peers/trl_dpo_step.py --config CONFIG.json --tokenizer tokenizer.json --data prefs.jsonl \
        --batch 8 --max-length 512 [--precompute] [--compile] [--lora R] --json OUT.json

With --lora R: peft's LoRA r=R, alpha 2R on every linear layer ("all-linear")
over a bf16 base, as users load one for LoRA; the reference is the base with
the adapters off (TRL's own choice when given a peft model).

TRL 1.16 turns its padding_free off ("temporarily unavailable after a
refactor"), so it is not offered here.
"""
import argparse
import copy
import json
import statistics
import tempfile

import torch
from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast
from timing import trainer_step_times
from trl import DPOConfig, DPOTrainer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=512, help="each sequence's (prompt + completion) longest")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--precompute", action="store_true", help="precompute_ref_log_probs: no reference model in memory")
    parser.add_argument("--compile", action="store_true", help="the Trainer's torch_compile")
    parser.add_argument("--lora", type=int, help="LoRA rank: adapters on every linear layer over a bf16 base")
    parser.add_argument("--json")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.config)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if args.lora else torch.float32)
    adapters = LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM") if args.lora else None
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=args.tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    pairs = args.batch * (args.warmup + args.steps)
    dataset = load_dataset("json", data_files=args.data, split="train").select(range(pairs))
    times = trainer_step_times()
    with tempfile.TemporaryDirectory() as out:
        settings = DPOConfig(
            output_dir=out, per_device_train_batch_size=args.batch, max_steps=args.warmup + args.steps, learning_rate=1e-6,
            bf16=torch.cuda.is_available(), max_length=args.max_length, precompute_ref_log_probs=args.precompute,
            torch_compile=args.compile, gradient_checkpointing=False, logging_steps=1, save_strategy="no", report_to=[],
            dataloader_drop_last=True, seed=0,
        )
        # TRL's own copy of the reference loads the model's name from the Hub: a copy of the starting weights instead.
        reference = None if args.precompute or args.lora else copy.deepcopy(model).eval()
        trainer = DPOTrainer(
            model=model, ref_model=reference, args=settings, train_dataset=dataset, processing_class=tokenizer, callbacks=[times], peft_config=adapters
        )
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        lengths = [len(row["prompt_ids"]) * 2 + len(row["chosen_ids"]) + len(row["rejected_ids"]) for row in trainer.train_dataset]
    step = statistics.median(times.seconds[args.warmup:])
    tokens_per_pair = sum(lengths) / len(lengths)
    result = {
        "peer": "trl-dpo" + (f"+peft-lora{args.lora}" if args.lora else "") + ("+precompute" if args.precompute else "") + ("+compile" if args.compile else ""),
        "step_ms": step * 1e3, "pairs_per_s": args.batch / step, "tokens_per_s": tokens_per_pair * args.batch / step,
        "tokens_per_pair": tokens_per_pair, "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None,
    }
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
