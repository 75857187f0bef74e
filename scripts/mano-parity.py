#!/usr/bin/env python3
"""kiln's Mano against the authors' step (`mano.py` of "Mano: Restriking Manifold
Optimization for LLM Training", the paper's version), rewritten here in torch since it is
not packaged: heavy-ball momentum, the tangent projection onto the unit sphere of each
column (even steps) or row (odd steps) of the [out, in] weight, the same-axis normalisation,
decay, and the step scaled by 0.2 sqrt(n_k); the embeddings, norms and head by
torch.optim.AdamW (kiln runs its AdamW there, as under Muon; the authors' own AdamW differs
from it only in where eps sits).

Called by crates/kiln-train/tests/suite/torch_parity.rs with a directory holding
inputs.safetensors (weights `<name>`, gradients `<name>.g<k>`), kiln.safetensors (kiln's
weights after the updates) and setup.json. Prints one JSON line.
"""
import json, math, sys
import torch
from safetensors.torch import load_file

d = sys.argv[1]
setup = json.load(open(f"{d}/setup.json"))
inp = load_file(f"{d}/inputs.safetensors")
kiln = load_file(f"{d}/kiln.safetensors")
names = sorted(k for k in inp if ".g" not in k)
hidden = set(setup["hidden"])
lr, wd, eps, mu = setup["lr"], setup["weight_decay"], setup["eps"], setup["momentum"]


def to_torch(name, t):
    """kiln [in, out] -> torch [out, in] for linear weights; embeddings and norms as they are."""
    return t.t().contiguous() if t.ndim == 2 and "embed_tokens" not in name else t


mano = {n: to_torch(n, inp[n]).clone() for n in names if n in hidden}
bufs = {n: torch.zeros_like(p) for n, p in mano.items()}
rest = {n: torch.nn.Parameter(to_torch(n, inp[n]).clone()) for n in names if n not in hidden}
decayed = set(setup["decayed"])
groups = [{"params": [p for n, p in rest.items() if n in decayed], "weight_decay": wd},
          {"params": [p for n, p in rest.items() if n not in decayed], "weight_decay": 0.0}]
adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=tuple(setup["betas"]), eps=eps,
                          foreach=False)
for step in range(setup["steps"]):
    axis = step % 2
    for n, w in mano.items():
        g = to_torch(n, inp[f"{n}.g{step + 1}"])
        bufs[n].mul_(mu).add_(g)
        m = g.add(bufs[n], alpha=mu) if setup["nesterov"] else bufs[n]
        unit = w / torch.clamp(torch.norm(w, p=2, dim=axis, keepdim=True), min=eps)
        tangent = m - torch.sum(m * unit, dim=axis, keepdim=True) * unit
        u = tangent / torch.clamp(torch.norm(tangent, p=2, dim=axis, keepdim=True), min=eps)
        w.mul_(1 - lr * wd)
        w.add_(u, alpha=-lr * 0.2 * math.sqrt(m.shape[axis]))
    for n, p in rest.items():
        p.grad = to_torch(n, inp[f"{n}.g{step + 1}"]).clone()
    adamw.step()


def worst(ref):
    return max(float((to_torch(n, kiln[n]).double() - t.detach().double()).abs().max()) for n, t in ref.items())


moved = max(float((mano[n].double() - to_torch(n, inp[n]).double()).abs().max()) for n in mano)
print(json.dumps({"torch": torch.__version__, "mano": worst(mano), "adamw": worst(rest), "mano_moved": moved}))
