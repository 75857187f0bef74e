#!/usr/bin/env python3
"""kiln against PyTorch on one GPU, in one run: the reference model and a 1B-class Llama,
bf16 compute on f32 master weights, AdamW, clip 1.0, same batch and sequence length.

For each model it runs `kiln train` on `training.device=cuda` with kiln's CubeCL kernels
(`kiln`) and without them (`kiln-composed`: burn's generic ops), then PyTorch eager (SDPA) and
torch.compile (torch_llama.py beside this file), and prints tokens/s, MFU against the GPU's
dense bf16 peak, peak GPU memory (sampled from nvidia-smi for every process alike, plus
PyTorch's own allocator peak), kiln's start-up (kernel compilation and autotuning, before its
first step) and kiln's ratio to each peer. Writes result.json to $OUT (the device tool's output
folder) or beside this file, and keeps every run's log and run directory under --work.

A lent GPU comes for minutes, so the runs go in order of value (--plan) under one deadline
(--deadline): each run gets at most --cap seconds and what is left of the deadline, a run cut
short still reports the steps it finished, and the runs that no longer fit are listed as
skipped. `kiln-profile` and `eager-profile` write per-kernel tables: kiln's kernels through
CubeCL's profiling logger (device time of every launch, in a rerun that reads the model's
`kiln` run's autotune and kernel cache, so no tuning is timed) and PyTorch eager's through
torch.profiler.

Data parallel on one GPU (issue 42): `impl@N` runs N ranks, each an NCCL host of its own
(KILN_NCCL_RANKS_AS_HOSTS for kiln, NCCL_HOSTID per rank for PyTorch: NCCL's socket transport
over loopback), so that several ranks share the one GPU lent: `kiln-dp@N` (replicated, NCCL
all-reduce), `kiln-fsdp@N` (parameters sharded, each stage gathered ahead), `kiln-fsdp-ac@N`
(and activation checkpointing), PyTorch's `ddp@N` and `fsdp@N` (FSDP2, fully_shard per block)
under torchrun. They report tokens/s per rank, the communication's share of a step (kiln: the
seconds NCCL's stream was busy, overlapped with compute or not, over the step; PyTorch: not
measured) and the peak GPU memory of each rank (nvidia-smi, per process) and of all ranks.

Usage: python3 bench/gpu/bench.py [--kiln PATH] [--plan model:impl,...] [--steps N]
                                   [--warmup N] [--deadline S] [--cap S] [--device D]
On the GPU machine this is what bench/gpu/run.sh calls, after unpacking the carried binary.
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from models import MODELS, peak_flops  # noqa: E402

# What runs, most valuable first: each model's kiln and PyTorch eager before anything else.
DEFAULT_PLAN = ("1b:kiln,1b:eager,1b:kiln-flash,1b-8k:kiln-flash,1b-8k:eager,1b:kiln-flash-profile,"
                "1b:kiln-nvrtc,1b-8k:kiln,1b:kiln-nvrtc-profile,"
                "1b:kiln-profile,ref:kiln,ref:eager,1b:compile,1b:kiln-nvrtc-full,"
                "1b:eager-profile,ref:compile,ref:kiln-composed,1b:kiln-composed")
# The config of each kiln variant (`--set` keys of the `[kernels]` section; `kiln train
# --print-config` lists them): `kiln-nvrtc` compiles CubeCL's kernels through CUDA C++ and
# NVRTC instead of LLVM's NVPTX backend (patches/cubecl-cuda: only that backend advertises TMA
# and asynchronous copies, which burn's fastest matmuls need).
# `kiln-nvrtc-full`: that with CubeCL's most thorough autotune (more matmul candidates timed;
# CubeCL's own environment variable).
# `kiln-cubecl`: matrix products on CubeCL's matmul instead of cuBLAS (the before of that change).
# `kiln-flash`: attention by the flash kernels (kernels/attention/cube/flash) instead of by products.
KILN_SETS = {"kiln-nvrtc": ["kernels.cuda_compiler=nvrtc"],
             "kiln-flash": ["kernels.attention=flash"],
             # Other tilings of the flash kernels (rows x cols x planes: forward, dq, dk/dv).
             "kiln-flash-2p": ["kernels.attention=flash",
                               "kernels.flash_tiling=32x64x2,32x32x2,32x32x2"],
             "kiln-flash-8p": ["kernels.attention=flash",
                               "kernels.flash_tiling=128x64x8,128x32x8,64x32x4"],
             "kiln-cubecl": ["kernels.cuda_gemm=cubecl"],
             "kiln-nvrtc-full": ["kernels.cuda_compiler=nvrtc"]}
KILN_ENV = {"kiln-nvrtc-full": {"CUBECL_AUTOTUNE_LEVEL": "full"}}
# Steps of the short rows (the 8192-token row is there for its memory).
SHORT = {"1b-8k": (4, 2), "7b": (3, 1)}


def gpu_memory_sampler(pid):
    """Polls nvidia-smi for the GPU memory of process `pid` (None: of every process on the GPU,
    the ranks of a data-parallel row); returns (stop, peak MiB of one process, {pid: peak MiB},
    peak MiB of all of them together)."""
    peak, per, total = [0.0], {}, [0.0]
    done = threading.Event()

    def poll():
        while not done.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-compute-apps=pid,used_memory",
                     "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=10).stdout
                apps = [(int(p), float(m)) for p, m in
                        (l.split(",") for l in out.strip().splitlines() if "," in l)]
                apps = [(p, m) for p, m in apps if pid is None or p == pid]
                for p, m in apps:
                    per[p] = max(per.get(p, 0.0), m)
                peak[0] = max([peak[0]] + list(per.values()))
                total[0] = max(total[0], sum(m for _, m in apps))
            except (OSError, ValueError, subprocess.SubprocessError):
                pass
            done.wait(0.2)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    return (lambda: (done.set(), t.join())), peak, per, total


def run_sampled(argv, log, timeout, every=False, **kw):
    """Runs argv (stdout and stderr to the file `log`) for at most `timeout` seconds, sampling
    its GPU memory (`every`: every process on the GPU, for a job of several ranks); returns
    (exit code or None when cut short, peak MiB of one process, peak MiB of all together)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, **kw)
        stop, peak, _, total = gpu_memory_sampler(None if every else proc.pid)
        try:
            rc = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        stop()
    return rc, peak[0], total[0]


