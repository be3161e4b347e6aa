"""Hugging Face Trainer with FSDP, the peer users reach for first:
`fsdp="full_shard auto_wrap"` over the model's decoder blocks, bf16, AdamW,
clipping at 1.0, on random fixed-length batches from a config.json's
random-weight model. Prints one JSON line (rank 0) with Trainer's own
throughput figure, per GPU.

    torchrun --nproc-per-node 2 bench/peers/hf_trainer_fsdp.py --config CONFIG.json --batch 8 --seq 512
"""
import argparse
import json
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

from fsdp2_train_step import blocks


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, vocab, seq, count):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (count, seq), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = AutoConfig.from_pretrained(args.config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    block = type(blocks(model)[0]).__name__
    training = TrainingArguments(
        output_dir="/tmp/hf-trainer-fsdp", per_device_train_batch_size=args.batch, max_steps=args.steps,
        bf16=True, learning_rate=1e-5, max_grad_norm=1.0, optim="adamw_torch_fused", logging_steps=10 ** 9,
        save_strategy="no", report_to=[], fsdp="full_shard auto_wrap",
        fsdp_config={"transformer_layer_cls_to_wrap": [block]}, dataloader_num_workers=1,
    )
    dataset = RandomTokens(config.vocab_size, args.seq, args.batch * world * args.steps)
    metrics = Trainer(model=model, args=training, train_dataset=dataset).train().metrics
    if int(os.environ.get("RANK", "0")) == 0:
        samples_per_s = metrics["train_samples_per_second"]
        print(json.dumps({
            "peer": "hf-trainer-fsdp", "gpus": world, "batch": args.batch, "seq": args.seq,
            "tokens_per_s_per_gpu": samples_per_s * args.seq / world,
            "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9, "loss": metrics["train_loss"],
        }), flush=True)


if __name__ == "__main__":
    main()
