#!/usr/bin/env python3
"""PyTorch peer of kiln's tensor-parallel benchmark (bench/train/tp.sh): the Llama of
bench/train/torch_ref.py (RMSNorm, RoPE, GQA attention with SDPA, SwiGLU, untied head)
with its dims set to a ~107M-parameter model (vocab 8192, d_model 1024, 8 layers, 16 q heads /
4 kv heads of 64, SwiGLU hidden 2816, seq 256), fp32, AdamW(3e-4, wd 0.1), grad clip 1.0, on
CPU with gloo, in one of three modes:

  plain    no parallelism: the model as torch_ref.py builds it (the 1-rank row)
  tp       every rank one tensor-parallel rank of a 1-D DeviceMesh("cpu", (world,)); all ranks
           train on the same batch (they are one data-parallel rank)
  fsdp_tp  a 2-D mesh (dp, tp) = (world/2, 2): tensor parallelism as in `tp` on "tp", then
           FSDP2 fully_shard of each block and of the root on "dp"; each dp rank its own batch

The tensor-parallel plan is torchtitan's `apply_tp` for Llama
(torchtitan/models/llama3/infra/parallelize.py), module for module, under torch_ref.py's
module names (torchtitan's name -> ours):

  tok_embeddings  -> embed        RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
  attention_norm  -> attn_norm    SequenceParallel()
  attention       -> attn         PrepareModuleInput((Shard(1), None, None) -> (Replicate(), None, None))
  attention.wq/wk/wv -> attn.wq/wk/wv  ColwiseParallel()
  attention.wo    -> attn.wo      RowwiseParallel(output_layouts=Shard(1))
  ffn_norm        -> mlp_norm     SequenceParallel()
  feed_forward    -> mlp          PrepareModuleInput((Shard(1),) -> (Replicate(),))
  feed_forward.w1/w3 -> mlp.w_gate/w_up  ColwiseParallel()
  feed_forward.w2 -> mlp.w_down   RowwiseParallel(output_layouts=Shard(1))
  norm            -> norm         SequenceParallel()
  output          -> head         ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                                  use_local_output=False)
  and the cross entropy (forward and backward) inside `with loss_parallel():`.

What differs from torchtitan, and why:
  - the attention's PrepareModuleInput has three positional inputs (x, cos, sin: torch_ref.py's
    RoPE tables) where torchtitan's has two (x, freqs_cis); the tables are plain tensors, left as
    they are, as torchtitan leaves freqs_cis.
  - torch_ref.py's attention reshapes q/k/v with the global head counts; under tensor
    parallelism each rank holds n_heads/tp q heads and n_kv_heads/tp kv heads, so the forward
    here reshapes with -1 heads (as torchtitan's does). The same arithmetic on one rank.
  - no torch.compile, no float8, no async TP, no activation checkpointing (torchtitan's options,
    all off here); fp32 throughout (no mixed-precision policy on fully_shard).
  - grad clipping as torchtitan's dist_utils.clip_grad_norm_ does it without pipeline
    parallelism: torch.nn.utils.get_total_norm, .full_tensor() of the DTensor norm, then
    torch.nn.utils.clip_grads_with_norm_.
  - fsdp_tp: fully_shard(block, mesh=dp) for every block and fully_shard(model, mesh=dp) on the
    root, default reshard_after_forward (torchtitan's default policy keeps the last block
    unsharded after forward; a detail at 8 blocks).

Measured, not changed: under `tp` the vocab-parallel embedding's gradient comes back from
DTensor's embedding backward as a Replicate DTensor, i.e. the whole [8192, 1024] gradient on
every rank (an all-reduce of it each step), not Shard(0) like its weight and AdamW moments;
state_mib and matrix_state_mib count it as held (hence 0.51 / 0.265 of the replicated matrix
state at tp=2 / tp=4 instead of 0.5 / 0.25). Under fsdp_tp FSDP2 reduce-scatters it and the
count is exact.

Start with torchrun:

    torchrun --standalone --nproc_per_node 2 bench/train/tp_ref.py --mode tp

Rank 0 prints, one `key=value` a line: global tokens_per_s (batch x 256 x data-parallel ranks
per step over the median step time of the timed steps), step_ms (that median), peak_rss_mib
(the largest ru_maxrss of any rank), state_mib (the largest per-rank parameters + gradients +
AdamW moments held locally, counted from DTensors' .to_local()), matrix_state_mib (the same for
the 2-D weights only), params (the whole model's), matrix_state_replicated_mib (the matrices'
state on one unsharded rank) and the last loss.
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

# The ~107M model (torch_ref.py reads these module globals when it builds the model).
R.VOCAB = 8192
R.D_MODEL = 1024
R.N_LAYERS = 8
R.N_HEADS = 16
R.N_KV_HEADS = 4
R.HEAD_DIM = 64
R.FF_HIDDEN = 2816
R.SEQ = 256


def attention_forward(self, x, cos, sin):
    """torch_ref.Attention.forward with this rank's head counts (-1: n_heads/tp, n_kv_heads/tp)."""
    B, T, _ = x.shape
    q = self.wq(x).view(B, T, -1, R.HEAD_DIM).transpose(1, 2)
    k = self.wk(x).view(B, T, -1, R.HEAD_DIM).transpose(1, 2)
    v = self.wv(x).view(B, T, -1, R.HEAD_DIM).transpose(1, 2)
    q = R.apply_rope(q, cos, sin)
    k = R.apply_rope(k, cos, sin)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    y = y.transpose(1, 2).reshape(B, T, -1)
    return self.wo(y)


