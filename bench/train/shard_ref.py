#!/usr/bin/env python3
"""PyTorch peer of kiln's sharding benchmark (bench/train/shard.sh): the reference model of
bench/train/torch_ref.py (or one `--width` times as wide) on CPU with gloo, each rank on
its own batch of `--batch` x 256 tokens, in one of three modes:

  ddp    DistributedDataParallel, everything replicated (kiln's parallelism.shard = "none")
  zero   ZeroRedundancyOptimizer under DDP: AdamW state sharded (kiln's "optimizer")
  fsdp2  torch.distributed.fsdp.fully_shard per block and on the root: parameters,
         gradients and optimizer state sharded (ZeRO-3; kiln's "gradients" and "parameters")
  hsdp   fully_shard on a 2-D mesh (2 replicas x ranks/2 shards): hybrid sharding (kiln's
         "parameters" with parallelism.dp_replicate = 2)

Start with torchrun:

    torchrun --standalone --nproc_per_node 2 bench/train/shard_ref.py --mode zero

Rank 0 prints global tokens_per_s, step_ms, the largest peak RSS of any rank (MiB) and the
largest per-rank training state (parameters + gradients + optimizer state held by the rank,
MiB), one `key=value` a line.
"""
import argparse
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torch_ref as R  # noqa: E402


def local(t):
    """The part of `t` this rank holds (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(model, opt):
    n = 0
    for p in model.parameters():
        n += local(p).numel() * 4
        if p.grad is not None:
            n += local(p.grad).numel() * 4
    for s in opt.state.values() if not hasattr(opt, "optim") else opt.optim.state.values():
        for v in s.values():
            if torch.is_tensor(v) and v.dim() > 0:
                n += local(v).numel() * v.element_size()
    return n


def build(mode, model):
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model), torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    if mode == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                      lr=3e-4, weight_decay=0.1)
        return DDP(model), opt
    from torch.distributed.fsdp import fully_shard
    mesh = None
    if mode == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        world = dist.get_world_size()
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ddp", "zero", "fsdp2", "hsdp"], default="ddp")
    ap.add_argument("--width", type=int, default=1, help="d_model and ffn x this")
    ap.add_argument("--batch", type=int, default=R.BATCH)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    R.D_MODEL *= args.width
    R.FF_HIDDEN *= args.width
    R.HEAD_DIM = R.D_MODEL // R.N_HEADS
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = R.LM("enable_gqa")
    wrapped, opt = build(args.mode, model)
    g = torch.Generator().manual_seed(args.seed + 1 + rank)
    data = torch.randint(0, R.VOCAB, (args.batch, R.SEQ + 1), generator=g)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def step():
        opt.zero_grad(set_to_none=False)
        logits = wrapped(x)
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
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    mine = torch.tensor([peak, state_bytes(model, opt) / 2**20], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"torch={torch.__version__} mode={args.mode} ranks={world} backend=gloo")
        print(f"tokens_per_s={world * args.batch * R.SEQ * args.steps / total:.1f}")
        print(f"step_ms={1000.0 * total / args.steps:.1f}")
        print(f"peak_rss_mib={mine[0].item():.1f}")
        print(f"state_mib={mine[1].item():.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
