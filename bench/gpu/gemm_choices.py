# Which GEMMs pay, measured with PyTorch alone on one GPU (python3 bench/gpu/gemm_choices.py; $OUT/gemm_choices.json):
# (1) a mixture's expert GEMMs in float8 (rowwise, power-of-2 scales: torchao's MoE recipe) against bf16's grouped
#     GEMMs at the shapes (2 x 2048 tokens, top-8), and what the casts they need cost;
# (2) decoding's block GEMMs at 32 and 64 rows, every layer's own weights (read from HBM, not L2), replayed as one CUDA
#     graph: q/k/v and gate/up as separate GEMMs, joined, and in float8 (weights cast once, inputs each call).
import torch, json, sys, os
import torch.nn.functional as F
torch.manual_seed(0)
dev = 'cuda'; bf16 = torch.bfloat16; f8 = torch.float8_e4m3fn
out = {}
def timed(fn, iters=20, warm=3):
    for _ in range(warm): fn()
    torch.cuda.synchronize()
    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / iters

def rowwise(t, dim=-1):
    amax = t.abs().amax(dim=dim, keepdim=True).float().clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
    return (t.float() * scale).clamp(-448, 448).to(f8), scale
crowwise = torch.compile(rowwise, dynamic=False)

# ---------- (1) MoE experts ----------
for name, E, H, I, k, T in [("qwen3-30b-a3b", 128, 2048, 768, 8, 4096), ("olmoe", 64, 2048, 1024, 8, 4096)]:
    r = {}
    A = T * k
    experts = torch.rand(T, E, device=dev).topk(k, dim=1).indices.reshape(-1)
    counts = torch.bincount(experts, minlength=E)
    ends = counts.cumsum(0).to(torch.int32)
    x = torch.randn(A, H, device=dev, dtype=bf16)
    wgu = (torch.randn(E, 2 * I, H, device=dev) * 0.02).to(bf16).requires_grad_()
    wd = (torch.randn(E, H, I, device=dev) * 0.02).to(bf16).requires_grad_()
    dy = torch.randn(A, H, device=dev, dtype=bf16)
    def bf16_mlp():
        xx = x.detach().requires_grad_()
        h = torch._grouped_mm(xx, wgu.transpose(-2, -1), offs=ends)
        g = F.silu(h[:, :I]) * h[:, I:]
        y = torch._grouped_mm(g, wd.transpose(-2, -1), offs=ends)
        y.backward(dy)
    r["bf16_mlp_fwd_bwd_ms"] = timed(bf16_mlp)
    def measure(key, fn):
        try:
            r[key] = timed(fn)
        except Exception as e:
            r[key.replace("_ms", "_error")] = str(e)[:300]
    # Forward GEMMs alone, bf16, over inputs made before the timing.
    xi = x[:, :I].contiguous()
    def bf16_fwd():
        torch._grouped_mm(x, wgu.detach().transpose(-2, -1), offs=ends)
        torch._grouped_mm(xi, wd.detach().transpose(-2, -1), offs=ends)
    measure("bf16_fwd_gemms_ms", bf16_fwd)
    # fp8: operands pre-cast (GEMM lower bound)
    xg, sx = rowwise(x)
    xd, sxd = rowwise(xi)
    wgu8, swgu = rowwise(wgu.detach())            # [E,2I,H] along K=H
    wd8, swd = rowwise(wd.detach())               # [E,H,I] along K=I
    def fp8_fwd():
        torch._scaled_grouped_mm(xg, wgu8.transpose(-2, -1), sx.squeeze(-1).reciprocal(), swgu.squeeze(-1).reciprocal(), ends, out_dtype=bf16, use_fast_accum=True)
        torch._scaled_grouped_mm(xd, wd8.transpose(-2, -1), sxd.squeeze(-1).reciprocal(), swd.squeeze(-1).reciprocal(), ends, out_dtype=bf16, use_fast_accum=True)
    measure("fp8_fwd_gemms_ms", fp8_fwd)
    # dX in fp8: g [A,N] @ W_e [N,K], B column-major: [E,K,N] contiguous
    gu = torch.randn(A, 2 * I, device=dev, dtype=bf16); gd = dy
    gu8, sgu = rowwise(gu); gd8, sgd = rowwise(gd)
    wguT8, swguT = rowwise(wgu.detach().transpose(-2, -1).contiguous())   # [E,H,2I] along 2I
    wdT8, swdT = rowwise(wd.detach().transpose(-2, -1).contiguous())      # [E,I,H] along H
    def fp8_dx():
        torch._scaled_grouped_mm(gu8, wguT8.transpose(-2, -1), sgu.squeeze(-1).reciprocal(), swguT.squeeze(-1).reciprocal(), ends, out_dtype=bf16, use_fast_accum=True)
        torch._scaled_grouped_mm(gd8, wdT8.transpose(-2, -1), sgd.squeeze(-1).reciprocal(), swdT.squeeze(-1).reciprocal(), ends, out_dtype=bf16, use_fast_accum=True)
    measure("fp8_dx_gemms_ms", fp8_dx)
    def bf16_dx():
        torch._grouped_mm(gu, wgu.detach(), offs=ends)
        torch._grouped_mm(gd, wd.detach(), offs=ends)
    measure("bf16_dx_gemms_ms", bf16_dx)
    # dW 2d-2d: g^T [N, A] @ x [A, K] grouped along A
    def bf16_dw():
        torch._grouped_mm(gu.t(), x, offs=ends)
        torch._grouped_mm(gd.t(), xi, offs=ends)
    measure("bf16_dw_gemms_ms", bf16_dw)
    # casts per step with compiled rowwise: weights both ways (fwd rowwise along K, bwd along N), activations, grads
    def casts():
        crowwise(wgu.detach()); crowwise(wd.detach())
        crowwise(wgu.detach().transpose(-2, -1)); crowwise(wd.detach().transpose(-2, -1))
        crowwise(x); crowwise(gu); crowwise(gd); crowwise(xi)
    measure("fp8_casts_compiled_ms", casts)
    out["moe_" + name] = r
    print(name, json.dumps(r), flush=True)
    del wgu, wd, wgu8, wd8, wguT8, wdT8
    torch.cuda.empty_cache()