R.Attention.forward = attention_forward


def local(t):
    """The part of `t` this rank holds (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(model, opt, matrices_only=False):
    """Parameters + gradients + AdamW moments this rank holds (of the 2-D weights only if asked)."""
    n = 0
    for p in model.parameters():
        if matrices_only and p.dim() != 2:
            continue
        n += local(p).numel() * p.element_size()
        if p.grad is not None:
            n += local(p.grad).numel() * p.grad.element_size()
        for v in opt.state.get(p, {}).values():
            if torch.is_tensor(v) and v.dim() > 0:
                n += local(v).numel() * v.element_size()
    return n


def apply_tp(model, tp_mesh):
    """torchtitan's apply_tp (loss parallel on), under torch_ref.py's module names."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    parallelize_module(model, tp_mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                use_local_output=False),
    })
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {
            "attn_norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                       desired_input_layouts=(Replicate(), None, None)),
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                      desired_input_layouts=(Replicate(),)),
            "mlp.w_gate": ColwiseParallel(),
            "mlp.w_down": RowwiseParallel(output_layouts=Shard(1)),
            "mlp.w_up": ColwiseParallel(),
        })


def clip_grad_norm_(params, max_norm):
    """torchtitan's dist_utils.clip_grad_norm_ without pipeline parallelism."""
    params = [p for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["plain", "tp", "fsdp_tp"], default="tp")
    ap.add_argument("--batch", type=int, default=4, help="sequences of 256 a data-parallel rank")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = R.LM("enable_gqa")
    n_params = sum(p.numel() for p in model.parameters())
    replicated_matrices = sum(16 * p.numel() for p in model.parameters() if p.dim() == 2)

    from torch.distributed.device_mesh import init_device_mesh
    dp, dp_rank, tp = 1, 0, 1
    if args.mode == "plain":
        dp, dp_rank = world, rank  # (run it on one rank)
    elif args.mode == "tp":
        tp = world
        apply_tp(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    else:
        assert world % 2 == 0, "fsdp_tp needs an even number of ranks"
        dp, tp = world // 2, 2
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        dp_rank = mesh["dp"].get_local_rank()
        apply_tp(model, mesh["tp"])
        from torch.distributed.fsdp import fully_shard
        for b in model.blocks:
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    assert R.N_HEADS % tp == 0 and R.N_KV_HEADS % tp == 0, "tp must divide both head counts"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

    # The same batch on every rank of a tensor-parallel group, its own on each dp rank.
    g = torch.Generator().manual_seed(args.seed + 1 + dp_rank)
    data = torch.randint(0, R.VOCAB, (args.batch, R.SEQ + 1), generator=g)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    if tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel
        loss_ctx = loss_parallel
    else:
        import contextlib
        loss_ctx = contextlib.nullcontext

    def step():
        opt.zero_grad(set_to_none=False)
        with loss_ctx():
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(0, 1))
            del logits
            loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).item()

    for _ in range(args.warmup):
        step()
    times, loss = [], float("nan")
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    med = sorted(times)[len(times) // 2]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    mine = torch.tensor([peak, state_bytes(model, opt) / 2**20,
                         state_bytes(model, opt, matrices_only=True) / 2**20], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"torch={torch.__version__} mode={args.mode} ranks={world} dp={dp} tp={tp} backend=gloo")
        print(f"params={n_params}")
        print(f"tokens_per_s={dp * args.batch * R.SEQ / med:.1f}")
        print(f"step_ms={1000.0 * med:.1f}")
        print("step_ms_all=" + ",".join(f"{1000.0 * t:.1f}" for t in times))
        print(f"peak_rss_mib={mine[0].item():.1f}")
        print(f"state_mib={mine[1].item():.1f}")
        print(f"matrix_state_mib={mine[2].item():.1f}")
        print(f"matrix_state_replicated_mib={replicated_matrices / 2**20:.1f}")
        print(f"loss={loss:.4f}")
    dist.barrier()  # no rank tears gloo down under another still talking (seen: SIGABRT at exit)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
