"""The PyTorch side of `ft bench` on one GPU: transformers' *ForCausalLM from
a config.json with random weights, fp32 parameters, bf16 autocast, fused
AdamW, loss on every token — eager, or under torch.compile with --compile;
with --float8 RECIPE, torchao's float8 training (`convert_to_float8_training`
with that recipe on every linear layer but the LM head, as torchtitan does).

    python3 bench/peers/hf_train_step.py --config CONFIG.json --batch 8 --seq 512 [--compile] [--float8 tensorwise]
"""
import argparse
import json
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--liger", action="store_true", help="Liger Kernel's fused kernels, patched in before the model is built")
    parser.add_argument("--float8", choices=["tensorwise", "rowwise"], help="torchao float8 linear layers with this recipe")
    parser.add_argument("--json")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.config)
    if args.liger:  # its fused linear cross-entropy, RMSNorm, RoPE and SwiGLU for the model types it knows
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel
        assert config.model_type in MODEL_TYPE_TO_APPLY_LIGER_FN, f"Liger Kernel has no kernels for {config.model_type}"
        _apply_liger_kernel(config.model_type)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).cuda().train()
    if args.float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        recipe = Float8LinearConfig.from_recipe_name(args.float8)
        convert_to_float8_training(model, module_filter_fn=lambda _, fqn: fqn != "lm_head", config=recipe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=True)
    forward = torch.compile(model) if args.compile else model
    batches = [torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda") for _ in range(4)]

    def step(i):
        ids = batches[i % len(batches)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for i in range(args.warmup):
        step(i)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(args.steps):
        loss = step(i)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens_per_s = args.batch * args.seq * args.steps / seconds
    n = sum(p.numel() for p in model.parameters())
    # A mixture of experts computes with k of its E experts per token: MFU counts the active parameters.
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    idle = 0 if not experts else sum(p.numel() for name, p in model.named_parameters() if ".experts." in name) * (1 - config.num_experts_per_tok / experts)
    layers, hidden = config.num_hidden_layers, config.hidden_size
    mfu = (6 * (n - idle) + 12 * layers * hidden * args.seq) * tokens_per_s / 989e12
    peak = torch.cuda.max_memory_allocated() / 1e9
    name = f"transformers {'compiled' if args.compile else 'eager'}{' + liger' if args.liger else ''}{f' + torchao float8 {args.float8}' if args.float8 else ''}"
    print(f"{name}: {config.model_type} {n / 1e6:.0f}M params ({(n - idle) / 1e6:.0f}M active), batch {args.batch}x{args.seq}: {tokens_per_s:.0f} tokens/s, "
          f"{seconds / args.steps * 1e3:.1f} ms/step, MFU {mfu * 100:.1f}%, peak allocated {peak:.1f} GB, "
          f"peak reserved {torch.cuda.max_memory_reserved() / 1e9:.1f} GB, last loss {loss.item():.4f}")
    if args.json:
        json.dump(dict(tool=name, model_type=config.model_type, params=n, active_params=n - idle, batch=args.batch, seq=args.seq,
                       tokens_per_s=tokens_per_s, mfu=mfu, peak_allocated_gb=peak, torch=torch.__version__),
                  open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
