#!/usr/bin/env python3
"""Where PyTorch eager's training step time goes, per op, forward and backward.

Runs the reference model of bench/train/torch_ref.py (same model, batch, AdamW and
clipping as bench.sh) under torch.profiler and sums each profiled op's self CPU time into
the categories of kiln's table (bench/train/kiln_ops.py), per step. Forward ops are
classified by the top-level aten op and its shapes, backward ops by the autograd node that
ran them (and the shapes of its matmuls), the rest by the phase they ran in (clip,
optimizer).

Usage: torch_ops.py [--threads N] [--steps N] [--json OUT]
"""
import argparse
import collections
import importlib.util
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

HERE = os.path.dirname(os.path.abspath(__file__))
REF = os.path.join(HERE, "torch_ref.py")


def load_ref():
    spec = importlib.util.spec_from_file_location("torch_ref", REF)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def shapes_of(e):
    return [tuple(s) for s in (e.input_shapes or []) if s]


def has_dim(shapes, n):
    return any(n in s for s in shapes)


def forward_category(op, shapes, R):
    """Category of a forward op, from its top-level aten op and its input shapes."""
    if op == "aten::embedding":
        return "embedding"
    if op in ("aten::rms_norm", "aten::_fused_rms_norm"):
        return "rmsnorm"
    if op in ("aten::linear", "aten::matmul", "aten::mm"):
        if has_dim(shapes, R.VOCAB):
            return "head matmul + cross-entropy"
        if has_dim(shapes, R.FF_HIDDEN):
            return "MLP projections"
        return "attention projections"
    if op == "aten::scaled_dot_product_attention":
        return "attention core"
    if op in ("aten::cross_entropy_loss", "aten::log_softmax", "aten::nll_loss_nd"):
        return "head matmul + cross-entropy"
    if op == "aten::silu":
        return "SwiGLU gate"
    # element-wise ops: by shape (RoPE works on [b, heads, t, hd], the SwiGLU product on
    # [b, t, ffn], the residual stream is [b, t, d])
    four_d = any(len(s) == 4 for s in shapes)
    if op in ("aten::mul", "aten::cat", "aten::neg", "aten::chunk", "aten::slice", "aten::add") and four_d:
        return "RoPE"
    if op == "aten::mul" and has_dim(shapes, R.FF_HIDDEN):
        return "SwiGLU gate"
    if op == "aten::add":
        return "residual adds"
    if op in ("aten::transpose", "aten::reshape", "aten::view", "aten::contiguous", "aten::clone",
              "aten::copy_", "aten::t", "aten::_unsafe_view"):
        return "layout copies"
    return "other"


BACKWARD = {
    "EmbeddingBackward0": "embedding",
    "ScaledDotProductFlashAttentionForCpuBackward0": "attention core",
    "LogSoftmaxBackward0": "head matmul + cross-entropy",
    "NllLossBackward0": "head matmul + cross-entropy",
    "SiluBackward0": "SwiGLU gate",
    "PowBackward0": "rmsnorm",
    "MeanBackward1": "rmsnorm",
    "RsqrtBackward0": "rmsnorm",
    "CatBackward0": "RoPE",
    "NegBackward0": "RoPE",
    "SplitBackward0": "RoPE",
    "torch::autograd::AccumulateGrad": "grad accumulation",
    "TransposeBackward0": "layout copies",
    "ViewBackward0": "layout copies",
    "UnsafeViewBackward0": "layout copies",
    "TBackward0": "layout copies",
    "CloneBackward0": "layout copies",
    "ReshapeAliasBackward0": "layout copies",
}


def backward_category(node, shapes, R):
    """Category of an op run by autograd node `node` (e.g. MmBackward0)."""
    if node == "MmBackward0":
        return forward_category("aten::mm", shapes, R)
    if node in BACKWARD:
        return BACKWARD[node]
    four_d = any(len(s) == 4 for s in shapes)
    if node in ("MulBackward0", "AddBackward0"):
        if four_d:
            return "RoPE"
        if has_dim(shapes, R.FF_HIDDEN):
            return "SwiGLU gate"
        if node == "AddBackward0":
            return "residual adds"
        return "rmsnorm"  # the remaining multiplies are RMSNorm's (x * rsqrt, * weight)
    return "other"


def classify(prof, R):
    """{(phase, category): self CPU microseconds}."""
    out = collections.Counter()
    for e in prof.events():
        t = e.self_cpu_time_total
        if t <= 0:
            continue
        chain = []
        p = e
        while p is not None:
            chain.append(p)
            p = p.cpu_parent
        names = [c.name for c in chain]
        if "phase:clip" in names:
            out[("step", "clip")] += t
            continue
        if "phase:optimizer" in names:
            out[("step", "AdamW")] += t
            continue
        if "phase:zero_grad" in names:
            out[("step", "other")] += t
            continue
        node_ev = next((c for c in chain if c.name.startswith("autograd::engine::evaluate_function: ")), None)
        if node_ev is not None:
            node = node_ev.name.split(": ", 1)[1]
            # an op's own shapes, else those of the ops its autograd node ran
            shapes = shapes_of(e) or [s for c in cc_all(node_ev) for s in shapes_of(c)]
            out[("bwd", backward_category(node, shapes, R))] += t
            continue
        if "phase:backward" in names:
            out[("bwd", "other")] += t
            continue
        if "phase:forward" in names:
            aten = [c for c in chain if c.name.startswith("aten::")]
            top = aten[-1] if aten else e
            out[("fwd", forward_category(top.name, shapes_of(top), R))] += t
            continue
        out[("step", "other")] += t
    return out


def cc_all(e):
    for c in e.cpu_children:
        yield c
        yield from cc_all(c)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-scale", dest="scale", action="store_false",
                    help="report the profiler's wall-clock times as they are")
    args = ap.parse_args()
    R = load_ref()
    torch.set_num_threads(args.threads)
    torch.manual_seed(1234)
    model = R.LM("enable_gqa")
    g = torch.Generator().manual_seed(1235)
    data = torch.randint(0, R.VOCAB, (R.BATCH, R.SEQ + 1), generator=g)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

    def step():
        with record_function("phase:zero_grad"):
            opt.zero_grad(set_to_none=True)
        with record_function("phase:forward"):
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, R.VOCAB), y.view(-1))
        with record_function("phase:backward"):
            loss.backward()
        with record_function("phase:clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with record_function("phase:optimizer"):
            opt.step()

    for _ in range(args.warmup):
        step()
    import time
    cpu0, wall0 = time.process_time(), time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(args.steps):
            step()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    # The profiler's times are wall-clock: on a busy machine they include time the process
    # waited for a core. Scale them by the process's CPU time over wall time (at one thread
    # that removes the waiting; kiln's side is sampled CPU time).
    scale = min(1.0, cpu / (wall * args.threads)) if args.scale else 1.0
    cats = classify(prof, R)
    table = {f"{ph}:{cat}": scale * us / 1000.0 / args.steps for (ph, cat), us in cats.items()}
    total = sum(table.values())
    print(f"profiled {args.steps} step(s): wall {wall:.2f} s, process CPU {cpu:.2f} s, scale {scale:.3f}")
    for k in sorted(table, key=lambda k: -table[k]):
        print(f"{table[k]:10.1f} ms  {k}")
    print(f"{total:10.1f} ms  total (self CPU time per step, {args.threads} thread(s))")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "steps": args.steps, "ms_per_step": table,
                       "cpu_over_wall": scale,
                       "torch": torch.__version__, "loadavg": open("/proc/loadavg").read().split()[:3]},
                      f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