def tail(path, n=1500):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:].strip()
    except OSError:
        return ""


def kiln_sets(model, batch, seq, steps, device="cuda"):
    vocab, d, layers, nh, nkv, ffn, _, _ = MODELS[model]
    return [
        f"model.vocab_size={vocab}", f"model.d_model={d}", f"model.n_layers={layers}",
        f"model.n_heads={nh}", f"model.n_kv_heads={nkv}", f"model.ffn_hidden={ffn}",
        "model.tie_embeddings=false", "model.scale_residual_init=false",
        f"training.batch_size={batch}", f"training.seq_len={seq}", f"training.steps={steps}",
        f"training.device={device}", "training.dtype=bf16", "training.master_dtype=f32",
        "optimizer.lr=3e-4", "optimizer.weight_decay=0.1", "optimizer.max_grad_norm=1.0",
        "lr_scheduler.kind=constant", "lr_scheduler.warmup_steps=0",
        "checkpoint.interval=0", "checkpoint.snapshot_interval=0", "eval.interval=0",
        "eval.samples=0",
        "guards.frozen_check_interval=0", "guards.snapshot_interval=0",
    ]


def run_kiln(kiln, model, steps, warmup, impl, work, timeout, device="cuda"):
    """`kiln`: kiln's CubeCL kernels on; `kiln-composed`: `training.fused_kernels=false`
    (burn's generic ops only), the before of the kernels' before/after; `kiln-nvrtc`: as `kiln`,
    compiled through NVRTC (`KILN_SETS`). The run directory stays under `work` (its CubeCL
    cache is what a profiled rerun reads)."""
    _, _, _, _, _, _, batch, seq = MODELS[model]
    sets = kiln_sets(model, batch, seq, steps + warmup, device)
    if impl == "kiln-composed":
        sets.append("training.fused_kernels=false")
    sets += KILN_SETS.get(impl, [])
    rd = os.path.join(work, f"{model}-{impl}")
    shutil.rmtree(rd, ignore_errors=True)
    os.makedirs(rd)
    argv = [kiln, "train", "--run-dir", rd, "--no-progress-bar"]
    for s in sets:
        argv += ["--set", s]
    t = time.time()
    rc, peak, _ = run_sampled(argv, rd + ".log", timeout, env={**os.environ, **KILN_ENV.get(impl, {})})
    wall = time.time() - t
    rows = []
    metrics = os.path.join(rd, "metrics.jsonl")
    if os.path.exists(metrics):
        rows = [json.loads(l) for l in open(metrics) if '"step_time_s"' in l]
    r = {"impl": impl, "model": model, "batch": batch, "seq": seq, "gpu_mem_mib": peak,
         "steps_done": len(rows), "run_dir": rd}
    if rows:
        # Start-up: everything before the first step ends, less that step's own time.
        r["first_step_s"] = rows[0]["step_time_s"]
        r["startup_s"] = wall - sum(x["step_time_s"] for x in rows)
    timed = rows[warmup:] if len(rows) > warmup else rows[1:]
    if rc != 0 and not timed:
        why = "cut short" if rc is None else f"exit {rc}"
        return {**r, "error": f"{why} after {wall:.0f} s, {len(rows)} steps: {tail(rd + '.log')}"}
    if rc is None:
        r["note"] = f"cut short at {timeout:.0f} s: {len(timed)} timed steps"
    dt = sum(x["step_time_s"] for x in timed) / len(timed)
    return {**r, "tokens_per_s": batch * seq / dt, "step_ms": dt * 1e3, "loss": timed[-1]["loss"]}


