"""TRL's side of bench/gpu/grpo_1gpu.sh: GRPOTrainer (TRL 1.16) without vLLM
(not in the GPU image): completions sampled by transformers' `generate` from
the model being trained, a causal LM from a config.json with random weights,
fp32 parameters under bf16 mixed precision (as `ft train --dtype bf16`), or
with --lora R a bf16 base with peft's LoRA r=R on every linear layer; the
loss TRL defaults to (dapo, β 0); AdamW. Step times from the Trainer's own
steps (after --warmup), CUDA-synchronised, each one generation and one
optimizer step; the peak from torch.cuda.max_memory_allocated.

    python3 bench/peers/trl_grpo_step.py --config CONFIG.json --tokenizer tokenizer.json --data prompts.jsonl \
        --prompts 4 --generations 8 --completion 512 [--lora R] [--paged] [--checkpointing] --json OUT.json

The reward is the same cheap function ft's run calls (a hash of the
completion's ids): the rollout and the update are what is timed. --paged
uses transformers' continuous batching (`use_transformers_continuous_batching`), TRL's faster
generation path without vLLM.
"""
import argparse
import json
import statistics
import tempfile

import torch
from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast
from timing import trainer_step_times
from trl import GRPOConfig, GRPOTrainer


def ids_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--prompts", type=int, default=4, help="prompts a step")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion", type=int, default=512, help="max_completion_length")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lora", type=int)
    parser.add_argument("--paged", action="store_true")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (what fits a 7B LoRA step of 4 x 8 x 512)")
    parser.add_argument("--json")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.config)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if args.lora else torch.float32)
    adapters = LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM") if args.lora else None
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=args.tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    steps = args.warmup + args.steps
    dataset = load_dataset("json", data_files=args.data, split="train").select(range(args.prompts * steps))
    completions = args.prompts * args.generations
    times = trainer_step_times()
    with tempfile.TemporaryDirectory() as out:
        settings = GRPOConfig(
            output_dir=out, per_device_train_batch_size=completions, gradient_accumulation_steps=1, num_generations=args.generations,
            max_completion_length=args.completion, max_steps=steps, learning_rate=1e-6, bf16=True, gradient_checkpointing=args.checkpointing,
            logging_steps=1, save_strategy="no", report_to=[], seed=0, use_transformers_continuous_batching=args.paged,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=[ids_reward], args=settings, train_dataset=dataset, processing_class=tokenizer, callbacks=[times], peft_config=adapters)
        torch.cuda.reset_peak_memory_stats()
        trainer.train()
        lengths = [entry["completions/mean_length"] for entry in trainer.state.log_history if "completions/mean_length" in entry]
    step = statistics.median(times.seconds[args.warmup:])
    result = {
        "peer": "trl-grpo" + (f"+peft-lora{args.lora}" if args.lora else "") + ("+paged" if args.paged else "") + ("+checkpointing" if args.checkpointing else ""),
        "step_ms": step * 1e3, "steps_per_s": 1 / step, "completion_tokens_per_s": completions * statistics.mean(lengths) / step,
        "mean_completion_length": statistics.mean(lengths), "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
    }
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
