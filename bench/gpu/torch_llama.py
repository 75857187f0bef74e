#!/usr/bin/env python3
"""PyTorch peer of kiln's GPU benchmark: the same Llama as kiln (RMSNorm, RoPE, GQA attention
through scaled_dot_product_attention as torchtitan uses, SwiGLU, untied head), bf16 autocast on
f32 master weights, AdamW (fused), gradient clipping 1.0, on one CUDA GPU.

Prints one JSON line: tokens/s, step time, MFU against the GPU's dense bf16 peak, and peak
GPU memory (allocated and reserved by PyTorch's caching allocator).

Data parallel (issue 42), under torchrun: `--variant ddp` (DistributedDataParallel) or
`--variant fsdp` (FSDP2: `fully_shard` on every block, then the root; bf16 parameters for the
compute, f32 gradient reduction, as torchtitan's default mixed precision), NCCL. Several ranks
may share one GPU: with `--ranks-as-hosts` each rank is an NCCL host of its own
(NCCL_HOSTID per rank, NCCL's socket transport over loopback), the trick kiln's
KILN_NCCL_RANKS_AS_HOSTS uses. Rank 0 prints the line: tokens/s per rank and the peak memory of
the rank that used the most.

Usage: torch_llama.py --model ref|1b|1b-dp|7b --variant eager|compile|ddp|fsdp [--batch B]
                      [--seq T] [--steps N] [--warmup N] [--ranks-as-hosts]
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from models import MODELS, peak_flops  # beside this file


class Block(nn.Module):
    def __init__(self, d, nh, nkv, ffn):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, d // nh
        self.attn_norm = nn.RMSNorm(d, eps=1e-5)
        self.wq = nn.Linear(d, nh * self.hd, bias=False)
        self.wk = nn.Linear(d, nkv * self.hd, bias=False)
        self.wv = nn.Linear(d, nkv * self.hd, bias=False)
        self.wo = nn.Linear(nh * self.hd, d, bias=False)
        self.ffn_norm = nn.RMSNorm(d, eps=1e-5)
        self.gate = nn.Linear(d, ffn, bias=False)
        self.up = nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.wk(h).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.wv(h).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, -1))
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Llama(nn.Module):
    def __init__(self, vocab, d, layers, nh, nkv, ffn, seq):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, nh, nkv, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(d, eps=1e-5)
        self.head = nn.Linear(d, vocab, bias=False)
        hd = d // nh
        inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x, self.cos, self.sin)
        return self.head(self.norm(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=MODELS, default="ref")
    ap.add_argument("--variant", choices=["eager", "compile", "ddp", "fsdp"], default="eager")
    ap.add_argument("--ranks-as-hosts", action="store_true",
                    help="each rank its own NCCL host (several ranks on one GPU)")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--profile", metavar="PATH",
                    help="after the timed steps, profile 3 more and write PyTorch's per-kernel "
                         "table (CUDA time per step) to PATH")
    a = ap.parse_args()
    vocab, d, layers, nh, nkv, ffn, batch, seq = MODELS[a.model]
    batch, seq = a.batch or batch, a.seq or seq
    dist = None
    rank, world = 0, 1
    if a.variant in ("ddp", "fsdp"):
        import torch.distributed as dist
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if a.ranks_as_hosts:
            # Read by NCCL when the communicator forms: after this, before any collective.
            os.environ["NCCL_HOSTID"] = f"torch-rank-{rank}"
            for k, v in (("NCCL_SHM_DISABLE", "1"), ("NCCL_P2P_DISABLE", "1"),
                         ("NCCL_IB_DISABLE", "1"), ("NCCL_SOCKET_IFNAME", "lo")):
                os.environ.setdefault(k, v)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dist.init_process_group("nccl")
    torch.manual_seed(0)
    dev = torch.device("cuda", torch.cuda.current_device())
    model = Llama(vocab, d, layers, nh, nkv, ffn, seq).to(dev)  # f32 masters
    params = sum(p.numel() for p in model.parameters())
    autocast = True
    if a.variant == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for b in model.blocks:
            fully_shard(b, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        autocast = False  # the policy casts the parameters; the loss is taken in f32 below
    elif a.variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[dev.index])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                            fused=a.variant != "fsdp")
    step_model = torch.compile(model) if a.variant == "compile" else model
    gen = torch.Generator(device=dev).manual_seed(rank)
    ids = torch.randint(0, vocab, (batch, seq + 1), device=dev, generator=gen)
    x, y = ids[:, :-1], ids[:, 1:]

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = step_model(x)
        loss = F.cross_entropy(logits.float().view(-1, vocab), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    loss = float(loss)  # waits for the last step
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / a.steps
    tokens = batch * seq
    # torchtitan's count: 6 x parameters (embedding excluded: a lookup) + attention 12*L*d*T.
    flops_per_token = 6 * (params - vocab * d) + 12 * layers * d * seq
    name = torch.cuda.get_device_name()
    peak_alloc = torch.cuda.max_memory_allocated() / 2**20
    peak_reserved = torch.cuda.max_memory_reserved() / 2**20
    if dist is not None:
        # The rank that used the most memory, and the slowest rank's step.
        m = torch.tensor([peak_alloc, peak_reserved, dt], device=dev)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        peak_alloc, peak_reserved, dt = m.tolist()
        dist.destroy_process_group()
        if rank != 0:
            return
    if a.profile:
        try:
            write_profile(a.profile, step, 3)
        except Exception as e:  # the figures above stand without the profile
            print(f"torch_llama: profile failed: {e!r}", file=sys.stderr)
    print(json.dumps({
        "impl": f"torch-{a.variant}", "model": a.model, "params": params, "batch": batch,
        "seq": seq, "device": name, "ranks": world, "tokens_per_s": tokens / dt,
        "step_ms": dt * 1e3, "mfu": flops_per_token * tokens / dt / peak_flops(name),
        "loss": loss, "peak_alloc_mib": peak_alloc, "peak_reserved_mib": peak_reserved,
        "torch": torch.__version__,
    }))


def write_profile(path, step, steps):
    """PyTorch's profiler over `steps` steps: the CUDA kernels by total device time, per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    def dev(e):
        t = getattr(e, "self_device_time_total", None)
        return e.self_cuda_time_total if t is None else t

    rows = [e for e in prof.key_averages() if dev(e) > 0 and "CUDA" in str(e.device_type)]
    rows.sort(key=dev, reverse=True)
    total = sum(dev(e) for e in rows) or 1.0
    with open(path, "w") as f:
        f.write(f"# PyTorch CUDA kernels, {steps} steps; ms per step (share of kernel time)\n")
        f.write(f"total {total / 1e3 / steps:.2f} ms per step\n")
        for e in rows[:40]:
            f.write(f"{dev(e) / 1e3 / steps:9.3f} ms {e.count // steps:6d}x "
                    f"{100 * dev(e) / total:5.1f}%  {e.key[:120]}\n")


if __name__ == "__main__":
    main()
