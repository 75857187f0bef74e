#!/usr/bin/env python3
"""kiln's SPAM against the authors' reference arithmetic (SPAM.py of "SPAM: Spike-Aware Adam
with Momentum Reset", the dense path: no masks), rewritten here since it is not packaged: the
step below keeps the reference's structure and order of operations (CosineDecay through
torch's CosineAnnealingLR, total_step / current_step bookkeeping, the spike mask against the
second moment before its update, HF-style bias correction folded into the step size, decay
after the update), with the reference's `update_proj_gap` (Delta T), `warmup_epoch`,
`threshold` and `grad_accu_steps` set from kiln's keys.

Called by crates/kiln-train/tests/suite/torch_parity.rs with a directory holding
inputs.safetensors (weights `<name>`, gradients `<name>.g<k>` for k = 1..steps),
kiln.safetensors (kiln's weights after the updates) and setup.json. Prints one JSON line.
"""
import json, math, sys
import torch
from safetensors.torch import load_file

d = sys.argv[1]
setup = json.load(open(f"{d}/setup.json"))
inp = load_file(f"{d}/inputs.safetensors")
kiln = load_file(f"{d}/kiln.safetensors")
names = sorted(k for k in inp if ".g" not in k)


class CosineDecay:
    """The reference's: the 'death rate' from 0.99 to 0 over T_max + 1 steps."""

    def __init__(self, death_rate, t_max, eta_min=0.0):
        self.sgd = torch.optim.SGD(torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(1))]), lr=death_rate)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.sgd, t_max + 1, eta_min, -1)
        self.t_max, self.eta_min = t_max, eta_min

    def get_dr(self, step):
        if step >= self.t_max:
            return self.eta_min
        # The reference calls CosineAnnealingLR.step(epoch), whose closed form this is.
        return self.eta_min + (0.99 - self.eta_min) * (1 + math.cos(math.pi * step / (self.t_max + 1))) / 2


class Spam:
    def __init__(self, groups, lr, betas, eps, gap, warmup, threshold, accu):
        self.groups, self.lr, self.betas, self.eps = groups, lr, betas, eps
        self.gap, self.warmup_epoch, self.thres, self.accu = gap, warmup, threshold, accu
        self.total_step, self.current_step = 0, warmup + 1
        self.warmup = CosineDecay(0.99, warmup)
        self.state = {}

    @torch.no_grad()
    def step(self):
        scale_factor = 1 - self.warmup.get_dr(self.current_step)
        for group in self.groups:
            for p in group["params"]:
                grad = p.grad
                st = self.state.setdefault(p, {"step": 0, "exp_avg": torch.zeros_like(grad),
                                               "exp_avg_sq": torch.zeros_like(grad)})
                if (self.total_step + 1) % self.gap == 0:
                    st["exp_avg"] = torch.zeros_like(grad)
                    st["exp_avg_sq"] = torch.zeros_like(grad)
                exp_avg, exp_avg_sq = st["exp_avg"], st["exp_avg_sq"]
                beta1, beta2 = self.betas
                st["step"] += 1
                if self.thres != 0:
                    current = self.total_step + 1
                    if current >= self.accu and current % self.gap >= self.accu:
                        mask = (grad ** 2) > (self.thres * exp_avg_sq)
                        grad[mask] = grad[mask].sign() * torch.sqrt(exp_avg_sq[mask] * self.thres)
                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                denom = exp_avg_sq.sqrt().add_(self.eps)
                step_size = self.lr * math.sqrt(1.0 - beta2 ** st["step"]) / (1.0 - beta1 ** st["step"])
                p.add_(exp_avg / denom, alpha=-step_size * scale_factor)
                if group["weight_decay"] > 0:
                    p.add_(p, alpha=-self.lr * group["weight_decay"])
        self.total_step += 1
        self.current_step += 1
        if self.total_step != 0 and (self.total_step + 1) % self.gap == 0:
            self.current_step = 0
            self.warmup = CosineDecay(0.99, self.warmup_epoch)


params = {n: torch.nn.Parameter(inp[n].clone()) for n in names}
decayed = set(setup["decayed"])
groups = [{"params": [params[n] for n in names if n in decayed], "weight_decay": setup["weight_decay"]},
          {"params": [params[n] for n in names if n not in decayed], "weight_decay": 0.0}]
opt = Spam(groups, setup["lr"], tuple(setup["betas"]), setup["eps"], setup["reset_interval"],
           setup["warmup_steps"], setup["threshold"], setup["clip_after"])
for k in range(1, setup["steps"] + 1):
    for n, p in params.items():
        p.grad = inp[f"{n}.g{k}"].clone()
    opt.step()

max_abs = max(float((kiln[n].double() - params[n].detach().double()).abs().max()) for n in names)
moved = max(float((params[n].detach().double() - inp[n].double()).abs().max()) for n in names)
print(json.dumps({"torch": torch.__version__, "spam_vs_reference": {"max_abs": max_abs, "max_moved": moved}}))