def run_torch(variant, model, steps, warmup, work, timeout, profile=None):
    argv = [sys.executable, os.path.join(HERE, "torch_llama.py"), "--model", model,
            "--variant", variant, "--steps", str(steps), "--warmup", str(warmup)]
    if profile:
        argv += ["--profile", profile]
    log = os.path.join(work, f"{model}-torch-{variant}.log")
    rc, peak, _ = run_sampled(argv, log, timeout)
    if rc != 0:
        why = "cut short" if rc is None else f"exit {rc}"
        return {"impl": f"torch-{variant}", "model": model, "error": f"{why}: {tail(log)}"}
    lines = [l for l in open(log) if l.startswith("{")]
    r = json.loads(lines[-1])
    r["gpu_mem_mib"] = peak
    return r


# What each data-parallel kiln row sets on top of the model's keys.
KILN_DP = {"kiln-dp": [],
           "kiln-fsdp": ["parallelism.shard=parameters"],
           "kiln-fsdp-ac": ["parallelism.shard=parameters",
                            "training.activation_checkpointing=blocks"]}


def gpus():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for l in out.splitlines() if l.startswith("GPU "))


def seed_caches(results, model, rd, ranks):
    """Copies the device cache (compiled kernels, autotune decisions) of the first kiln run of
    `model` in `results` to run directory `rd`, as every rank's, so that no rank compiles."""
    first = next((r["run_dir"] for r in results if r["model"] == model and r.get("run_dir")
                  and r.get("steps_done")), None)
    if first is None:
        return
    for name in os.listdir(first):
        if name.startswith("device-cache-0.db"):
            for k in range(ranks):
                shutil.copy(os.path.join(first, name),
                            os.path.join(rd, name.replace("cache-0", f"cache-{k}", 1)))


