"""Parity of ft's models with transformers (the reference implementation).

For each model directory (made by `ft init-model`), loads it in transformers
and in ft (`ft forward`, `ft generate`), on the same token ids, and compares:
logits in fp32 and bf16, the LM loss's gradient for every parameter (fp32),
and 32 greedy tokens. Prints one table; exits non-zero if a bound is missed.

    python3 bench/parity/parity.py --ft target/release/ft --device cuda MODEL_DIR...

With --write-fixtures DIR it also stores transformers' outputs next to each
model, as the CPU tests' reference (tests/fixtures/).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

BOUNDS = {"logits_f32": 1e-4, "logits_bf16": 2e-2, "grads_f32": 1e-3}


def relative(a, b, floor=0.0):
    """max |a - b| / max |b|: the bound the issue states. `floor` keeps
    gradients that are zero by mathematics (a key bias: softmax ignores a
    per-row shift) from dividing rounding noise by rounding noise."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(max(floor, 1e-30))).item()


def hf_reference(model_dir, ids, dtype, device, grads, generate=True):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").to(device)
    model.eval()
    ids_t = torch.tensor(ids, device=device)
    with torch.set_grad_enabled(grads):
        out = model(input_ids=ids_t, labels=ids_t)
    result = {"logits": out.logits.float().detach().cpu(), "loss": out.loss.float().detach().cpu()}
    if grads:
        out.loss.backward()
        names = dict(model.named_parameters())
        for name, param in names.items():
            result["grad." + name] = param.grad.float().cpu()
    if not generate:
        return result
    with torch.no_grad():
        prompt = ids_t[:1, :8]
        # No EOS: 32 tokens always (min_new_tokens would instead forbid the EOS token).
        model.generation_config.eos_token_id = None
        # An explicit mask: otherwise generate treats prompt tokens equal to pad_token_id as padding.
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32,
                                   do_sample=False, pad_token_id=0)
    result["generated"] = generated[0, prompt.shape[1]:].cpu()
    return result


def ft_outputs(ft, model_dir, ids, dtype, device, grads, work):
    ids_path = os.path.join(work, "ids.json")
    json.dump(ids, open(ids_path, "w"))
    out = os.path.join(work, f"ft-{dtype}.safetensors")
    cmd = [ft, "forward", "--model", model_dir, "--ids", ids_path, "--dtype", dtype, "--device", device, "--out", out]
    if grads:
        cmd.append("--grads")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    result = load_file(out)
    prompt = ",".join(str(i) for i in ids[0][:8])
    text = subprocess.run([ft, "generate", "--model", model_dir, "--ids", prompt, "--max-new-tokens", "32",
                           "--eos=-1", "--dtype", dtype, "--device", device],
                          check=True, capture_output=True, text=True).stdout
    result["generated"] = torch.tensor(json.loads(text.strip().splitlines()[-1]))
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="+")
    parser.add_argument("--ft", default="target/release/ft")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--f64", action="store_true",
                        help="also compare both fp32 gradients with transformers in float64 (the ground truth)")
    parser.add_argument("--write-fixtures", action="store_true",
                        help="store transformers' fp32 outputs as <model>/reference.safetensors + ids.json")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    failed = False
    print(f"{'model':<28} {'logits f32':>11} {'logits bf16':>12} {'grads f32':>10} {'loss ft':>10} {'loss hf':>10} {'greedy 32':>10}")
    for model_dir in args.models:
        config = json.load(open(os.path.join(model_dir, "config.json")))
        ids = torch.randint(0, config["vocab_size"], (args.batch, args.seq)).tolist()
        with tempfile.TemporaryDirectory() as work:
            ref32 = hf_reference(model_dir, ids, torch.float32, args.device, grads=True)
            ours32 = ft_outputs(args.ft, model_dir, ids, "f32", args.device, True, work)
            ref16 = hf_reference(model_dir, ids, torch.bfloat16, args.device, grads=False)
            # The ground truth both fp32 implementations approximate.
            ref64 = hf_reference(model_dir, ids, torch.float64, args.device, grads=True, generate=False) if args.f64 else None
            ours16 = ft_outputs(args.ft, model_dir, ids, "bf16", args.device, False, work)
        tied = config.get("tie_word_embeddings", config["model_type"] in ("bloom", "opt"))
        grad_errors = {}
        # 1e-3 of the largest gradient: the scale below which a parameter's gradient is noise.
        floor = 1e-3 * max(g.abs().max().item() for k, g in ref32.items() if k.startswith("grad."))
        for name, grad in ref32.items():
            if not name.startswith("grad."):
                continue
            if name == "grad.lm_head.weight" and tied:
                continue  # the same tensor as the embedding's, already compared
            grad_errors[name] = relative(ours32[name], grad, floor)
        worst_grad = max(grad_errors, key=grad_errors.get)
        truth = ""
        if ref64 is not None:
            ft_vs_64 = max(relative(ours32[n], ref64[n], floor) for n in grad_errors)
            hf_vs_64 = max(relative(ref32[n], ref64[n], floor) for n in grad_errors)
            truth = f"  grads vs fp64: ft {ft_vs_64:.2e}, transformers {hf_vs_64:.2e}"
        errors = {
            "logits_f32": relative(ours32["logits"], ref32["logits"]),
            "logits_bf16": relative(ours16["logits"], ref16["logits"]),
            "grads_f32": grad_errors[worst_grad],
        }
        same_tokens = bool(torch.equal(ours32["generated"], ref32["generated"]))
        ok = all(errors[k] <= BOUNDS[k] for k in BOUNDS) and same_tokens
        failed |= not ok
        print(f"{os.path.basename(model_dir.rstrip('/')):<28} {errors['logits_f32']:>11.2e} {errors['logits_bf16']:>12.2e} "
              f"{errors['grads_f32']:>10.2e} {ours32['loss'].item():>10.5f} {ref32['loss'].item():>10.5f} "
              f"{'same' if same_tokens else 'DIFFERENT':>10}{'' if ok else '  <-- FAIL (worst grad ' + worst_grad + ')'}{truth}")
        if args.write_fixtures:
            json.dump(ids, open(os.path.join(model_dir, "ids.json"), "w"))
            keep = {k: v.contiguous() for k, v in ref32.items() if not (k == "grad.lm_head.weight" and tied)}
            save_file(keep, os.path.join(model_dir, "reference.safetensors"))
    print("bounds:", BOUNDS, "and identical greedy tokens")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
