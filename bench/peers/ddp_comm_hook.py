"""The PyTorch anchor for ft's communication hooks: transformers' BLOOM (a
config.json, random weights) under DistributedDataParallel on one GPU (or,
under torchrun, on each of several), bf16
autocast, fused AdamW, with no hook, torch's bf16_compress_hook, or its
powerSGD_hook (rank 4, error feedback, warm start). Prints each one's step
time and the share it adds to the plain step.

    python3 bench/peers/ddp_comm_hook.py --config CONFIG.json --batch 8 --seq 512
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoConfig, AutoModelForCausalLM


def step_ms(config, hook, batch, seq, warmup, steps):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).cuda().train()
    ddp = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
    if hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook == "powersgd":
        # torch requires start_powerSGD_iter > 1 with error feedback or warm start.
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                                            use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    batches = [torch.randint(0, config.vocab_size, (batch, seq), device="cuda") for _ in range(4)]

    def one(i):
        ids = batches[i % len(batches)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for i in range(warmup):
        one(i)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        one(i)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / steps * 1e3
    del ddp, model, optimizer
    torch.cuda.empty_cache()
    return ms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    # One process, or as many as torchrun starts.
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dist.init_process_group("nccl", rank=rank, world_size=world)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    config = AutoConfig.from_pretrained(args.config)
    rows = {hook: step_ms(config, hook, args.batch, args.seq, args.warmup, args.steps) for hook in ["none", "bf16", "powersgd"]}
    for hook in ["bf16", "powersgd"]:
        if rank == 0:
            print(f"torch DDP on {world} GPU(s) + {hook} hook: {rows[hook]:.1f} ms/step vs {rows['none']:.1f} without: +{(rows[hook] / rows['none'] - 1) * 100:.1f}%")
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
