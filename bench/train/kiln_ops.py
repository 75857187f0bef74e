#!/usr/bin/env python3
"""Where kiln's training step time goes, per op, forward and backward, from `perf script`
output of the step_profile example (see profile.sh).

Each perf sample is a call stack. A sample is put in a category by the first frame, from
the leaf up, that says what it is doing: a kiln kernel (kiln_train::kernels::<kernel>), a
burn autodiff backward step (`<...::float_matmul::Matmul as Backward>::backward`, i.e. the
op whose backward it is) or, in the forward pass, the model function (kiln_train::model::
Llama::attention, ...) together with the burn op it called (linear, matmul, softmax, ...).
Samples are CPU time (perf's cpu-clock), so other processes on the machine do not inflate
them. The categories are those of torch_ops.py, so the two tables line up.

Usage: kiln_ops.py PERF_SCRIPT_TXT STEPS [--json OUT]
"""
import argparse
import collections
import json
import re
import sys

FRAME = re.compile(r"^\s*[0-9a-f]+ (.*?)(\+0x[0-9a-f]+)? \((.*)\)$")

# kiln's fused kernels: module -> category (forward and backward alike)
KERNELS = {
    "rms_norm": "rmsnorm",
    "swiglu": "SwiGLU gate",
    "rope": "RoPE",
    "softmax": "attention core",
    "attention": "attention core",
    "cross_entropy": "head matmul + cross-entropy",
    "linear": None,  # forward: by caller (attention / MLP); backward: projections
}

# burn autodiff backward steps (the struct in `<..::op::Struct as Backward<..>>::backward`)
BACKWARD = {
    "Matmul": "attention core",  # q @ k^T and p @ v (the projections are linear)
    "Embedding": "embedding",
    "Gather": "head matmul + cross-entropy",
    "Log": "head matmul + cross-entropy",
    "Sigmoid": "SwiGLU gate",
    "PowiScalar": "rmsnorm",
    "Powi": "rmsnorm",
    "MeanDim": "rmsnorm",
    "Sqrt": "rmsnorm",
    "Recip": "rmsnorm",
    "AddScalar": "rmsnorm",
    "Cat": "RoPE",
    "Slice": "RoPE",
    "Narrow": "RoPE",
    "Neg": "RoPE",
    "SwapDims": "layout copies",
    "ReshapeDim": "layout copies",
    "Reshape": "layout copies",
    "Transpose": "layout copies",
    "MulScalar": "attention core",
    "Div": "attention core",  # softmax's divide (log-softmax has none)
    "Mean": "head matmul + cross-entropy",
    # composed softmax / log-softmax pieces, shared by attention and the loss
    "Exp": "softmax pieces (attention + loss, composed)",
    "Sub": "softmax pieces (attention + loss, composed)",
    "SumDim": "softmax pieces (attention + loss, composed)",
    "MaxDim": "softmax pieces (attention + loss, composed)",
    "Mul": "multiplies (rmsnorm + RoPE + SwiGLU, composed)",
    "Add": "residual adds",
}

# forward: (model function, burn op) -> category
def forward_category(func, op):
    fn = func.split("::")[-1]
    if fn == "rms_norm":
        return "rmsnorm"
    if fn == "apply" and "RopeTables" in func:
        return "RoPE"
    if "causal_bias" in func:
        return "attention core"
    if op in ("reshape", "swap_dims", "transpose", "narrow_dims") and fn in ("attention", "hidden"):
        return "layout copies"
    if fn == "loss":
        return "head matmul + cross-entropy"
    if fn == "attention":
        if op == "linear":
            return "attention projections"
        if op in ("matmul", "softmax", "add", "mul_scalar"):
            return "attention core"
        return "attention core"
    if fn == "hidden":
        if op == "linear":
            return "MLP projections"
        if op in ("silu", "mul"):
            return "SwiGLU gate"
        if op == "add":
            return "residual adds"
        if op == "embedding":
            return "embedding"
    return "other"


def burn_op(frame):
    """The user-facing burn op a frame is in (`burn_tensor::...::linear` -> linear)."""
    if not frame.startswith("burn_tensor::") and "burn_tensor::" not in frame[:60]:
        return None
    name = re.sub(r"<[^<>]*>", "", frame)
    while "<" in name:
        name = re.sub(r"<[^<>]*>", "", name)
    last = name.split("::")[-1]
    if last in ("add", "mul", "sub", "div"):
        return last
    return last