# ---------- (2) decode GEMMs ----------
def decode(name, H, q, kv, I, layers):
    res = {}
    for M in (32, 64):
        x = torch.randn(M, H, device=dev, dtype=bf16)
        xi = torch.randn(M, I, device=dev, dtype=bf16)
        sep = [[(torch.randn(n, kdim, device=dev) * 0.02).to(bf16) for n, kdim in [(q, H), (kv, H), (kv, H), (H, q), (I, H), (I, H), (H, I)]] for _ in range(layers)]
        joined = [[torch.cat(l[0:3]), l[3], torch.cat(l[4:6]), l[6]] for l in sep]
        def run_sep():
            for l in sep:
                for w in l:
                    (x if w.shape[1] == H else (xi if w.shape[1] == I else x[:, :q])) @ w.t()
        def run_joined():
            for l in joined:
                for w in l:
                    (x if w.shape[1] == H else (xi if w.shape[1] == I else x[:, :q])) @ w.t()
        def graph_ms(fn):
            s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            return timed(g.replay)
        res[f"M{M}_bf16_separate_ms"] = graph_ms(run_sep)
        res[f"M{M}_bf16_joined_ms"] = graph_ms(run_joined)
        wbytes = sum(w.numel() * 2 for l in joined for w in l)
        res["weight_GB_bf16"] = wbytes / 1e9
        del sep
        q8 = [[rowwise(w) for w in l] for l in joined]
        def run_fp8_rowwise():
            for l in q8:
                for w8, sw in l:
                    a = x if w8.shape[1] == H else (xi if w8.shape[1] == I else x[:, :q])
                    a8, sa = rowwise(a)
                    torch._scaled_mm(a8, w8.t(), sa.reciprocal(), sw.reciprocal().t(), out_dtype=bf16, use_fast_accum=True)
        def run_fp8_gemm_only():
            a8s = {H: rowwise(x), I: rowwise(xi), q: rowwise(x[:, :q].contiguous())}
            for l in q8:
                for w8, sw in l:
                    a8, sa = a8s[w8.shape[1]]
                    torch._scaled_mm(a8, w8.t(), sa.reciprocal(), sw.reciprocal().t(), out_dtype=bf16, use_fast_accum=True)
        try:
            res[f"M{M}_fp8_rowwise_eager_casts_ms"] = graph_ms(run_fp8_rowwise)
            res[f"M{M}_fp8_rowwise_gemm_only_ms"] = graph_ms(run_fp8_gemm_only)
        except Exception as e:
            res["fp8_error"] = str(e)[:300]
        del q8, joined
        torch.cuda.empty_cache()
    out["decode_" + name] = res
    print(name, json.dumps(res), flush=True)

decode("qwen2.5-1.5b", 1536, 1536, 256, 8960, 28)
decode("llama-7b", 4096, 4096, 4096, 11008, 32)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "gemm_choices.json"), "w"), indent=1)
