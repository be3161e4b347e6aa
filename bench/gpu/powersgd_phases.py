"""Where PowerSGD's time goes on BLOOM-560m's gradients: the ATen ops
plugins/comm/powersgd runs, phase by phase (each timed between
synchronisations, median of 5 after a warm-up), on one GPU. The
orthonormalisation three ways: one QR per matrix, a batched QR per shape,
and batched Gram-Schmidt (torch's powerSGD_hook's way).

    python3 bench/gpu/powersgd_phases.py --config bloom-560m/config.json [--rank 4]
"""
import argparse
import json
import statistics
import time

import torch


def timed(fn, repeats=5):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def gram_schmidt(p):
    # p: [g, n, r], orthonormal columns in place.
    for i in range(p.shape[2]):
        col = p[:, :, i : i + 1]
        col /= col.norm(dim=1, keepdim=True) + 1e-8
        if i + 1 < p.shape[2]:
            rest = p[:, :, i + 1 :]
            rest -= col @ (col.transpose(1, 2) @ rest)
    return p


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--rank", type=int, default=4)
    args = parser.parse_args()
    c = json.load(open(args.config))
    h, layers, vocab, r = c["hidden_size"], c["n_layer"], c["vocab_size"], args.rank
    shapes = [(vocab, h)] + [s for _ in range(layers) for s in [(3 * h, h), (h, h), (4 * h, h), (h, 4 * h)]]
    ms = [torch.randn(n, m, device="cuda") for n, m in shapes]
    qs = [torch.randn(m, r, device="cuda") for n, m in shapes]
    total = sum(m.numel() for m in ms)
    print(f"{len(ms)} matrices, {total / 1e6:.0f}M elements, rank {r}")
    ps = [m @ q for m, q in zip(ms, qs)]
    rows = {}
    rows["copy the gradient + add the error"] = timed(lambda: [m.clone().add_(m) for m in ms])
    rows["P = M Q (every matrix)"] = timed(lambda: [m @ q for m, q in zip(ms, qs)])
    rows["cat P for one all-reduce"] = timed(lambda: torch.cat([p.reshape(-1) for p in ps]))
    rows["QR, one per matrix"] = timed(lambda: [torch.linalg.qr(p)[0] for p in ps])
    groups = {}
    for p in ps:
        groups.setdefault(p.shape, []).append(p)
    rows["QR, batched per shape"] = timed(lambda: [torch.linalg.qr(torch.stack(g))[0] for g in groups.values()])
    rows["QR of the embedding's P alone"] = timed(lambda: torch.linalg.qr(ps[0])[0])
    rows["Gram-Schmidt, batched per shape"] = timed(lambda: [gram_schmidt(torch.stack(g)) for g in groups.values()])
    rows["Q = M^T P (every matrix)"] = timed(lambda: [m.t() @ p for m, p in zip(ms, ps)])
    sum_buffer = torch.empty(total, device="cuda")

    def decompress():
        at = 0
        for m, p, q in zip(ms, ps, qs):
            sum_buffer[at : at + m.numel()].copy_((p @ q.t()).reshape(-1))
            at += m.numel()

    rows["decompress P Q^T into the sum"] = timed(decompress)
    flat = torch.randn(total, device="cuda")
    rows["error = x - sum / N"] = timed(lambda: flat - sum_buffer / 2)
    rows["output.copy_(sum)"] = timed(lambda: flat.copy_(sum_buffer))
    for name, ms_ in rows.items():
        print(f"| {name} | {ms_:.2f} |")


if __name__ == "__main__":
    main()