def classify(frames):
    """(phase, category) of one sample; frames are function names, leaf first."""
    for i, f in enumerate(frames):
        m = re.match(r"kiln_train::kernels::(\w+)::", f) or re.match(
            r"<kiln_train::kernels::(\w+)::", f)
        if m and m.group(1) in KERNELS:
            bwd = any("as burn_autodiff::ops::backward::Backward" in g for g in frames[i:])
            cat = KERNELS[m.group(1)]
            if cat is None:  # linear
                if bwd:
                    return ("bwd", "projections (attention + MLP)")
                # the model function that called it, past the `mm` helper (the dtype casts)
                caller = next((g for g in frames[i:] if g.startswith("kiln_train::model::")
                               and not re.search(r"::(mm|bmm)(<|$)", g)), "")
                return ("fwd", forward_category(caller, "linear"))
            return ("bwd" if bwd else "fwd", cat)
        if "as burn_autodiff::ops::backward::Backward" in f:
            m = re.search(r"::(\w+) as burn_autodiff::ops::backward::Backward", f)
            name = m.group(1) if m else "?"
            if name in ("LinearNoBias", "LinearWithBias"):
                return ("bwd", "linear layers (all, incl. head)")
            return ("bwd", BACKWARD.get(name, "other"))
        if f.startswith("burn_autodiff::grads::Gradients::register"):
            return ("bwd", "grad accumulation")
        if f.startswith("kiln_train::optim::global_norm") or f.startswith("kiln_train::optim::clip"):
            return ("step", "clip")
        if f.startswith("kiln_train::optim::AdamW") or f.startswith("kiln_train::optim::adamw::") \
                or f.startswith("kiln_train::optim::Optimizer::update"):
            return ("step", "AdamW")
        if f.startswith("kiln_train::model::") and not re.search(r"::(mm|bmm)(<|$)", f):
            op = next((burn_op(g) for g in reversed(frames[:i]) if burn_op(g)), None)
            return ("fwd", forward_category(f, op))
        if f.startswith("burn_tensor::tensor::api::autodiff::backward"):
            return ("bwd", "other")
    return ("step", "other")


HEADER = re.compile(r"^\S.*?\s(\d+\.\d+):")


def samples(path, window):
    """Call stacks (leaf first) of the samples taken inside `window` (seconds, CLOCK_MONOTONIC)."""
    block, keep = [], False
    for line in open(path, errors="replace"):
        if not line.strip():
            if block and keep:
                yield block
            block, keep = [], False
            continue
        if line[0] not in " \t":
            m = HEADER.match(line)
            keep = bool(m) and window[0] <= float(m.group(1)) <= window[1]
            block = []
            continue
        m = FRAME.match(line.rstrip("\n"))
        if m:
            block.append(m.group(1))
    if block and keep:
        yield block


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("perf_txt", help="perf script output (perf record -k mono --call-graph dwarf)")
    ap.add_argument("--window", nargs=2, type=float, required=True,
                    help="CLOCK_MONOTONIC seconds of the timed steps (printed by step_profile)")
    ap.add_argument("--steps", type=int, required=True, help="steps inside the window")
    ap.add_argument("--ms-per-sample", type=float, required=True)
    ap.add_argument("--json", default=None)
    ap.add_argument("--explain", default=None, metavar="PHASE:CATEGORY",
                    help="print the most common stacks (top 12 frames) of one category")
    a = ap.parse_args()
    counts = collections.Counter()
    stacks = collections.Counter()
    for frames in samples(a.perf_txt, a.window):
        key = classify(frames)
        counts[key] += 1
        if a.explain == f"{key[0]}:{key[1]}":
            stacks[" <- ".join(f[:70] for f in frames[:12])] += 1
    for st, c in stacks.most_common(15):
        print(c, st, "\n")
    table = {f"{ph}:{cat}": c * a.ms_per_sample / a.steps for (ph, cat), c in counts.items()}
    for k in sorted(table, key=lambda k: -table[k]):
        print(f"{table[k]:10.1f} ms  {k}")
    print(f"{sum(table.values()):10.1f} ms  total (CPU time per step)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"ms_per_step": table}, f, indent=1)


if __name__ == "__main__":
    main()
