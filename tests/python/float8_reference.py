"""torchao's side of tests/float8.rs: its float8 training functions
(torchao 0.18, `torchao.float8`) on the inputs ft used, emulated on CPU.

--casts IN OUT
    IN/inputs.safetensors holds `x` (2-D, fp32). For each float8 kind
    (e4m3, e5m2), scaling (tensorwise, rowwise along dim -1 and 0) and
    power-of-2 rounding: `tensor_to_scale`'s scale and the cast's data as
    fp32 (`hp_tensor_and_scale_to_float8`), keyed `{kind}.{dim}.{pow2}.scale`
    / `.data`, written to OUT/reference.safetensors.
--linear IN OUT
    IN/inputs.safetensors holds `x` [.., in], `weight` [out, in], `bias`,
    `grad` (the output's gradient) in one dtype. For each recipe
    (tensorwise, rowwise): an emulated `Float8Linear` (from an nn.Linear
    holding weight and bias) forward and backward; `{recipe}.out`,
    `.grad_x`, `.grad_weight`, `.grad_bias` to OUT/reference.safetensors.
--llama-step MODEL IDS RECIPE OUT
    The transformers causal LM in MODEL (fp32) with its blocks' linear
    layers converted by `convert_to_float8_training` (emulated; the LM head
    stays in fp32); one training step on the rows of IDS (labels = ids):
    the loss, every parameter's gradient (`grad.<name>`), then
    torch.optim.AdamW(lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
    weight_decay=0) and every parameter after it (`after.<name>`).
"""

import argparse
import dataclasses
import json
import os

import serve
import torch
from safetensors.torch import load_file, save_file
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.float8.config import ScalingGranularity
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
from torchao.float8.float8_utils import tensor_to_scale

KINDS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def emulated(recipe):
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)


def save(tensors, out):
    os.makedirs(out, exist_ok=True)
    save_file({k: t.detach().contiguous() for k, t in tensors.items()}, os.path.join(out, "reference.safetensors"))


def casts(inputs, out):
    x = load_file(os.path.join(inputs, "inputs.safetensors"))["x"]
    tensors = {}
    for kind, dtype in KINDS.items():
        for dim in ["none", "-1", "0"]:
            for pow2 in [False, True]:
                granularity = ScalingGranularity.TENSORWISE if dim == "none" else ScalingGranularity.AXISWISE
                axis = None if dim == "none" else int(dim)
                scale = tensor_to_scale(x, dtype, scaling_granularity=granularity, axiswise_dim=axis, round_scales_to_power_of_2=pow2)
                data = hp_tensor_and_scale_to_float8(x, scale, dtype, axiswise_dim=axis)._data
                key = f"{kind}.{dim}.{str(pow2).lower()}"
                tensors[key + ".scale"] = scale
                tensors[key + ".data"] = data.float()
    save(tensors, out)


def linear(inputs, out):
    t = load_file(os.path.join(inputs, "inputs.safetensors"))
    tensors = {}
    for recipe in ["tensorwise", "rowwise"]:
        base = torch.nn.Linear(t["weight"].shape[1], t["weight"].shape[0], dtype=t["weight"].dtype)
        with torch.no_grad():
            base.weight.copy_(t["weight"])
            base.bias.copy_(t["bias"])
        layer = Float8Linear.from_float(base, config=emulated(recipe))
        x = t["x"].clone().requires_grad_(True)
        y = layer(x)
        y.backward(t["grad"])
        tensors[f"{recipe}.out"] = y
        tensors[f"{recipe}.grad_x"] = x.grad
        tensors[f"{recipe}.grad_weight"] = layer.weight.grad
        tensors[f"{recipe}.grad_bias"] = layer.bias.grad
    save(tensors, out)


def llama_step(model_dir, ids_path, recipe, out):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    convert_to_float8_training(model, module_filter_fn=lambda _, fqn: fqn.startswith("model.layers."), config=emulated(recipe))
    assert not isinstance(model.lm_head, Float8Linear)
    with open(ids_path) as f:
        ids = torch.tensor(json.load(f))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    tensors = {"loss": loss}
    for name, parameter in model.named_parameters():
        tensors["grad." + name] = parameter.grad
    torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0).step()
    for name, parameter in model.named_parameters():
        tensors["after." + name] = parameter
    save(tensors, out)


def run(args):
    if not (args.casts or args.linear or args.llama_step):
        raise SystemExit("give --casts, --linear or --llama-step (each given one runs)")
    if args.casts:
        casts(*args.casts)
    if args.linear:
        linear(*args.linear)
    if args.llama_step:
        llama_step(*args.llama_step)


if __name__ == "__main__":
    from transformers.utils import logging

    logging.disable_progress_bar()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--casts", nargs=2, metavar=("IN", "OUT"))
    parser.add_argument("--linear", nargs=2, metavar=("IN", "OUT"))
    parser.add_argument("--llama-step", nargs=4, metavar=("MODEL", "IDS", "RECIPE", "OUT"))
    serve.main(parser, run)
