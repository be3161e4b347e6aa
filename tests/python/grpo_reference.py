"""TRL's side of tests/grpo.rs: GRPOTrainer or RLOOTrainer (TRL 1.16) fed
the completions ft sampled.

run CASE_JSON OUT_JSON
    CASE_JSON is {"algorithm": "grpo" or "rloo", "model": DIR, "prompts":
    JSONL, "rollouts": ft's rollouts.jsonl, "rewards": ["FILE.py:FUNCTION",
    ...], "batch_size": B, "grad_accum": A, "steps": N, "lr": LR,
    "options": {GRPOConfig/RLOOConfig keys}}. The model trains (f32, CPU)
    from its starting weights with AdamW at a constant learning rate,
    clipping at 1.0, every step logged, the prompts in file order. Where TRL
    would generate, it takes ft's completions of the same prompts, in
    rollouts.jsonl's order (its generator replaced; the prompts' tokens are
    checked to be ft's), and trained in the order sampled (TRL's shuffle of
    a generation batch, by torch's global generator, is left out: ft keeps
    the epoch's order). The log-probabilities are taken in plain PyTorch
    over transformers' logits: TRL 1.16's fused LM-head kernel gives values
    that agree but gradients 0.4-1% off the exact ones. Everything else —
    rewards, advantages, losses, their normalisation, the figures — is
    TRL's own. OUT_JSON gets each step's logged figures.
"""

import argparse
import importlib.util
import json
import sys
import tempfile

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

import serve


class Logs(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.steps.append(dict(logs))


def reward_function(spec):
    path, name = spec.rsplit(":", 1)
    module_spec = importlib.util.spec_from_file_location("rewards_" + str(abs(hash(path))), path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


def exact_logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, compute_aux_loss=False, **kwargs):
    """Each completion token's log-probability (logits over the temperature) and each position's entropy."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = logits[:, :-1, :][:, -logits_to_keep:] / self.temperature
    log_probs = logits.log_softmax(-1)
    logps = log_probs.gather(-1, input_ids[:, -logits_to_keep:].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1) if compute_entropy else None
    return logps, entropy, None


def run(args):
    with open(args.case) as f:
        case = json.load(f)
    if case["algorithm"] == "grpo":
        from trl import GRPOConfig as Config, GRPOTrainer as Trainer
    else:
        from trl import RLOOConfig as Config, RLOOTrainer as Trainer
    with open(case["rollouts"]) as f:
        rows = [json.loads(line) for line in f]
    queue = list(rows)

    def ft_completions(self, prompt_ids, *args, **kwargs):
        taken = [queue.pop(0) for _ in prompt_ids]
        for ours, row in zip(prompt_ids, taken):
            assert list(ours) == row["prompt_ids"], f"TRL's prompt {list(ours)} is not ft's {row['prompt_ids']}"
        completion_ids = [row["completion_ids"] for row in taken]
        # GRPOTrainer's takes the sampler's log-probabilities too (None: not sampled by vLLM).
        return (completion_ids, None) if case["algorithm"] == "grpo" else completion_ids

    Trainer._generate_single_turn = ft_completions
    # ft trains a generation's completions in the order sampled (the epoch's order of prompts); TRL shuffles them
    # once more before cutting them into steps, with torch's global generator, which nothing outside can replay.
    trainer_module = sys.modules[Trainer.__module__]
    trainer_module.shuffle_sequence_dict = lambda batch: batch
    Trainer._get_per_token_logps_and_entropies = exact_logps
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(case["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(case["model"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = load_dataset("json", data_files=case["prompts"], split="train")
    logs = Logs()
    with tempfile.TemporaryDirectory() as out:
        config = Config(
            output_dir=out,
            per_device_train_batch_size=case["batch_size"],
            gradient_accumulation_steps=case["grad_accum"],
            learning_rate=case["lr"],
            lr_scheduler_type="constant",
            max_steps=case["steps"],
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            bf16=False,
            seed=0,
            shuffle_dataset=False,
            **case["options"],
        )
        trainer = Trainer(
            model=model,
            reward_funcs=[reward_function(spec) for spec in case["rewards"]],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[logs],
        )
        trainer.train()
    assert not queue, f"{len(queue)} of ft's completions were not used"
    with open(args.out, "w") as f:
        json.dump(logs.steps, f)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("case", nargs="?")
    parser.add_argument("out", nargs="?")
    serve.main(parser, run)


if __name__ == "__main__":
    main()
