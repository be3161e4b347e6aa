"""Hugging Face Trainer on the seeds' baseline, for `ft train` to be measured
against: a random-weight model from a config.json, SQuAD examples as
`Question: {q} Context: {c} Answer: {a}<eos>` with the loss on the answer
(the context cut to fit), right padding, bf16, AdamW, eval loss each epoch.

    python3 bench/peers/hf_trainer_squad.py --config CONFIG.json --tokenizer tokenizer.json \
        --squad FILE.json --train-samples 500 --eval-samples 100
"""
import argparse
import json
import time

import torch
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments


def squad_examples(path, limit):
    questions = []
    for article in json.load(open(path))["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                if qa.get("is_impossible") or not qa["answers"]:
                    continue
                questions.append((qa["question"], paragraph["context"], qa["answers"][0]["text"]))
    return questions[:limit]


def encode(tokenizer, eos, question, context, answer, max_len):
    ids = lambda text: tokenizer.encode(text, add_special_tokens=False).ids
    target = ids(" " + answer) + [eos]
    head, tail = ids(f"Question: {question} Context:"), ids(" Answer:")
    body = ids(" " + context)[: max(0, max_len - len(target) - len(head) - len(tail))]
    prompt = head + body + tail
    return {"input_ids": prompt + target, "labels": [-100] * len(prompt) + target}


def collate(batch):
    longest = max(len(b["input_ids"]) for b in batch)
    pad = lambda row, value: row + [value] * (longest - len(row))
    return {
        "input_ids": torch.tensor([pad(b["input_ids"], 0) for b in batch]),
        "labels": torch.tensor([pad(b["labels"], -100) for b in batch]),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--squad", required=True)
    parser.add_argument("--train-samples", type=int, default=500)
    parser.add_argument("--eval-samples", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()

    tokenizer = Tokenizer.from_file(args.tokenizer)
    eos = tokenizer.token_to_id("<|endoftext|>")
    data = squad_examples(args.squad, args.train_samples + args.eval_samples)
    train = [encode(tokenizer, eos, *q, args.max_len) for q in data[: args.train_samples]]
    evaluation = [encode(tokenizer, eos, *q, args.max_len) for q in data[args.train_samples:]]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.config), dtype=torch.float32)
    training = TrainingArguments(
        output_dir="/tmp/hf-trainer", per_device_train_batch_size=4, per_device_eval_batch_size=4,
        gradient_accumulation_steps=4, num_train_epochs=args.epochs, learning_rate=5e-5, bf16=True,
        eval_strategy="epoch", save_strategy="no", logging_steps=10, report_to=[], optim="adamw_torch_fused",
        remove_unused_columns=False, dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=training, train_dataset=train, eval_dataset=evaluation, data_collator=collate)
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    metrics = trainer.train().metrics
    seconds = time.perf_counter() - started
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    peak = torch.cuda.max_memory_allocated() / 1e9
    print(f"HF Trainer: {metrics['train_samples_per_second']:.1f} train samples/s (runtime {metrics['train_runtime']:.1f} s, "
          f"includes its per-epoch eval), final train loss {metrics['train_loss']:.4f}, eval losses {evals}, "
          f"peak allocated {peak:.1f} GB")
    if args.json:
        json.dump(dict(tool="transformers Trainer", train_samples_per_s=metrics["train_samples_per_second"],
                       train_runtime=metrics["train_runtime"], wall_seconds=seconds, eval_losses=evals,
                       peak_allocated_gb=peak, torch=torch.__version__), open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
