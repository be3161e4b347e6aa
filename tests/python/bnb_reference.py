"""bitsandbytes' side of tests/qlora.rs: its 4-bit quantization (0.50.2,
`bitsandbytes.functional`, on CPU) of the inputs ft quantized, and its
reading of the state dicts ft wrote.

bnb_reference.py kernels
    prints True where bitsandbytes runs 4-bit CPU kernels of its own (a
    processor PyTorch runs at AVX512, or one with AVX512-BF16), False where
    it runs its generic path (tests/common's
    `bitsandbytes_runs_kernels_of_its_own`).

bnb_reference.py IN OUT MODEL  (or --serve: jobs from stdin, serve.py)
    IN/inputs.safetensors holds the tensors; IN/cases.json lists the cases,
    each {"name", "input", "quant_type", "double_quant", "blocksize"};
    IN/ft.safetensors holds ft's state dict of each case's weight, named
    `{name}.weight` as transformers names a linear layer's.
    For each case, `quantize_4bit` of the input and its
    `QuantState.as_dict(packed=True)` under `{name}.weight` (what
    transformers saves) go to OUT/bnb.safetensors; to
    OUT/reference.safetensors go `dequantize_4bit` of that
    (`{name}.dequantized`) and of ft's state dict as `QuantState.from_dict`
    reads it (`{name}.ft_dequantized`). And `bf16` quantized to NF4 with
    double quantization into bf16 storage (`quant_storage`, as FSDP-QLoRA
    keeps the packed bytes): its state dict under `storage.weight` to
    OUT/storage.safetensors, with its dequantization `storage.dequantized`.
    Last, the transformers model in MODEL (fp32) loaded with NF4 and double
    quantization (`BitsAndBytesConfig`, on CPU) and saved to
    OUT/transformers by `save_pretrained`: a checkpoint as users bring it,
    and its logits on MODEL/ids.json to OUT/transformers_logits.safetensors.
"""

import os

# bitsandbytes wraps its CPU fallbacks (odd last dimensions) in
# torch.compile; without a compiler pass they run as written, and quickly.
os.environ["TORCHDYNAMO_DISABLE"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402

import bitsandbytes.functional as F  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

import serve  # noqa: E402


def main(inp, out, model_dir):
    inputs = load_file(os.path.join(inp, "inputs.safetensors"))
    ft_states = load_file(os.path.join(inp, "ft.safetensors"))
    with open(os.path.join(inp, "cases.json")) as f:
        cases = json.load(f)
    state_dict, reference = {}, {}
    for case in cases:
        name, weight = case["name"], case["name"] + ".weight"
        packed, state = F.quantize_4bit(
            inputs[case["input"]],
            blocksize=case["blocksize"],
            compress_statistics=case["double_quant"],
            quant_type=case["quant_type"],
        )
        state_dict[weight] = packed
        for key, value in state.as_dict(packed=True).items():
            state_dict[f"{weight}.{key}"] = value
        reference[f"{name}.dequantized"] = F.dequantize_4bit(packed, state)
        prefix = weight + "."
        parts = {k[len(prefix):]: v for k, v in ft_states.items() if k.startswith(prefix)}
        ft_state = F.QuantState.from_dict(parts, device="cpu")
        reference[f"{name}.ft_dequantized"] = F.dequantize_4bit(ft_states[weight], ft_state)
    os.makedirs(out, exist_ok=True)
    packed, state = F.quantize_4bit(inputs["bf16"], compress_statistics=True, quant_type="nf4", quant_storage=torch.bfloat16)
    storage = {"storage.weight": packed, "storage.dequantized": F.dequantize_4bit(packed, state)}
    storage.update({f"storage.weight.{k}": v for k, v in state.as_dict(packed=True).items()})
    save_file({k: v.contiguous().clone() for k, v in storage.items()}, os.path.join(out, "storage.safetensors"))
    nf4 = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=nf4, device_map="cpu", dtype=torch.float32)
    model.save_pretrained(os.path.join(out, "transformers"))
    with open(os.path.join(model_dir, "ids.json")) as f:
        ids = torch.tensor(json.load(f))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    save_file({"logits": logits.contiguous()}, os.path.join(out, "transformers_logits.safetensors"))
    # safetensors refuses tensors that share memory (the quant maps are cached).
    save_file({k: v.contiguous().clone() for k, v in state_dict.items()}, os.path.join(out, "bnb.safetensors"))
    save_file({k: v.contiguous() for k, v in reference.items()}, os.path.join(out, "reference.safetensors"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Optional here, so that --serve alone parses; a run needs all three, or the one word `kernels`.
    parser.add_argument("job", nargs="*", metavar="IN OUT MODEL | kernels")

    def run(args):
        if args.job == ["kernels"]:
            print(torch.backends.cpu.get_cpu_capability() == "AVX512" or bool(F.has_avx512bf16()))
        elif len(args.job) == 3:
            main(*args.job)
        else:
            parser.error("give IN OUT MODEL, or kernels")

    serve.main(parser, run)