def run_kiln_ranks(kiln, model, impl, ranks, steps, warmup, work, timeout, results,
                   device="cuda", extra=()):
    """`impl` (KILN_DP) of `model` on `ranks` ranks of this GPU: `kiln launch --mpi` with each
    rank an NCCL host of its own where the GPUs are fewer than the ranks (one rank: `kiln
    train`). Tokens/s per rank (each rank trains `batch` sequences a step), the seconds NCCL
    was busy over the step time, the peak GPU memory of a rank and of all of them."""
    _, _, _, _, _, _, batch, seq = MODELS[model]
    sets = kiln_sets(model, batch, seq, steps + warmup, device) + KILN_DP[impl] + list(extra)
    rd = os.path.join(work, f"{model}-{impl}-{ranks}")
    shutil.rmtree(rd, ignore_errors=True)
    os.makedirs(rd)
    seed_caches(results, model, rd, ranks)
    train = [kiln, "train", "--run-dir", rd, "--no-progress-bar"]
    for x in sets:
        train += ["--set", x]
    env = {**os.environ, "KILN_LOG": "info"}
    if ranks == 1:
        argv = train
    else:
        argv = [kiln, "launch", "--mpi", "--np", str(ranks), "--timeout", str(int(timeout)),
                "--run-dir", rd, "--"] + train
        if gpus() < ranks:
            env["KILN_NCCL_RANKS_AS_HOSTS"] = "1"
    t = time.time()
    rc, peak, total = run_sampled(argv, rd + ".log", timeout, every=True, env=env)
    wall = time.time() - t
    rows = []
    metrics = os.path.join(rd, "metrics.jsonl")
    if os.path.exists(metrics):
        rows = [json.loads(l) for l in open(metrics) if '"step_time_s"' in l]
    r = {"impl": f"{impl}@{ranks}", "model": model, "batch": batch, "seq": seq, "ranks": ranks,
         "gpu_mem_mib": peak, "gpu_mem_all_mib": total, "steps_done": len(rows), "run_dir": rd}
    if rows:
        r["startup_s"] = wall - sum(x["step_time_s"] for x in rows)
    timed = rows[warmup:] if len(rows) > warmup else rows[1:]
    if rc != 0 and not timed:
        why = "cut short" if rc is None else f"exit {rc}"
        return {**r, "error": f"{why} after {wall:.0f} s, {len(rows)} steps: {tail(rd + '.log')}"}
    if rc is None:
        r["note"] = f"cut short at {timeout:.0f} s: {len(timed)} timed steps"
    dt = sum(x["step_time_s"] for x in timed) / len(timed)
    comm = sum(x.get("allreduce_s", 0.0) for x in timed) / len(timed)
    return {**r, "tokens_per_s": batch * seq / dt, "step_ms": dt * 1e3, "comm_share": comm / dt,
            "loss": timed[-1]["loss"]}


