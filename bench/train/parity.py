#!/usr/bin/env python3
"""Numerical parity of kiln's model with a PyTorch implementation of the same Llama.

Runs kiln's `dump_step` example (fresh weights + one batch, kiln's loss and global grad
norm), loads the same weights into PyTorch (kiln stores matrices [in, out]; nn.Linear wants
[out, in]) and compares loss and grad norm. Usage: bench/.venv/bin/python bench/train/parity.py [--set k=v ...]
"""
import json, math, os, subprocess, sys, tempfile
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sets = sys.argv[1:]
with tempfile.TemporaryDirectory() as d:
    out = subprocess.run(["cargo", "run", "-q", "--release", "-p", "kiln-train", "--example", "dump_step", "--", d, *sets],
                         cwd=root, check=True, capture_output=True, text=True).stdout
    kiln = json.loads(out.strip().splitlines()[-1])
    w = load_file(os.path.join(d, "params.safetensors"))
    rows = torch.tensor(json.load(open(os.path.join(d, "tokens.json"))))
cfg = subprocess.run([os.path.join(root, "target/release/kiln"), "train", "--print-config", *sum([["--set", s] for s in sets], [])],
                     capture_output=True, text=True, check=True).stdout
import tomllib
c = tomllib.loads(cfg)["model"]
d_model, nh, nkv, eps, theta = c["d_model"], c["n_heads"], c["n_kv_heads"], c["norm_eps"], c["rope_theta"]
hd = d_model // nh
w = {k: v.clone().requires_grad_(True) for k, v in w.items()}
x_ids, y_ids = rows[:, :-1], rows[:, 1:]
B, T = x_ids.shape

def rms(x, g):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g

inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
fr = torch.outer(torch.arange(T, dtype=torch.float32), inv)
emb = torch.cat([fr, fr], -1)
cos, sin = emb.cos(), emb.sin()
def rope(x):
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin

x = w["model.embed_tokens.weight"][x_ids]
for l in range(c["n_layers"]):
    p = lambda n: w[f"model.layers.{l}.{n}"]
    h = rms(x, p("input_layernorm.weight"))
    q = (h @ p("self_attn.q_proj.weight")).view(B, T, nh, hd).transpose(1, 2)
    k = (h @ p("self_attn.k_proj.weight")).view(B, T, nkv, hd).transpose(1, 2)
    v = (h @ p("self_attn.v_proj.weight")).view(B, T, nkv, hd).transpose(1, 2)
    if c["qk_norm"]:
        q, k = rms(q, p("self_attn.q_norm.weight")), rms(k, p("self_attn.k_norm.weight"))
    q, k = rope(q), rope(k)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    x = x + y.transpose(1, 2).reshape(B, T, d_model) @ p("self_attn.o_proj.weight")
    h = rms(x, p("post_attention_layernorm.weight"))
    x = x + (F.silu(h @ p("mlp.gate_proj.weight")) * (h @ p("mlp.up_proj.weight"))) @ p("mlp.down_proj.weight")
h = rms(x, w["model.norm.weight"])
head = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"].t()
loss = F.cross_entropy((h @ head).view(-1, head.shape[1]), y_ids.reshape(-1))
loss.backward()
norm = math.sqrt(sum(float(t.grad.pow(2).sum()) for t in w.values()))
print(f"kiln:  loss={kiln['loss']:.7f} grad_norm={kiln['grad_norm']:.7f}")
print(f"torch: loss={loss.item():.7f} grad_norm={norm:.7f}")
ok = abs(kiln["loss"] - loss.item()) < 1e-4 and abs(kiln["grad_norm"] - norm) / norm < 1e-3
print("parity:", "OK" if ok else "MISMATCH")
sys.exit(0 if ok else 1)
