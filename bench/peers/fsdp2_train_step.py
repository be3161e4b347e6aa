"""PyTorch's own sharded training, the peer of `ft train --strategy …` on
several GPUs: transformers' *ForCausalLM from a config.json (random
weights), FSDP2 `fully_shard` on every decoder block and the root with
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32 or, with
--reduce-dtype bf16, bf16), optionally
`reshard_after_forward=False` (zero2-like), CPUOffloadPolicy, torch.compile,
or plain DDP with bf16 autocast; with --float8 tensorwise (fsdp2), torchao's
float8 training with float8 all-gathers as torchtitan runs it (every linear
layer but the LM head, `enable_fsdp_float8_all_gather`, the scales
precomputed after each optimizer step). AdamW, clipping at 1.0, loss on every
token of random batches. Prints one JSON line per run (rank 0).

    torchrun --nproc-per-node 2 bench/peers/fsdp2_train_step.py --config CONFIG.json \
        --mode fsdp2|ddp [--no-reshard] [--offload] [--compile] [--checkpointing] [--float8 tensorwise] --batch 8 --seq 512
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from timing import record, time_steps


def blocks(model):
    for name in ("transformer.h", "model.decoder.layers", "model.layers"):
        module = model
        try:
            for part in name.split("."):
                module = getattr(module, part)
            return list(module)
        except AttributeError:
            continue
    raise SystemExit("no decoder blocks found")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--mode", choices=["fsdp2", "ddp"], default="fsdp2")
    parser.add_argument("--no-reshard", action="store_true")
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--compile-blocks", action="store_true", help="compile each transformer block, not the whole model (torchtitan's apply_compile)")
    parser.add_argument("--float8", choices=["tensorwise"], help="torchao float8 training with float8 all-gathers (fsdp2)")
    parser.add_argument("--reduce-dtype", choices=["fp32", "bf16"], default="fp32", help="MixedPrecisionPolicy's reduce_dtype (ft's --reduce-dtype fp32|compute)")
    parser.add_argument("--checkpointing", action="store_true", help="transformers' gradient checkpointing (non-reentrant), as a user turns it on when the activations do not fit")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    backend = "cpu:gloo,cuda:nccl" if args.offload else "nccl"
    dist.init_process_group(backend, device_id=torch.device("cuda", local_rank))
    world = dist.get_world_size()
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.config)
    if args.mode == "ddp":
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).cuda().train()
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
        params = model.parameters()
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if args.checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if args.float8:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            recipe = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
            convert_to_float8_training(model, module_filter_fn=lambda _, fqn: fqn != "lm_head", config=recipe)
        reduce_dtype = torch.bfloat16 if args.reduce_dtype == "bf16" else torch.float32
        kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype),
                  "reshard_after_forward": not args.no_reshard}
        if args.offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        for block in blocks(model):
            if args.compile_blocks:
                block.compile()
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        model.to_empty(device="cpu" if args.offload else "cuda")
        with torch.no_grad():
            model.apply(lambda m: model._init_weights(m) if hasattr(model, "_init_weights") else None)
        model.train()
        params = model.parameters()
    # Fused AdamW where the parameters are on the GPU; CPU-offloaded parameters take torch's CPU AdamW.
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=not args.offload)
    # Each decoder block is its own module: compiled block by block, dynamo compiles one graph per
    # block, more than its default cache of 8 holds (past which it runs the rest eagerly).
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    forward = torch.compile(model) if args.compile else model
    batches = [torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda") for _ in range(4)]

    def step(i):
        ids = batches[i % len(batches)]
        if args.mode == "ddp":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = forward(input_ids=ids, labels=ids, use_cache=False).loss
        else:
            loss = forward(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.float8:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)
        return loss

    seconds, loss = time_steps(step, args.warmup, args.steps)
    if dist.get_rank() == 0:
        name = args.mode + ("-noreshard" if args.no_reshard else "") + ("-offload" if args.offload else "") + ("-compiled" if args.compile else "")
        name += "-blocks-compiled" if args.compile_blocks else ""
        name += "-checkpointing" if args.checkpointing else ""
        name += "-reduce-bf16" if args.reduce_dtype == "bf16" else ""
        name += f"-float8-{args.float8}" if args.float8 else ""
        print(json.dumps(record(name, world, args.batch, args.seq, seconds, loss)), flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
