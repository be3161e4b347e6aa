"""PyTorch's own torch.distributed numbers for the sizes `ft comm-test` measures.

Same method as ft: per collective and size, `--warmup` untimed runs, a device
synchronise and a barrier, `--iters` timed runs, a synchronise; the time per
run is the slowest rank's. Sizes count as nccl-tests counts them (the gathered
output of all_gather, the input of reduce_scatter), bandwidths use its formulas.

    torchrun --nproc-per-node 2 bench/peers/comm_bench.py --json torch.json
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def parse_bytes(text):
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.rstrip("iB")
    return int(text[:-1]) * scale[text[-1]] if text[-1] in scale else int(text)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,broadcast")
    parser.add_argument("--min-bytes", default="1M")
    parser.add_argument("--max-bytes", default="256M")
    parser.add_argument("--factor", type=int, default=4)
    parser.add_argument("--dtype", default="f32")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    kind = DTYPES[args.dtype]
    sizes, size = [], parse_bytes(args.min_bytes)
    while size <= parse_bytes(args.max_bytes):
        sizes.append(size)
        size *= args.factor

    rows = []
    for op in args.ops.split(","):
        for size in sizes:
            elements = size // kind.itemsize // n * n
            big = torch.rand(elements, dtype=torch.float32, device=device).to(kind)
            small = torch.rand(elements // n, dtype=torch.float32, device=device).to(kind)
            run = {
                "all_reduce": lambda: dist.all_reduce(big),
                "all_gather": lambda: dist.all_gather_into_tensor(big, small),
                "reduce_scatter": lambda: dist.reduce_scatter_tensor(small, big),
                "broadcast": lambda: dist.broadcast(big, src=n - 1),
            }[op]
            for _ in range(args.warmup):
                run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.iters):
                run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = torch.tensor([(time.perf_counter() - start) / args.iters], dtype=torch.float64, device=device)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            seconds = seconds.item()
            moved = elements * kind.itemsize
            algbw = moved / seconds / 1e9
            rows.append(dict(op=op, group="world", group_size=n, bytes=moved, elements=elements,
                             dtype=args.dtype, time_us=seconds * 1e6, algbw_gbps=algbw,
                             busbw_gbps=algbw * BUS_FACTOR[op](n), correct=None))
    if rank == 0:
        print(f"{'collective':<15} {'size':>12} {'time (us)':>12} {'algbw GB/s':>12} {'busbw GB/s':>12}")
        for r in rows:
            print(f"{r['op']:<15} {r['bytes']:>12} {r['time_us']:>12.1f} {r['algbw_gbps']:>12.2f} {r['busbw_gbps']:>12.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(tool="torch.distributed", torch=torch.__version__, backend=dist.get_backend(),
                               world_size=n, warmup=args.warmup, iters=args.iters, rows=rows), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
