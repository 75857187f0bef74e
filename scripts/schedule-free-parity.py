#!/usr/bin/env python3
"""kiln's Schedule-Free AdamW against the authors' package (PyPI `schedulefree`,
AdamWScheduleFree, foreach off), on the same weights and gradients.

Called by crates/kiln-train/tests/suite/torch_parity.rs with a directory holding
inputs.safetensors (weights `<name>`, gradients `<name>.g<k>`, k = 1..steps),
kiln.safetensors (kiln's parameters after the updates: the training point y) and
kiln_x.safetensors (kiln's published weights: x), and setup.json. Prints one JSON line:
the largest difference of y (the reference's parameters in train mode) and of x (after its
`eval()`).
"""
import json, sys
import torch
import schedulefree
from safetensors.torch import load_file

d = sys.argv[1]
setup = json.load(open(f"{d}/setup.json"))
inp = load_file(f"{d}/inputs.safetensors")
ky = load_file(f"{d}/kiln.safetensors")
kx = load_file(f"{d}/kiln_x.safetensors")
names = sorted(k for k in inp if ".g" not in k)
params = {n: torch.nn.Parameter(inp[n].clone()) for n in names}
decayed = set(setup["decayed"])
groups = [{"params": [params[n] for n in names if n in decayed], "weight_decay": setup["weight_decay"]},
          {"params": [params[n] for n in names if n not in decayed], "weight_decay": 0.0}]
opt = schedulefree.AdamWScheduleFree(groups, lr=setup["lr"], betas=tuple(setup["betas"]), eps=setup["eps"],
                                     warmup_steps=setup["warmup_steps"], r=setup["r"],
                                     weight_lr_power=setup["weight_lr_power"], foreach=False)
opt.train()
for k in range(1, setup["steps"] + 1):
    for n, p in params.items():
        p.grad = inp[f"{n}.g{k}"].clone()
    opt.step()
diff = lambda kiln: max(float((kiln[n].double() - params[n].detach().double()).abs().max()) for n in names)
y = diff(ky)
opt.eval()
x = diff(kx)
moved = max(float((params[n].detach().double() - inp[n].double()).abs().max()) for n in names)
print(json.dumps({"torch": torch.__version__, "y": y, "x": x, "x_moved": moved}))
