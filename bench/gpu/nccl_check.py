#!/usr/bin/env python3
"""NCCL between ranks sharing one GPU, with PyTorch (the first minute of a GPU session, beside
`kiln doctor --device cuda` under `kiln launch`): each rank its own NCCL host (NCCL_HOSTID per
rank, NCCL's socket transport over loopback), then an all-reduce, a reduce-scatter and an
all-gather of known values. Rank r holds (r + 1) x (i % 7 + 1) at i; exits 1 on any
difference beyond f32 rounding.

Usage: torchrun --standalone --nproc-per-node N bench/gpu/nccl_check.py
"""
import os
import sys

import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
os.environ["NCCL_HOSTID"] = f"torch-rank-{rank}"
for k, v in (("NCCL_SHM_DISABLE", "1"), ("NCCL_P2P_DISABLE", "1"), ("NCCL_IB_DISABLE", "1"),
             ("NCCL_SOCKET_IFNAME", "lo")):
    os.environ.setdefault(k, v)
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
dist.init_process_group("nccl")
n = (1 << 20) * world
base = (torch.arange(n, device="cuda") % 7 + 1).float()
mine = base * (rank + 1)
mean = base * (world + 1) / 2
worst = {}
x = mine.clone()
dist.all_reduce(x)
worst["all_reduce"] = ((x / world - mean).abs() / mean).max().item()
out = torch.empty(n // world, device="cuda")
dist.reduce_scatter_tensor(out, mine.clone())
lo = rank * (n // world)
worst["reduce_scatter"] = ((out / world - mean[lo:lo + n // world]).abs()
                           / mean[lo:lo + n // world]).max().item()
shard = mine[lo:lo + n // world].clone()
whole = torch.empty(n, device="cuda")
dist.all_gather_into_tensor(whole, shard)
owner = torch.arange(n, device="cuda") // (n // world) + 1
worst["all_gather"] = (whole - base * owner).abs().max().item()
ok = worst["all_reduce"] <= 1e-6 and worst["reduce_scatter"] <= 1e-6 and worst["all_gather"] == 0
print(f"torch NCCL rank {rank} of {world}: {worst} {'ok' if ok else 'FAIL'}", flush=True)
dist.destroy_process_group()
sys.exit(0 if ok else 1)
