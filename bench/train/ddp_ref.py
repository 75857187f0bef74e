#!/usr/bin/env python3
"""PyTorch DDP peer of kiln's data-parallel benchmark: the reference model of
bench/train/torch_ref.py wrapped in DistributedDataParallel (gloo backend, CPU, default
25 MB buckets), each rank on its own batch of 8 x 256 tokens. Start with torchrun:

    torchrun --standalone --nproc_per_node 2 bench/train/ddp_ref.py --threads 1 --steps 10

Rank 0 prints global tokens_per_s (all ranks) and step_ms, like torch_ref.py.
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import torch_ref as R  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = R.LM("enable_gqa")
    ddp = DDP(model)
    g = torch.Generator().manual_seed(args.seed + 1 + rank)
    data = torch.randint(0, R.VOCAB, (R.BATCH, R.SEQ + 1), generator=g)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

    def step():
        opt.zero_grad(set_to_none=True)
        logits = ddp(x)
        loss = F.cross_entropy(logits.view(-1, R.VOCAB), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    for _ in range(args.warmup):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    dist.barrier()
    total = time.perf_counter() - t0
    if rank == 0:
        print(f"torch={torch.__version__} ranks={world} threads={args.threads} backend=gloo")
        print(f"tokens_per_s={world * R.BATCH * R.SEQ * args.steps / total:.1f}")
        print(f"step_ms={1000.0 * total / args.steps:.1f}")
        print(f"peak_rss_mib={R.peak_rss_mib():.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
