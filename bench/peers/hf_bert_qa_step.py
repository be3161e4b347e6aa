"""The PyTorch side of `ft bench` for extractive QA on one GPU:
transformers' BertForQuestionAnswering (bert-base shape by default, random
weights, fp32 parameters), bf16 autocast, fused AdamW, clipping 1.0, random
windows with random answer spans — eager, or under torch.compile.

    python3 bench/peers/hf_bert_qa_step.py [--config bert.json] --batch 32 --seq 384 [--compile] [--json F]
"""
import argparse
import json
import os
import sys

import torch
from transformers import BertConfig, BertForQuestionAnswering

sys.path.insert(0, os.path.dirname(__file__))
from timing import record, time_steps  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", help="a BertConfig json (default: bert-base's shape)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=384)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = BertConfig.from_json_file(args.config) if args.config else BertConfig()
    model = BertForQuestionAnswering(config).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-5, weight_decay=0.0, fused=True)
    forward = torch.compile(model) if args.compile else model
    b, s = args.batch, args.seq

    def batch():
        ids = torch.randint(0, config.vocab_size, (b, s), device="cuda")
        types = (torch.arange(s, device="cuda") >= s // 4).long().expand(b, s)
        start = torch.randint(0, s, (b,), device="cuda")
        return ids, types, start, (start + 8).clamp(max=s - 1)

    batches = [batch() for _ in range(4)]

    def step(i):
        ids, types, start, end = batches[i % len(batches)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(input_ids=ids, token_type_ids=types, attention_mask=torch.ones_like(ids),
                           start_positions=start, end_positions=end).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    seconds, loss = time_steps(step, args.warmup, args.steps)
    peer = f"transformers {'compiled' if args.compile else 'eager'}"
    row = record(peer, 1, b, s, seconds, loss)
    print(json.dumps(row))
    if args.json:
        json.dump(row, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