def run_torch_ranks(variant, model, ranks, steps, warmup, work, timeout):
    """PyTorch's `ddp` or `fsdp` (FSDP2) of `model` on `ranks` ranks of this GPU (torchrun,
    each rank an NCCL host of its own)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", os.path.join(HERE, "torch_llama.py"), "--model", model,
            "--variant", variant, "--steps", str(steps), "--warmup", str(warmup),
            "--ranks-as-hosts"]
    log = os.path.join(work, f"{model}-torch-{variant}-{ranks}.log")
    rc, peak, total = run_sampled(argv, log, timeout, every=True)
    if rc != 0:
        why = "cut short" if rc is None else f"exit {rc}"
        return {"impl": f"{variant}@{ranks}", "model": model, "error": f"{why}: {tail(log)}"}
    lines = [l for l in open(log) if l.startswith("{")]
    r = json.loads(lines[-1])
    r.update(impl=f"{variant}@{ranks}", gpu_mem_mib=peak, gpu_mem_all_mib=total)
    return r


CUBECL_PROFILE_TOML = """# Written by bench/gpu/bench.py: CubeCL's profiling logger, the device time of every launch.
[profiling.logger]
level = "basic"
file = "{log}"
append = false
"""


def profile_kiln(kiln, model, impl, results, work, timeout, device="cuda", steps=4):
    """Reruns `model` as `impl` (`kiln`, `kiln-nvrtc`) for `steps` steps with CubeCL's
    profiling logger on (from a cubecl.toml in its working directory), reading the autotune
    and kernel cache of its earlier run in `results` so that nothing is tuned or compiled, and
    sums the device time of every launch by kernel over the steps after the first (which loads
    the kernels into the driver)."""
    first = next((r["run_dir"] for r in results if r["model"] == model and r["impl"] == impl
                  and r.get("steps_done")), None)
    if first is None:
        return {"error": f"no {impl} run of {model} to read the kernel cache of"}
    wd = os.path.join(work, f"{model}-{impl}-profile")
    os.makedirs(wd, exist_ok=True)
    log = os.path.join(wd, "cubecl-profile.log")
    with open(os.path.join(wd, "cubecl.toml"), "w") as f:
        f.write(CUBECL_PROFILE_TOML.format(log=log))
    rd = os.path.join(wd, "run")
    os.makedirs(rd, exist_ok=True)
    for name in os.listdir(first):
        if name.startswith("device-cache"):
            shutil.copy(os.path.join(first, name), rd)
    _, _, _, _, _, _, batch, seq = MODELS[model]
    argv = [kiln, "train", "--run-dir", rd, "--no-progress-bar"]
    # kiln's cuBLAS products, each waited on and timed, in the same format
    # (kernels/device/cublas.rs).
    blas = os.path.join(wd, "cublas-profile.log")
    if os.path.exists(blas):
        os.remove(blas)
    sets = kiln_sets(model, batch, seq, steps, device) + KILN_SETS.get(impl, [])
    for s in sets + [f"kernels.cublas_profile={blas}"]:
        argv += ["--set", s]
    rc, _, _ = run_sampled(argv, os.path.join(wd, "kiln.log"), timeout, cwd=wd,
                        env={**os.environ, **KILN_ENV.get(impl, {})})
    return kernel_table([log, blas], steps, os.path.join(work, f"{model}-{impl}-kernels.txt"), rc)


LAUNCH = re.compile(r"^\| ([0-9.]+)(ns|µs|us|ms|s)\s+\| (.+)$")
UNIT = {"ns": 1e-6, "µs": 1e-3, "us": 1e-3, "ms": 1.0, "s": 1e3}


def read_launches(log, steps):
    """One log's launches (`| 1.2ms | name`) per step: the last `steps - 1` steps, found as
    the period of the names' sequence (every step after the first launches the same kernels in
    the same order; the first also compiles, loads and tunes), else all of them over `steps`.
    Returns {name: (launches, ms)} per step."""
    launches = [(float(m.group(1)) * UNIT[m.group(2)], m.group(3).strip())
                for m in map(LAUNCH.match, (l.rstrip() for l in open(log, errors="replace")))
                if m]
    names, reps = [l[1] for l in launches], max(steps - 1, 1)
    # A step is at most len/steps launches (the first is the longest) and more than half that;
    # shorter periods (one layer's kernels) repeat inside a step.
    per = next((n for n in range(len(names) // max(steps, 1), len(names) // (2 * max(steps, 1)), -1)
                if n > 0 and all(names[-n:] == names[len(names) - (k + 1) * n:len(names) - k * n]
                       for k in range(1, reps))), None)
    if per is None or steps < 2:
        per, reps = len(launches) // max(steps, 1), max(steps, 1)
        window = launches
    else:
        window = launches[-per * reps:]
    by = {}
    for ms, name in window:
        n, t = by.get(name, (0, 0.0))
        by[name] = (n + 1 / reps, t + ms / reps)
    return by


def kernel_table(logs, steps, out, rc):
    """Sums the per-launch lines of `logs` (CubeCL's profiling logger, kiln's cuBLAS log) by
    kernel, per step: ms, launches, share."""
    by = {}
    for log in logs:
        if not os.path.exists(log) and log != logs[0]:
            continue
        try:
            by.update(read_launches(log, steps))
        except OSError as e:
            return {"error": f"no profile log ({e}); kiln exit {rc}"}
    total = sum(t for _, t in by.values())
    rows = sorted(by.items(), key=lambda kv: -kv[1][1])
    with open(out, "w") as f:
        f.write(f"# kiln's kernels (CubeCL's and cuBLAS's), per step after the first (each launch "
                f"waited on); ms per step (share of kernel time); kiln exit {rc}\n")
        f.write(f"total {total:.2f} ms per step, {round(sum(n for n, _ in by.values()))} launches per step\n")
        for name, (n, t) in rows[:50]:
            short = name if len(name) <= 110 else name[:60] + " ... " + name[-45:]
            f.write(f"{t:9.3f} ms {round(n):6d}x {100 * t / max(total, 1e-9):5.1f}%  {short}\n")
    return {"kernel_ms_per_step": total, "table": out, "kernels": len(by)}


def mfu(r, name):
    vocab, d, layers, nh, nkv, ffn, _, _ = MODELS[r["model"]]
    hd = d // nh
    # torchtitan's count, as torch_llama.py: 6 x parameters without the embedding (a lookup),
    # plus attention's 12 * L * d * T.
    params = layers * (2 * d + d * d + 2 * d * nkv * hd + d * d + 3 * d * ffn) + d + d * vocab
    flops = 6 * params + 12 * layers * d * r["seq"]
    return flops * r["tokens_per_s"] / peak_flops(name)


def print_table(results):
    print(f"\n{'model':6} {'impl':14} {'tokens/s':>10} {'step ms':>9} {'MFU':>6} {'GPU MiB':>8} "
          f"{'start s':>7} {'kiln/this':>9}  (data-parallel rows: per rank; comm share; all ranks' MiB)")
    for r in results:
        if "tokens_per_s" not in r:
            if "error" in r or "skipped" in r:
                print(f"{r['model']:6} {r['impl']:14} {r.get('skipped') or 'error: ' + r['error'][:300]}")
            continue
        k = next((x for x in results if x["model"] == r["model"] and x["impl"] == "kiln"
                  and "tokens_per_s" in x), None)
        ratio = f"{k['tokens_per_s'] / r['tokens_per_s']:.3f}" if k else "-"
        start = f"{r['startup_s']:.0f}" if "startup_s" in r else "-"
        dp = ""
        if "@" in r["impl"]:
            share = f"{100 * r['comm_share']:.0f}%" if "comm_share" in r else "-"
            dp = f"  comm {share}, all ranks {r.get('gpu_mem_all_mib', 0):.0f} MiB"
        print(f"{r['model']:6} {r['impl']:14} {r['tokens_per_s']:10.0f} {r['step_ms']:9.1f} "
              f"{100 * r['mfu']:5.1f}% {r['gpu_mem_mib']:8.0f} {start:>7} {ratio:>9}{dp}"
              + (f"  ({r['note']})" if "note" in r else ""))


def gpu_name():
    """The first GPU's name by nvidia-smi, or why there is none (--device flex on a CPU)."""
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=60).stdout.split("\n")
    except (OSError, subprocess.SubprocessError) as e:
        return f"no GPU ({e})"
    return next((n.strip() for n in names if n.strip()), "no GPU (nvidia-smi listed none)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", default=os.path.join(HERE, "carry", "kiln"))
    ap.add_argument("--plan", default=DEFAULT_PLAN, help="model:impl,... in order")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--deadline", type=float, default=3600, help="seconds for all runs")
    ap.add_argument("--cap", type=float, default=240, help="seconds for any one run")
    ap.add_argument("--device", default="cuda", help="kiln's device (flex: tries the harness on a CPU)")
    ap.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "kiln-gpu-bench"))
    a = ap.parse_args()
    a.kiln = os.path.abspath(a.kiln)  # the profiled reruns run in a directory of their own
    start = time.time()
    os.makedirs(a.work, exist_ok=True)
    name = gpu_name()
    print(f"GPU: {name} (dense bf16 peak {peak_flops(name) / 1e12:.0f} TFLOP/s)", flush=True)
    out = os.environ.get("OUT") or HERE
    results = []

    def left():
        return a.deadline - (time.time() - start)

    def save():
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"gpu": name, "results": results}, f, indent=1)

    for item in a.plan.split(","):
        model, impl = item.split(":")
        steps, warmup = SHORT.get(model, (a.steps, a.warmup))
        budget = min(a.cap, left())
        if budget < 20:
            results.append({"impl": impl, "model": model, "skipped": "skipped: past the deadline"})
            continue
        t = time.time()
        base, _, n = impl.partition("@")
        if n:
            ranks = int(n)
            if base in KILN_DP:
                # The 7B row: the estimate's safety margin (x1.25) would refuse 4 ranks on one
                # GPU; they are tried anyway, and what they peak at is the answer.
                extra = ["training.device_memory_gb=1000"] if model == "7b" else []
                r = run_kiln_ranks(a.kiln, model, base, ranks, steps, warmup, a.work, budget,
                                   results, a.device, extra)
            else:
                r = run_torch_ranks(base, model, ranks, steps, warmup, a.work, budget)
        elif impl.startswith("kiln") and impl.endswith("-profile"):
            base = impl[: -len("-profile")]
            r = {"impl": impl, "model": model,
                 **profile_kiln(a.kiln, model, base, results, a.work, budget, a.device)}
        elif impl == "eager-profile":
            table = os.path.join(a.work, f"{model}-torch-kernels.txt")
            r = run_torch("eager", model, 3, 2, a.work, budget, profile=table)
            r = {"impl": impl, "model": model, "table": table,
                 **({"error": r["error"]} if "error" in r else {})}
        elif impl.startswith("kiln"):
            r = run_kiln(a.kiln, model, steps, warmup, impl, a.work, budget, a.device)
        else:
            r = run_torch(impl, model, steps, warmup, a.work, budget)
        if "tokens_per_s" in r:
            r["seq"] = r.get("seq") or MODELS[model][7]
            r["mfu"] = mfu(r, name)
        r["wall_s"] = time.time() - t
        results.append(r)
        print(json.dumps(r), flush=True)
        if os.path.exists(r.get("table", "")):
            print(open(r["table"]).read(), flush=True)
        save()
    print_table(results)
    save()


if __name__ == "__main__":
    main()
