"""TRL's side of tests/dpo.rs: DPOTrainer (TRL 1.16) on a preference file.

run CASES_JSON OUT_JSON
    CASES_JSON is a list of cases, each {"model": DIR, "data": JSONL,
    "loss_type": [...], "loss_weights": [...] or null, "beta": B,
    "label_smoothing": S, "max_length": N, "truncation_mode": M,
    "batch_size": B, "steps": N, "lr": LR, "eval": JSONL or null,
    "precompute_ref": true or false}. Each trains the model (f32, CPU,
    dropout off) with DPOTrainer from its starting weights, the reference
    log-probabilities precomputed from them (precompute_ref true) or
    computed with each batch by a copy of them (`ref_model`), AdamW with the
    Trainer's defaults at a constant learning rate, clipping at 1.0, every
    step logged; the batch is the whole file each step (so the sampler's
    order does not matter). OUT_JSON gets, per case, {"train": each
    step's logged loss, grad_norm and rewards/logps figures, "eval": with
    an evaluation file, its eval_loss and eval_ figures after each step}.

bf16 is off: DPOConfig turns it on by default, and on a CPU its autocast
would compute the model in bfloat16.
"""

import gc
import json
import sys
import tempfile

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer

# What the imports made, out of the collector's sight: the Trainer's
# gc.collect() at the end of each case (accelerate's free_memory) then walks
# only what the case made (5.5 of the script's 30 s before).
gc.freeze()

KEYS = ["loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"]


class Logs(TrainerCallback):
    def __init__(self):
        self.steps = []
        self.evals = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.steps.append({key: logs[key] for key in KEYS})
        if logs and "eval_loss" in logs:
            self.evals.append({"eval_" + key: logs["eval_" + key] for key in KEYS if key != "grad_norm"})


def run(case):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(case["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(case["model"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = load_dataset("json", data_files=case["data"], split="train")
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(
            output_dir=out,
            per_device_train_batch_size=case["batch_size"],
            learning_rate=case["lr"],
            lr_scheduler_type="constant",
            max_steps=case["steps"],
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            bf16=False,
            seed=0,
            beta=case["beta"],
            loss_type=case["loss_type"],
            loss_weights=case["loss_weights"],
            label_smoothing=case["label_smoothing"],
            max_length=case["max_length"],
            truncation_mode=case["truncation_mode"],
            precompute_ref_log_probs=case["precompute_ref"],
            dataloader_drop_last=True,
            per_device_eval_batch_size=case["batch_size"],
            eval_strategy="steps" if case["eval"] else "no",
            eval_steps=1,
        )
        logs = Logs()
        eval_dataset = load_dataset("json", data_files=case["eval"], split="train") if case["eval"] else None
        ref_model = None if case["precompute_ref"] else AutoModelForCausalLM.from_pretrained(case["model"], dtype=torch.float32)
        trainer = DPOTrainer(
            model=model,
            ref_model=ref_model,
            args=args,
            train_dataset=dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            callbacks=[logs],
        )
        trainer.train()
    return {"train": logs.steps, "eval": logs.evals}


def main():
    command, cases, out = sys.argv[1:4]
    assert command == "run", command
    with open(cases) as f:
        results = [run(case) for case in json.load(f)]
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
