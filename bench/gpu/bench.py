#!/usr/bin/env python3
"""kiln against PyTorch on one GPU, in one run: the reference model and a 1B-class Llama,
bf16 compute on f32 master weights, AdamW, clip 1.0, same batch and sequence length.

For each model it runs `kiln train` on `training.device=cuda` twice, with kiln's CubeCL kernels
(`kiln`) and without them (`kiln-composed`: burn's generic ops), then PyTorch eager (SDPA) and
torch.compile (torch_llama.py beside this file), and prints tokens/s, MFU against the GPU's
dense bf16 peak, peak GPU memory (sampled from nvidia-smi for every process alike, plus
PyTorch's own allocator peak) and kiln's ratio to each peer. Writes result.json to $OUT
(the device tool's output folder) or beside this file.

Usage: python3 bench/gpu/bench.py [--kiln PATH] [--models ref,1b] [--steps N] [--warmup N]
On the GPU machine this is what bench/gpu/run.sh calls, after unpacking the carried binary.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from torch_llama import MODELS, peak_flops  # noqa: E402


def gpu_memory_sampler(pid_root):
    """Polls nvidia-smi for the GPU memory of `pid_root`'s processes; returns (stop, peak)."""
    peak = [0.0]
    done = threading.Event()

    def poll():
        while not done.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-compute-apps=pid,used_memory",
                     "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=10).stdout
                used = sum(float(m) for p, m in (l.split(",") for l in out.strip().splitlines() if "," in l)
                           if int(p) in pid_root())
                peak[0] = max(peak[0], used)
            except (OSError, ValueError, subprocess.SubprocessError):
                pass
            done.wait(0.2)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    return (lambda: (done.set(), t.join())), peak


def run_sampled(argv, **kw):
    """Runs argv, sampling its GPU memory; returns (CompletedProcess-like, peak MiB)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    stop, peak = gpu_memory_sampler(lambda: {proc.pid})
    out, err = proc.communicate()
    stop()
    return proc.returncode, out, err, peak[0]


def kiln_sets(model, batch, seq, steps):
    vocab, d, layers, nh, nkv, ffn, _, _ = MODELS[model]
    return [
        f"model.vocab_size={vocab}", f"model.d_model={d}", f"model.n_layers={layers}",
        f"model.n_heads={nh}", f"model.n_kv_heads={nkv}", f"model.ffn_hidden={ffn}",
        "model.tie_embeddings=false", "model.scale_residual_init=false",
        f"training.batch_size={batch}", f"training.seq_len={seq}", f"training.steps={steps}",
        "training.device=cuda", "training.dtype=bf16", "training.master_dtype=f32",
        "optimizer.lr=3e-4", "optimizer.weight_decay=0.1", "optimizer.max_grad_norm=1.0",
        "lr_scheduler.kind=constant", "lr_scheduler.warmup_steps=0",
        "checkpoint.interval=0", "eval.interval=0", "eval.samples=0",
        "guards.frozen_check_interval=0", "guards.snapshot_interval=0",
    ]


def run_kiln(kiln, model, steps, warmup, impl="kiln"):
    """`kiln`: kiln's CubeCL kernels on; `kiln-composed`: `training.fused_kernels=false`
    (burn's generic ops only), the before of the kernels' before/after."""
    _, _, _, _, _, _, batch, seq = MODELS[model]
    sets = kiln_sets(model, batch, seq, steps + warmup)
    if impl == "kiln-composed":
        sets.append("training.fused_kernels=false")
    with tempfile.TemporaryDirectory() as rd:
        argv = [kiln, "train", "--run-dir", rd, "--no-progress-bar"]
        for s in sets:
            argv += ["--set", s]
        rc, out, err, peak = run_sampled(argv)
        if rc != 0:
            return {"impl": impl, "model": model, "error": f"exit {rc}: {err.strip()[-2000:]}"}
        rows = [json.loads(l) for l in open(os.path.join(rd, "metrics.jsonl")) if '"step_time_s"' in l]
    timed = rows[warmup:]
    dt = sum(r["step_time_s"] for r in timed) / len(timed)
    return {"impl": impl, "model": model, "batch": batch, "seq": seq,
            "tokens_per_s": batch * seq / dt, "step_ms": dt * 1e3, "loss": timed[-1]["loss"],
            "gpu_mem_mib": peak}


def run_torch(variant, model, steps, warmup):
    argv = [sys.executable, os.path.join(HERE, "torch_llama.py"), "--model", model,
            "--variant", variant, "--steps", str(steps), "--warmup", str(warmup)]
    rc, out, err, peak = run_sampled(argv)
    if rc != 0:
        return {"impl": f"torch-{variant}", "model": model, "error": f"exit {rc}: {err.strip()[-2000:]}"}
    r = json.loads(out.strip().splitlines()[-1])
    r["gpu_mem_mib"] = peak
    return r


def mfu(r, name):
    vocab, d, layers, nh, nkv, ffn, _, _ = MODELS[r["model"]]
    hd = d // nh
    params = layers * (2 * d + d * d + 2 * d * nkv * hd + d * d + 3 * d * ffn) + d + d * vocab
    flops = 6 * params + 12 * layers * d * r["seq"]
    return flops * r["tokens_per_s"] / peak_flops(name)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", default=os.path.join(HERE, "carry", "kiln"))
    ap.add_argument("--models", default="ref,1b")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    a = ap.parse_args()
    name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip().splitlines()[0]
    print(f"GPU: {name} (dense bf16 peak {peak_flops(name) / 1e12:.0f} TFLOP/s)", flush=True)
    results = []
    for model in a.models.split(","):
        for impl in ["kiln", "kiln-composed", "eager", "compile"]:
            t = time.time()
            r = (run_kiln(a.kiln, model, a.steps, a.warmup, impl) if impl.startswith("kiln")
                 else run_torch(impl, model, a.steps, a.warmup))
            if "tokens_per_s" in r:
                r["seq"] = r.get("seq") or MODELS[model][7]
                r["mfu"] = mfu(r, name)
            r["wall_s"] = time.time() - t
            results.append(r)
            print(json.dumps(r), flush=True)
    print(f"\n{'model':6} {'impl':14} {'tokens/s':>12} {'step ms':>9} {'MFU':>6} {'GPU MiB':>9} {'kiln/this':>9}")
    for r in results:
        if "error" in r:
            print(f"{r['model']:6} {r['impl']:14} error: {r['error'][:200]}")
            continue
        k = next((x for x in results if x["model"] == r["model"] and x["impl"] == "kiln"
                  and "tokens_per_s" in x), None)
        ratio = f"{k['tokens_per_s'] / r['tokens_per_s']:.3f}" if k else "-"
        print(f"{r['model']:6} {r['impl']:14} {r['tokens_per_s']:12.0f} {r['step_ms']:9.1f} "
              f"{100 * r['mfu']:5.1f}% {r['gpu_mem_mib']:9.0f} {ratio:>9}")
    out = os.environ.get("OUT") or HERE
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"gpu": name, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
