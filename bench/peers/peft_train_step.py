"""The PyTorch side of `ft bench --lora-r` on one GPU: transformers'
*ForCausalLM from a config.json with random weights held in bf16 (the frozen
base as peft users hold it), wrapped by peft's get_peft_model with LoRA
adapters (fp32: peft's autocast_adapter_dtype default), bf16 autocast, fused
AdamW and clipping 1.0 over the trainable parameters only, loss on every
token — eager, or under torch.compile with --compile. With --qlora, QLoRA as
transformers + bitsandbytes run it: every linear layer of the blocks a
bitsandbytes `Linear4bit` (NF4, double quantization, bf16 compute),
quantized from the random bf16 weights on the GPU before peft wraps them.

    python3 bench/peers/peft_train_step.py --config CONFIG.json --batch 2 --seq 2048 [--compile] \
        [--lora-r 16] [--lora-alpha 32] [--targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]
        [--target-parameters mlp.experts.gate_up_proj,mlp.experts.down_proj]

--target-parameters adapts parameters rather than modules (peft's
`target_parameters`: a mixture of experts' fused experts in transformers v5).

MFU counts the FLOPs a LoRA step does: 4·N per token for the frozen weights
(forward, and the gradient of the activations only), 6·N for the trainable
ones, plus 12·L·d·S for attention (PaLM's formula), over 989 TFLOP/s;
a mixture of experts' expert weights count k/E of their number (the active ones).
"""
import argparse
import json
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

ALL_LINEAR = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def quantize_blocks(model, device):
    """Each nn.Linear of the decoder layers replaced by a bitsandbytes NF4
    Linear4bit holding its weight (what `BitsAndBytesConfig(load_in_4bit=True,
    bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
    bnb_4bit_compute_dtype=torch.bfloat16)` loads)."""
    import bitsandbytes as bnb

    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if not isinstance(child, torch.nn.Linear):
                    continue
                quantized = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                              compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                                              device="meta")
                quantized.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=True,
                                                     quant_type="nf4").to(device)
                if child.bias is not None:
                    quantized.bias = child.bias
                setattr(parent, name, quantized)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--liger", action="store_true", help="Liger Kernel's fused kernels, patched in before the model is built")
    parser.add_argument("--json")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--lora-alpha", type=float, default=32)
    parser.add_argument("--targets", default=ALL_LINEAR)
    parser.add_argument("--target-parameters", default="", help="comma-separated parameter names (peft's target_parameters)")
    parser.add_argument("--qlora", action="store_true", help="the blocks' linear layers as bitsandbytes NF4 Linear4bit (double quantization, bf16 compute)")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # `--device cpu`: a smoke test
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.config)
    if args.liger:  # its fused linear cross-entropy, RMSNorm, RoPE and SwiGLU for the model types it knows
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel
        assert config.model_type in MODEL_TYPE_TO_APPLY_LIGER_FN, f"Liger Kernel has no kernels for {config.model_type}"
        _apply_liger_kernel(config.model_type)
    with device:  # random init on the device itself: seconds for 7B on a GPU, minutes on the host
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if args.qlora:
        quantize_blocks(model, device)
    lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                      target_modules=args.targets.split(","), task_type="CAUSAL_LM",
                      target_parameters=[p for p in args.target_parameters.split(",") if p] or None)
    model = get_peft_model(model, lora).to(device).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    dtypes = sorted({str(p.dtype) for p in trainable})
    assert dtypes == ["torch.float32"], f"trainable parameters are {dtypes}, expected fp32 adapters"
    frozen_dtypes = sorted({str(p.dtype) for p in model.parameters() if not p.requires_grad})
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0, fused=True)
    forward = torch.compile(model) if args.compile else model
    batches = [torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device) for _ in range(4)]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def step(i):
        ids = batches[i % len(batches)]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for i in range(args.warmup):
        step(i)
    sync()
    start = time.perf_counter()
    for i in range(args.steps):
        loss = step(i)
    sync()
    seconds = time.perf_counter() - start
    tokens_per_s = args.batch * args.seq * args.steps / seconds
    # A 4-bit weight's parameter is its packed bytes; its quant state knows the weight's shape.
    n = sum(p.quant_state.shape.numel() if getattr(p, "quant_state", None) is not None else p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in trainable)
    # A mixture of experts runs k of its E experts per token: its experts' parameters count k/E of their number.
    experts, active = getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0), getattr(config, "num_experts_per_tok", 0)
    if experts and active:
        n -= sum(p.numel() for name, p in model.named_parameters() if ".experts." in name and "lora" not in name) * (1 - active / experts)
    layers, hidden = config.num_hidden_layers, config.hidden_size
    mfu = (4 * (n - n_trainable) + 6 * n_trainable + 12 * layers * hidden * args.seq) * tokens_per_s / 989e12
    peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0
    reserved = torch.cuda.max_memory_reserved() / 1e9 if cuda else 0.0
    name = f"peft{' + bitsandbytes nf4' if args.qlora else ''} {'compiled' if args.compile else 'eager'}{' + liger' if args.liger else ''}"
    print(f"{name}: {config.model_type} {n / 1e6:.0f}M params ({', '.join(frozen_dtypes)} frozen), "
          f"LoRA r={args.lora_r} alpha={args.lora_alpha:g} on {args.targets} {args.target_parameters}: "
          f"{n_trainable / 1e6:.2f}M trainable params ({', '.join(dtypes)}), batch {args.batch}x{args.seq}: "
          f"{tokens_per_s:.0f} tokens/s, {seconds / args.steps * 1e3:.1f} ms/step, MFU {mfu * 100:.1f}%, "
          f"peak allocated {peak:.1f} GB, peak reserved {reserved:.1f} GB, last loss {loss.item():.4f}")
    if args.json:
        import peft
        import transformers
        json.dump(dict(tool=name, model_type=config.model_type, params=n, trainable_params=n_trainable,
                       lora_r=args.lora_r, lora_alpha=args.lora_alpha, targets=args.targets, target_parameters=args.target_parameters, batch=args.batch,
                       seq=args.seq, tokens_per_s=tokens_per_s, step_ms=seconds / args.steps * 1e3, mfu=mfu,
                       peak_allocated_gb=peak, peak_reserved_gb=reserved, loss=loss.item(), torch=torch.__version__,
                       transformers=transformers.__version__, peft=peft.__version__),
                  open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
