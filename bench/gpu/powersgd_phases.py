"""Where PowerSGD's time goes on BLOOM-560m's gradients, and what each
phase costs done another way: the ATen ops plugins/comm/powersgd can run,
phase by phase (each timed between synchronisations, median of 7 after a
warm-up), on one GPU, fp32 gradients, rank 4.

- P = M Q and Q = Mᵀ P̂ as one matmul, or split along the summed dimension
  into a batched matmul and a sum (more thread blocks for thin outputs);
- orthonormalising the P's: batched Householder QR per shape, or
  CholeskyQR2 (Gram matrix, Cholesky, triangular solve, twice);
- the decompressed sum and the error: a matmul into a new tensor copied into
  place and `x - sum / N`, or `mm(out=)` into place and `addmm_` on x in place.

    python3 bench/gpu/powersgd_phases.py --config bloom-560m/config.json [--rank 4] [--json F]
"""
import argparse
import json
import statistics
import time

import torch


def timed(fn, repeats=7):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def splits(out_rows, summed, target):
    """Pieces to cut a summed dimension into: powers of two, each piece at
    least 256 long, until the output's 128-row tiles times the pieces reach
    `target` thread blocks."""
    s = 1
    while -(-out_rows // 128) * s < target and summed % (2 * s) == 0 and summed // (2 * s) >= 256:
        s *= 2
    return s


def m_q(m, q, target):
    n, k = m.shape
    s = splits(n, k, target) if target else 1
    if s == 1:
        return m @ q
    return torch.bmm(m.view(n, s, k // s).transpose(0, 1), q.view(s, k // s, -1)).sum(0)


def mt_p(m, p, target):
    n, k = m.shape
    s = splits(k, n, target) if target else 1
    if s == 1:
        return m.t() @ p
    return torch.bmm(m.view(s, n // s, k).transpose(1, 2), p.view(s, n // s, -1)).sum(0)


def householder(p):
    return torch.linalg.qr(p)[0]


def cholesky_qr2(p):
    # p: [g, n, r]. Twice: G = PᵀP, L = chol(G + tiny ridge), P ← P L⁻ᵀ.
    for _ in range(2):
        gram = p.transpose(1, 2) @ p
        ridge = 1e-6 * gram.diagonal(dim1=1, dim2=2).sum(-1).clamp_min(1e-30)
        gram = gram + ridge[:, None, None] * torch.eye(p.shape[2], device=p.device)
        lower = torch.linalg.cholesky_ex(gram)[0]
        p = torch.linalg.solve_triangular(lower.transpose(1, 2), p, upper=True, left=False)
    return p


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--json")
    args = parser.parse_args()
    c = json.load(open(args.config))
    h, layers, vocab, r = c["hidden_size"], c["n_layer"], c["vocab_size"], args.rank
    shapes = [(vocab, h)] + [s for _ in range(layers) for s in [(3 * h, h), (h, h), (4 * h, h), (h, 4 * h)]]
    total = sum(n * m for n, m in shapes)
    flat_g = torch.randn(total, device="cuda")
    flat_e = torch.randn(total, device="cuda") * 0.1
    flat_out = torch.empty(total, device="cuda")
    views = lambda flat: [v.view(n, m) for v, (n, m) in zip(flat.split([n * m for n, m in shapes]), shapes)]
    ms, outs, errs = views(flat_g), views(flat_out), views(flat_e)
    qs = [torch.randn(m, r, device="cuda") for n, m in shapes]
    ps = [m @ q for m, q in zip(ms, qs)]
    groups = {}
    for p in ps:
        groups.setdefault(p.shape, []).append(p)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}: {len(ms)} matrices, {total / 1e6:.0f}M elements, rank {r}, {sms} SMs")
    copy_ms = timed(lambda: flat_out.copy_(flat_g))
    print(f"one fp32 copy of the gradient: {copy_ms:.2f} ms ({2 * 4 * total / copy_ms / 1e9:.2f} TB/s)")

    # Every variant gives the same numbers (to fp32 rounding) as the plain op.
    for target in (4 * sms, 8 * sms):
        for a, b in ((m_q(m, q, target), m @ q) for m, q in zip(ms[:5], qs[:5])):
            assert torch.allclose(a, b, rtol=1e-3, atol=1e-2), (a - b).abs().max()
    for g in groups.values():
        p = torch.stack(g)
        basis = cholesky_qr2(p)
        assert (basis.transpose(1, 2) @ basis - torch.eye(r, device="cuda")).abs().max() < 1e-4
        assert (basis @ (basis.transpose(1, 2) @ p) - p).abs().max() / p.abs().max() < 1e-4

    rows = {}
    rows["error += gradient (in place)"] = timed(lambda: flat_e.add_(flat_g))
    rows["x = gradient + error (into a new buffer)"] = timed(lambda: torch.add(flat_g, flat_e, out=flat_out))
    for name, target in (("one matmul", 0), (f"split, {4 * sms} blocks", 4 * sms), (f"split, {8 * sms} blocks", 8 * sms)):
        rows[f"P = M Q, {name}"] = timed(lambda: [m_q(m, q, target) for m, q in zip(ms, qs)])
        rows[f"Q = Mᵀ P, {name}"] = timed(lambda: [mt_p(m, p, target) for m, p in zip(ms, ps)])
    rows["orthonormalise: Householder QR, batched per shape"] = timed(lambda: [householder(torch.stack(g)) for g in groups.values()])
    rows["orthonormalise: CholeskyQR2, batched per shape"] = timed(lambda: [cholesky_qr2(torch.stack(g)) for g in groups.values()])
    rows["decompress: matmul, then copy into place"] = timed(lambda: [o.copy_(p @ q.t()) for o, p, q in zip(outs, ps, qs)])
    rows["decompress: mm(out=) into place"] = timed(lambda: [torch.mm(p, q.t(), out=o) for o, p, q in zip(outs, ps, qs)])
    rows["error = x - sum / N (new tensors, copied back)"] = timed(lambda: flat_e.copy_(flat_g - flat_out / 2))
    rows["error: addmm_ on x in place"] = timed(lambda: [e.addmm_(p, q.t() * -0.5) for e, p, q in zip(errs, ps, qs)])
    for name, value in rows.items():
        print(f"| {name} | {value:.2f} |")
    if args.json:
        json.dump({"device": torch.cuda.get_device_name(0), "copy_ms": copy_ms, "phases_ms": rows}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
