"""transformers' side of tests/sampling.rs: a tiny Llama whose next-token
distributions are far from uniform, and the exact distribution of the
continuations `generate(do_sample=True)` samples.

--make OUT_DIR
    A random 2-layer Llama (vocabulary of 64, no end token) whose LM head is
    drawn wide (std 0.22), so that its logits spread over about a unit and
    the options' cut-offs fall between tokens of clearly different
    probabilities; written by save_pretrained.

--distribution MODEL_DIR IDS OPTIONS_JSON NEW_TOKENS
    Prints as JSON {"t1,t2,...": probability} every continuation of
    NEW_TOKENS tokens of the prompt IDS (comma-separated) that `generate`
    samples with GenerationConfig(do_sample=True, **OPTIONS), and its
    probability: at each step the processors `_get_logits_processor` builds
    for that config, on the model's float32 logits, then the softmax.
    Continuations of probability 0 are left out.
"""
import argparse
import json

import serve
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig
from transformers.utils import logging


def make(out):
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.22)
    model.save_pretrained(out)


def distribution(model_dir, ids, options, new_tokens):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    processors = model._get_logits_processor(
        generation_config=GenerationConfig(do_sample=True, **options), input_ids_seq_length=len(ids), device="cpu", model_kwargs={}
    )
    continuations = {(): 1.0}
    for _ in range(new_tokens):
        longer = {}
        for tokens, probability in continuations.items():
            input_ids = torch.tensor([ids + list(tokens)])
            with torch.no_grad():
                logits = model(input_ids).logits[:, -1, :].float()
            step = torch.softmax(processors(input_ids, logits), dim=-1)[0].double()
            for token in step.nonzero().flatten().tolist():
                longer[tokens + (token,)] = probability * step[token].item()
        continuations = longer
    print(json.dumps({",".join(map(str, tokens)): p for tokens, p in continuations.items()}))


def run(args):
    if args.make:
        make(args.make)
    if args.distribution:
        model_dir, ids, options, new_tokens = args.distribution
        distribution(model_dir, [int(i) for i in ids.split(",")], json.loads(options), int(new_tokens))


if __name__ == "__main__":
    logging.disable_progress_bar()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--make", metavar="OUT_DIR")
    parser.add_argument("--distribution", nargs=4, metavar=("MODEL_DIR", "IDS", "OPTIONS_JSON", "NEW_TOKENS"))
    serve.main(parser, run)
