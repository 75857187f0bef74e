#!/usr/bin/env python3
"""kiln's Muon against PyTorch's torch.optim.Muon (and AdamW for the other parameters).

Called by crates/kiln-train/tests/torch_parity.rs with a directory holding:
  inputs.safetensors  initial weights `<name>` and gradients `<name>.g1`, `<name>.g2` (kiln
                      layout: matrices [in, out])
  kiln.safetensors    kiln's weights after the two updates
  setup.json          hyper-parameters, which parameters are Muon's ("hidden") and which
                      AdamW parameters are decayed
Prints one JSON line with the largest differences:
  muon_vs_torch_bf16  kiln against torch.optim.Muon as shipped (Newton-Schulz in bf16)
  muon_vs_f64         kiln against a float64 copy of torch's _single_tensor_muon
  adamw_vs_torch      kiln's AdamW parameters against torch.optim.AdamW
"""
import json, sys
import torch
from safetensors.torch import load_file
from torch.optim import _muon

d = sys.argv[1]
setup = json.load(open(f"{d}/setup.json"))
inp = load_file(f"{d}/inputs.safetensors")
kiln = load_file(f"{d}/kiln.safetensors")
names = sorted(k for k in inp if not (k.endswith(".g1") or k.endswith(".g2")))
hidden = set(setup["hidden"])
steps = setup["steps"]


def to_torch(name, t):
    """kiln [in, out] -> torch [out, in] for linear weights; embeddings and norms as they are."""
    return t.t().contiguous() if t.ndim == 2 and "embed_tokens" not in name else t


def grads(name, step):
    return to_torch(name, inp[f"{name}.g{step}"])


# torch.optim.Muon as shipped.
muon_params = {n: torch.nn.Parameter(to_torch(n, inp[n]).clone()) for n in names if n in hidden}
muon = torch.optim.Muon(list(muon_params.values()), lr=setup["lr"], weight_decay=setup["weight_decay"],
                        momentum=setup["momentum"], nesterov=setup["nesterov"], ns_steps=setup["ns_steps"],
                        adjust_lr_fn=setup["adjust_lr_fn"])
# The same algorithm in float64 (a copy of _single_tensor_muon with the NS iteration in f64).
f64 = {n: to_torch(n, inp[n]).double().clone() for n in names if n in hidden}
bufs = {n: torch.zeros_like(p) for n, p in f64.items()}
a, b, c = _muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C
m = setup["momentum"]


def ns64(g):
    x = g.clone()
    if g.size(0) > g.size(1):
        x = x.T
    x = x / x.norm().clamp(min=_muon.EPS)
    for _ in range(setup["ns_steps"]):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.size(0) > g.size(1) else x


# AdamW for the rest, decayed as kiln decides.
adam_names = [n for n in names if n not in hidden]
adam_params = {n: torch.nn.Parameter(to_torch(n, inp[n]).clone()) for n in adam_names}
decayed = set(setup["decayed"])
groups = [{"params": [adam_params[n] for n in adam_names if n in decayed], "weight_decay": setup["weight_decay"]},
          {"params": [adam_params[n] for n in adam_names if n not in decayed], "weight_decay": 0.0}]
adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=setup["lr"], betas=tuple(setup["betas"]),
                          eps=setup["eps"], foreach=False)

for step in range(1, steps + 1):
    for n, p in muon_params.items():
        p.grad = grads(n, step).clone()
    for n, p in adam_params.items():
        p.grad = grads(n, step).clone()
    muon.step()
    adamw.step()
    for n, p in f64.items():
        g = grads(n, step).double()
        bufs[n].lerp_(g, 1 - m)
        upd = g.lerp(bufs[n], m) if setup["nesterov"] else bufs[n]
        o = ns64(upd)
        lr = _muon._adjust_lr(setup["lr"], setup["adjust_lr_fn"], p.shape)
        p.mul_(1 - setup["lr"] * setup["weight_decay"])
        p.add_(o, alpha=-lr)


def compare(ref):
    max_abs, max_rel = 0.0, 0.0
    for n, t in ref.items():
        k = to_torch(n, kiln[n]).double()
        r = t.detach().double()
        start = to_torch(n, inp[n]).double()
        max_abs = max(max_abs, float((k - r).abs().max()))
        du_k, du_r = k - start, r - start
        max_rel = max(max_rel, float((du_k - du_r).norm() / du_r.norm().clamp(min=1e-30)))
    return {"max_abs": max_abs, "max_update_rel": max_rel, "tensors": len(ref)}


print(json.dumps({
    "torch": torch.__version__,
    "muon_vs_torch_bf16": compare(muon_params),
    "muon_vs_f64": compare(f64),
    "adamw_vs_torch": compare(adam_params),
}))
