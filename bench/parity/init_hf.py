"""A random-weight Hugging Face model made by transformers itself, for
fixtures that should not come from ft's own writer:

    python bench/parity/init_hf.py OUT_DIR --seed N --config '{"model_type": "qwen2", ...}' [--keep given|saved]

Builds AutoModelForCausalLM.from_config under torch.manual_seed(N) —
transformers' own initialisation — then draws the biases and norm weights,
which it sets to 0 and 1, at random too (N(0, 0.1) and 1 + N(0, 0.1)), so a
bias or norm weight that ft read wrongly would change the outputs. Saves
fp32 safetensors (no generation_config.json). OUT_DIR/config.json is the config as transformers 5 writes
it (`--keep saved`: `rope_parameters`, `layer_types`), or as given (`--keep
given`: the hub's form, `rope_theta` and `rope_scaling`), which transformers
reads too.
"""
import argparse
import copy
import json
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--config", required=True, help="the config as JSON text, model_type included")
    parser.add_argument("--keep", choices=["given", "saved"], default="saved")
    args = parser.parse_args()
    logging.disable_progress_bar()
    given = json.loads(args.config)
    torch.manual_seed(args.seed)
    # A copy: transformers rewrites the rope dict it is given in place.
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**copy.deepcopy(given)), dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0.0, 0.1)
            elif "norm" in name:
                parameter.normal_(1.0, 0.1)
    model.save_pretrained(args.out, safe_serialization=True)
    # Generation defaults ft does not read (parity.py sets what generation needs).
    os.remove(os.path.join(args.out, "generation_config.json"))
    if args.keep == "given":
        with open(os.path.join(args.out, "config.json"), "w") as f:
            json.dump({"architectures": model.config.architectures, **given, "torch_dtype": "float32"}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
