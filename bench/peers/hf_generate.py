"""The PyTorch side of `ft eval`'s generation on one GPU: transformers'
greedy `generate` (KV cache, left padding, bf16) on SQuAD prompts built as
ft builds them (`Question: … Context: … Answer:`, the context cut to leave
room for the answer), the prompts sorted by length as ft sorts them, at a
given batch size; examples per second of generation alone.

    python3 bench/peers/hf_generate.py --model DIR --tokenizer tokenizer.json --squad F --samples 512 --batch 64 [--max-new-tokens 16] [--json F]
"""
import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast


def prompts(tokenizer, squad, samples, budget):
    rows = []
    for article in json.load(open(squad))["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                if len(rows) == samples:
                    return rows
                head = tokenizer.encode(f"Question: {qa['question']} Context:")
                context = tokenizer.encode(" " + paragraph["context"])
                tail = tokenizer.encode(" Answer:")
                rows.append(head + context[: max(0, budget - len(head) - len(tail))] + tail)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--squad", required=True)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--json")
    args = parser.parse_args()

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=args.tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    rows = sorted(prompts(tokenizer, args.squad, args.samples, args.max_seq_len - args.max_new_tokens), key=len)
    eos = tokenizer.eos_token_id

    def run(batch_rows):
        longest = max(len(r) for r in batch_rows)
        ids = torch.tensor([[eos] * (longest - len(r)) + r for r in batch_rows], device="cuda")
        mask = torch.tensor([[0] * (longest - len(r)) + [1] * len(r) for r in batch_rows], device="cuda")
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False,
                                  eos_token_id=eos, pad_token_id=eos)

    run(rows[: args.batch])  # warm-up
    torch.cuda.synchronize()
    started = time.perf_counter()
    generated = 0
    for i in range(0, len(rows), args.batch):
        out = run(rows[i : i + args.batch])
        generated += out.shape[0]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    row = {"peer": "transformers generate", "batch": args.batch, "samples": generated, "seconds": seconds,
           "samples_per_s": generated / seconds, "max_new_tokens": args.max_new_tokens}
    print(json.dumps(row))
    if args.json:
        json.dump(row, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
