#!/usr/bin/env python3
"""PyTorch DDP peer of kiln's optimizer benchmark (bench/train/optim.sh): the Llama of
bench/train/torch_ref.py (the reference model, or with --model 107m the ~107M model of
tp_ref.py: vocab 8192, d 1024, 8 layers, 16/4 heads, SwiGLU 2816), DistributedDataParallel on
gloo, each rank on its own batch of --batch x 256 tokens, fp32, clip 1.0, with

  adamw  torch.optim.AdamW(lr 3e-4, wd 0.1) for every parameter
  muon   torch.optim.Muon (lr 3e-4, wd 0.1, adjust_lr_fn "match_rms_adamw", nesterov, 5
         Newton-Schulz steps) for the 2-D hidden matrices (every block's projections) and
         torch.optim.AdamW for the embedding, the head and the norms: kiln's split
         (optim::role) and kiln's defaults

Rank 0 prints global tokens_per_s (median step), step_ms, opt_ms (the median time of
opt.step(), the optimizer's share) and peak_rss_mib.

    torchrun --standalone --nproc_per_node 2 bench/train/optim_ref.py --optimizer muon
"""
import argparse
import os
import statistics
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
    ap.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    ap.add_argument("--model", choices=["ref", "107m"], default="ref")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    if args.model == "107m":
        (R.D_MODEL, R.N_LAYERS, R.N_HEADS, R.N_KV_HEADS, R.FF_HIDDEN) = (1024, 8, 16, 4, 2816)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    model = R.LM("enable_gqa")
    ddp = DDP(model)
    g = torch.Generator().manual_seed(1235 + rank)
    data = torch.randint(0, R.VOCAB, (args.batch, R.SEQ + 1), generator=g)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and n.startswith("blocks."))]
    if args.optimizer == "muon":
        opts = [torch.optim.Muon(hidden, lr=3e-4, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(rest, lr=3e-4, weight_decay=0.1)]
    else:
        opts = [torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)]

    def step():
        for o in opts:
            o.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = F.cross_entropy(ddp(x).view(-1, R.VOCAB), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t1 = time.perf_counter()
        for o in opts:
            o.step()
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        dist.barrier()
        times.append(step())
    total = torch.tensor([statistics.median(t for t, _ in times)])
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    rss = torch.tensor([R.peak_rss_mib()])
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"torch={torch.__version__}")
        print(f"tokens_per_s={world * args.batch * R.SEQ / total.item():.1f}")
        print(f"step_ms={1000.0 * total.item():.1f}")
        print(f"opt_ms={1000.0 * statistics.median(o for _, o in times):.1f}")
        print(f"peak_rss_mib={rss.item():.1f}")
        print(f"params={sum(p.numel() for p in model.parameters())}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
