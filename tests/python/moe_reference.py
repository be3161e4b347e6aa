"""transformers' side of tests/models.rs's mixture-of-experts tests: tiny
random MoE models and what transformers computes with them.

make OUT_DIR JSON
    JSON maps a name to {"config": CONFIG, "seed": N}. For each, under
    OUT_DIR/NAME: hub/ is the model as save_pretrained writes it (the Hub's
    layout, one tensor per expert matrix); fused/ the same weights as
    transformers 5 holds them (`mlp.experts.gate_up_proj` [E, 2I, H],
    `mlp.experts.down_proj` [E, H, I]) beside the same config.json;
    reference.safetensors, on right-padded rows (ids, mask: 1 for real
    tokens) with labels = ids except -100 at padding, in fp32: the logits,
    `loss` (with the load-balancing loss times router_aux_loss_coef when the
    config has output_router_logits), `aux_loss` (0 without) and each
    parameter's gradient as grad.<its name in transformers' model>. Norm
    weights are drawn around 1 and the routers wider than the rest, so that
    a misread norm changes the outputs and no token's top-k is a near tie.

loss MODEL_DIR TOKENIZED_JSONL SLICES_JSON
    Prints as a JSON list, for each [START, COUNT] of SLICES_JSON,
    transformers' `loss` (with the load-balancing loss when the config asks)
    and `aux_loss` on examples START to START + COUNT of TOKENIZED_JSONL
    (`ft tokenize`'s lines: input_ids and labels), right-padded into one
    batch with their attention mask, as `ft train` computes a micro-batch of
    them with data.shuffle=false.

check PAIRS_JSON
    A list of [EXPORT_DIR, REFERENCE_DIR]: transformers loads each export
    with no key missing, unexpected or mis-shaped, and its logits on the
    reference's rows equal the reference's at the real tokens (1e-5).
"""
import argparse
import json
import os

import serve
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging

LENGTHS = [12, 9, 6]


def rows(vocab, seed):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(LENGTHS), max(LENGTHS)), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(LENGTHS):
        mask[row, :length] = 1
    return ids * mask, mask


def make(out, cases):
    for name, case in cases.items():
        config = case["config"]
        torch.manual_seed(case["seed"])
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
        with torch.no_grad():
            for key, parameter in model.named_parameters():
                if "norm" in key:
                    parameter.normal_(1.0, 0.1)
                elif key.endswith("mlp.gate.weight"):
                    parameter.normal_(0.0, 0.5)
        model.save_pretrained(f"{out}/{name}/hub")
        os.makedirs(f"{out}/{name}/fused")
        save_file({key: value.contiguous() for key, value in model.state_dict().items()}, f"{out}/{name}/fused/model.safetensors")
        with open(f"{out}/{name}/hub/config.json") as f, open(f"{out}/{name}/fused/config.json", "w") as g:
            g.write(f.read())
        ids, mask = rows(config["vocab_size"], case["seed"])
        labels = ids.masked_fill(mask == 0, -100)
        output = model.train()(input_ids=ids, attention_mask=mask, labels=labels)
        output.loss.backward()
        reference = {"ids": ids, "mask": mask, "logits": output.logits.detach(), "loss": output.loss.detach()}
        reference["aux_loss"] = output.aux_loss.detach() if output.aux_loss is not None else torch.tensor(0.0)
        reference.update({f"grad.{key}": p.grad for key, p in model.named_parameters() if p.grad is not None})
        save_file({key: value.contiguous() for key, value in reference.items()}, f"{out}/{name}/reference.safetensors")
        print(name, "loss", output.loss.item(), "aux", reference["aux_loss"].item())


def loss(model_dir, tokenized, slices):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    with open(tokenized) as f:
        examples = [json.loads(line) for line in f]
    print(json.dumps([batch_loss(model, examples[start : start + count]) for start, count in slices]))


def batch_loss(model, examples):
    count = len(examples)
    longest = max(len(example["input_ids"]) for example in examples)
    ids = torch.zeros(count, longest, dtype=torch.long)
    labels = torch.full((count, longest), -100)
    mask = torch.zeros(count, longest, dtype=torch.long)
    for row, example in enumerate(examples):
        length = len(example["input_ids"])
        ids[row, :length] = torch.tensor(example["input_ids"])
        labels[row, :length] = torch.tensor(example["labels"])
        mask[row, :length] = 1
    with torch.no_grad():
        output = model(input_ids=ids, attention_mask=mask, labels=labels)
    return {"loss": output.loss.item(), "aux_loss": output.aux_loss.item()}


def check(pairs):
    for export, reference_dir in pairs:
        model, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True, dtype=torch.float32)
        problems = {key: info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys") if info[key]}
        assert not problems, f"{export}: {problems}"
        reference = load_file(f"{reference_dir}/reference.safetensors")
        with torch.no_grad():
            logits = model.eval()(input_ids=reference["ids"], attention_mask=reference["mask"]).logits
        real = reference["mask"].unsqueeze(-1).bool()
        expected = reference["logits"]
        error = ((logits - expected).abs().masked_fill(~real, 0).max() / expected.abs().max()).item()
        assert error <= 1e-5, f"{export}: logits differ by {error}"
        print(export, "logits within", error)


def run(args):
    if args.command == "make":
        make(args.arguments[0], json.loads(args.arguments[1]))
    elif args.command == "loss":
        loss(args.arguments[0], args.arguments[1], json.loads(args.arguments[2]))
    else:
        check(json.loads(args.arguments[0]))


if __name__ == "__main__":
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", choices=["make", "loss", "check"])
    parser.add_argument("arguments", nargs="*")
    serve.main(parser, run)
