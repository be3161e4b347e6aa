"""transformers' side of tests/bert.rs, in one process per test (importing
torch and transformers is most of the time):

--create CONFIG HEAD DIR   random weights as transformers initialises them
                           (torch.manual_seed(--seed)), saved as safetensors;
                           HEAD: question_answering (BertForQuestionAnswering),
                           base (BertModel, with its pooler) or masked_lm
                           (BertForMaskedLM). Repeatable.
--reference MODEL BATCH OUT
                           loads MODEL as BertForQuestionAnswering (fp32, CPU,
                           eval mode: no dropout) and runs BATCH (JSON:
                           input_ids, attention_mask, token_type_ids,
                           start_positions, end_positions) forward and
                           backward; writes OUT/reference.safetensors
                           (start_logits, end_logits, loss, grad.<name> of
                           every parameter) and OUT/loading_info.json (the
                           keys from_pretrained found missing, unexpected or
                           mismatched).
--serve                    jobs from stdin, one process for a whole test
                           binary (serve.py).
"""

import argparse
import json
import os

import serve

import torch
from safetensors.torch import save_file
from transformers import BertConfig, BertForMaskedLM, BertForQuestionAnswering, BertModel
from transformers.utils import logging

HEADS = {"question_answering": BertForQuestionAnswering, "base": BertModel, "masked_lm": BertForMaskedLM}


def create(config_path, head, out, seed):
    torch.manual_seed(seed)
    model = HEADS[head](BertConfig.from_json_file(config_path))
    model.save_pretrained(out, safe_serialization=True)


def reference(model_dir, batch_path, out):
    model, info = BertForQuestionAnswering.from_pretrained(model_dir, output_loading_info=True, dtype=torch.float32)
    model.eval()
    with open(batch_path) as f:
        batch = {key: torch.tensor(value) for key, value in json.load(f).items()}
    outputs = model(**batch)
    outputs.loss.backward()
    tensors = {"start_logits": outputs.start_logits, "end_logits": outputs.end_logits, "loss": outputs.loss}
    tensors.update({f"grad.{name}": p.grad for name, p in model.named_parameters()})
    os.makedirs(out, exist_ok=True)
    save_file({name: t.detach().contiguous() for name, t in tensors.items()}, os.path.join(out, "reference.safetensors"))
    with open(os.path.join(out, "loading_info.json"), "w") as f:
        json.dump({key: sorted(map(str, info[key])) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")}, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--create", nargs=3, action="append", default=[], metavar=("CONFIG", "HEAD", "DIR"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference", nargs=3, metavar=("MODEL", "BATCH", "OUT"))
    logging.disable_progress_bar()

    def run(args):
        for config_path, head, out in args.create:
            if head not in HEADS:
                parser.error(f"--create: unknown head {head!r} (one of {', '.join(HEADS)})")
            create(config_path, head, out, args.seed)
        if args.reference:
            reference(*args.reference)

    serve.main(parser, run)


if __name__ == "__main__":
    main()
