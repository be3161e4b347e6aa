"""peft's side of tests/lora.rs: an adapter ft wrote, loaded by peft onto
the transformers model, run forward and backward.

--reference BASE ADAPTER IDS OUT
    loads BASE (a causal LM directory, fp32, CPU) with transformers and
    ADAPTER (adapter_config.json + adapter_model.safetensors) with
    PeftModel.from_pretrained(is_trainable=True); runs the token rows of IDS
    (JSON) with labels = ids in eval mode (no dropout), backward; writes
    OUT/reference.safetensors: logits, loss, and grad.<key> for every
    trainable tensor under the adapter file's key names.
--qlora BASE ADAPTER IDS OUT QUANT_TYPE DOUBLE_QUANT
    as --reference, with BASE's linear layers of the blocks quantized by
    bitsandbytes as transformers does it (`BitsAndBytesConfig`: QUANT_TYPE
    nf4 or fp4, DOUBLE_QUANT true or false, fp32 compute), on CPU: QLoRA.
--qa-logits BASE ADAPTER IDS OUT
    BASE as BertForQuestionAnswering with ADAPTER (its trained qa_outputs
    head included): start and end logits on IDS, as OUT/reference.safetensors.
--logits MODEL IDS OUT
    a plain transformers model's logits on IDS (a merged export), as
    OUT/reference.safetensors.
--round BASE QUANT_TYPE DOUBLE_QUANT OUT
    BASE (fp32) with what QLoRA holds in 4 bits passed through
    bitsandbytes' `quantize_4bit` (blocks of 64, QUANT_TYPE, DOUBLE_QUANT as
    `compress_statistics`) and `dequantize_4bit` on CPU: every nn.Linear of
    the blocks, as `BitsAndBytesConfig` converts them, and a mixture of
    experts' fused expert tensors (`mlp.experts.gate_up_proj` [E, 2I, H],
    `down_proj` [E, H, I]), each quantized whole as one tensor; the router
    (no nn.Linear) as it is. Saved to OUT by `save_pretrained`; each
    tensor's packed bytes and quant state as transformers saves them
    (`QuantState.as_dict(packed=True)`, under the parameter's name) to
    OUT.states.safetensors.
--all-linear MODEL
    prints the modules peft's LoraConfig(target_modules="all-linear") adapts
    on MODEL, sorted, on one line (without peft's `base_model.model.`).
Each option may be given several times.
--serve
    jobs from stdin, one process for a whole test binary (serve.py).
"""

import argparse
import json
import os

import serve

# bitsandbytes wraps its CPU fallbacks in torch.compile; without a compiler
# pass they run as written, and quickly.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from transformers.utils import logging


def rows(path):
    with open(path) as f:
        return torch.tensor(json.load(f))


def reference(base, adapter, ids_path, out, quantization=None):
    from peft import PeftModel

    quantized = {} if quantization is None else {"quantization_config": quantization, "device_map": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **quantized)
    model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
    model.eval()
    ids = rows(ids_path)
    outputs = model(input_ids=ids, labels=ids)
    outputs.loss.backward()
    tensors = {"logits": outputs.logits, "loss": outputs.loss}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            # The file's key: peft's module path without the adapter's name.
            tensors["grad." + name.replace(".default", "")] = parameter.grad
    os.makedirs(out, exist_ok=True)
    save_file({k: t.detach().contiguous() for k, t in tensors.items()}, os.path.join(out, "reference.safetensors"))


def qlora(base, adapter, ids_path, out, quant_type, double_quant):
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double_quant == "true",
        bnb_4bit_compute_dtype=torch.float32,
    )
    reference(base, adapter, ids_path, out, quantization)


def qa_logits(base, adapter, ids_path, out):
    from peft import PeftModel
    from transformers import AutoModelForQuestionAnswering

    model = PeftModel.from_pretrained(AutoModelForQuestionAnswering.from_pretrained(base, dtype=torch.float32), adapter).eval()
    with torch.no_grad():
        outputs = model(input_ids=rows(ids_path))
    os.makedirs(out, exist_ok=True)
    tensors = {"start_logits": outputs.start_logits.contiguous(), "end_logits": outputs.end_logits.contiguous()}
    save_file(tensors, os.path.join(out, "reference.safetensors"))


def logits(model_dir, ids_path, out):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        result = model(input_ids=rows(ids_path)).logits
    os.makedirs(out, exist_ok=True)
    save_file({"logits": result.contiguous()}, os.path.join(out, "reference.safetensors"))


def all_linear(model_dir):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), LoraConfig(r=4, target_modules="all-linear"))
    print(" ".join(sorted(name.removeprefix("base_model.model.") for name, module in model.named_modules() if hasattr(module, "lora_A"))))


def round_to_4bit(base, quant_type, double_quant, out):
    import bitsandbytes.functional as F

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    states = {}
    with torch.no_grad():
        for name, module in model.model.layers.named_modules(prefix="model.layers"):
            if isinstance(module, torch.nn.Linear):
                weights = {"weight": module.weight}
            elif isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):
                weights = {"gate_up_proj": module.gate_up_proj, "down_proj": module.down_proj}
            else:
                continue
            for key, weight in weights.items():
                packed, state = F.quantize_4bit(weight.data, blocksize=64, quant_type=quant_type, compress_statistics=double_quant == "true")
                weight.copy_(F.dequantize_4bit(packed, state))
                states[f"{name}.{key}"] = packed
                states.update({f"{name}.{key}.{k}": v for k, v in state.as_dict(packed=True).items()})
    model.save_pretrained(out)
    # safetensors refuses tensors that share memory (the quant maps are cached).
    save_file({k: v.contiguous().clone() for k, v in states.items()}, out + ".states.safetensors")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Each option may repeat: one process (one import of torch and peft) serves a test's every case.
    parser.add_argument("--reference", nargs=4, action="append", default=[], metavar=("BASE", "ADAPTER", "IDS", "OUT"))
    parser.add_argument("--qlora", nargs=6, action="append", default=[], metavar=("BASE", "ADAPTER", "IDS", "OUT", "QUANT_TYPE", "DOUBLE_QUANT"))
    parser.add_argument("--qa-logits", nargs=4, action="append", default=[], metavar=("BASE", "ADAPTER", "IDS", "OUT"))
    parser.add_argument("--logits", nargs=3, action="append", default=[], metavar=("MODEL", "IDS", "OUT"))
    parser.add_argument("--round", nargs=4, action="append", default=[], metavar=("BASE", "QUANT_TYPE", "DOUBLE_QUANT", "OUT"))
    parser.add_argument("--all-linear", action="append", default=[], metavar="MODEL")
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    serve.main(parser, run)


def run(args):
    for job in args.round:
        round_to_4bit(*job)
    for job in args.reference:
        reference(*job)
    for job in args.qlora:
        qlora(*job)
    for job in args.qa_logits:
        qa_logits(*job)
    for job in args.logits:
        logits(*job)
    for model in args.all_linear:
        all_linear(model)


if __name__ == "__main__":
    main()
