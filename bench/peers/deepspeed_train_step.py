"""DeepSpeed's ZeRO, the peer of `ft train --strategy zero2|zero3 [--offload cpu]`:
transformers' *ForCausalLM from a config.json (random weights) under
deepspeed.initialize with bf16, AdamW (DeepSpeedCPUAdam when the optimizer
is offloaded), clipping at 1.0, loss on every token of random batches.
Prints one JSON line (rank 0). DeepSpeed is not on the GPU machine:
bench/gpu/*.sh install it from carried wheels and its sdist; its op builder
needs TORCH_CUDA_ARCH_LIST=9.0.

    torchrun --nproc-per-node 2 bench/peers/deepspeed_train_step.py --config CONFIG.json --stage 3 [--offload]
"""
import argparse
import json

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from timing import record, time_steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    deepspeed.init_distributed()
    local_rank = dist.get_rank() % torch.cuda.device_count()
    torch.cuda.set_device(local_rank)
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    zero = {"stage": args.stage, "overlap_comm": True, "contiguous_gradients": True}
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}},
        "steps_per_print": 1000000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    batches = [torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda") for _ in range(4)]

    def step(i):
        ids = batches[i % len(batches)]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss

    seconds, loss = time_steps(step, args.warmup, args.steps)
    if dist.get_rank() == 0:
        name = f"deepspeed-zero{args.stage}" + ("-offload" if args.offload else "")
        print(json.dumps(record(name, dist.get_world_size(), args.batch, args.seq, seconds, loss)), flush=True)

if __name__ == "__main__":
    main()
