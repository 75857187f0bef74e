#!/usr/bin/env python3
"""kiln's performance guard: counts work, not time.

Runs fixed workloads of the real `kiln` binary under valgrind's callgrind, which counts the
instructions executed (Ir): the same on a quiet machine and a busy one, so that a few percent
more is a regression and not noise. Beside each count, the workload's peak memory (peak RSS,
from a native run: callgrind's own memory would drown it). Compares both with the baselines
committed in bench/guard/baselines.json and fails when a count grows past its tolerance,
printing the functions whose instructions grew most (against the committed per-function
profile, bench/guard/profiles/WORKLOAD.json).

    bench/guard/guard.py                 # check (CI: .ci/run)
    bench/guard/guard.py --bless         # accept the current counts as the new baselines
    bench/guard/guard.py --only data     # some workloads (data-build, data-reopen, train-steps)

See bench/guard/README.md for the workloads, the tolerances and when to bless.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
import corpora  # noqa: E402

BASELINES = HERE / "baselines.json"
PROFILES = HERE / "profiles"
# Tolerances (fractions of the baseline). Instruction counts of these single-threaded
# workloads repeat to within 0.1% run to run (bench/guard/README.md); 3% is far above that
# noise and below what a real regression of a workload costs (an extra pass over the index,
# a slower kernel). Peak RSS moves with allocator decisions and page-fault granularity: 10%.
TOLERANCE = {"instructions": 0.03, "peak_rss_kib": 0.10}
# Functions below this share of a workload's instructions are summed into one row of the
# committed profile (it would otherwise hold thousands of rows of burn's generics).
PROFILE_FLOOR = 0.0005

SEQ_LEN = 256
SAMPLES = 4_000_000
# Three steps of a Llama on one thread: d_model 128, 2 layers, GQA 4/2 heads, SwiGLU 384, batch
# 3 x 128 tokens. Every kernel of a step runs (matmuls, attention, norms, the fused head and
# loss, AdamW, clipping), and the steps are most of the count; callgrind runs it about 50
# times slower than native, so this is the size that fits CI's two minutes (README.md).
TRAIN_SETS = [
    "training.steps=3", "training.threads=1", "training.compute_shards=1",
    "training.seq_len=128", "training.batch_size=3",
    "model.d_model=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "model.ffn_hidden=384",
    "eval.samples=0", "checkpoint.interval=1000", "checkpoint.snapshot_interval=0",
]
# The trainer's step: train-steps counts only what runs inside it (start-up, the data set-up
# and the final checkpoint are left out). Update it when the trainer's step function moves.
STEP_FUNCTION = "kiln_train::trainer::Trainer::train_step"
WORKLOADS = ["data-build", "data-reopen", "train-steps"]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


HELPERS = {
    # Under valgrind (which runs one thread at a time) every sched_yield of rayon's idle
    # workers waits for the scheduler: the training steps took 120 s of wall time for 12 s of
    # work. A preloaded sched_yield that returns at once; yields do no counted work either way.
    "noyield.so": ("int sched_yield(void) { return 0; }\n", ["-shared", "-fPIC"]),
    # Peak RSS of a command, measured from a process of a few pages (bench/peakrss.c says why).
    "peakrss": ((ROOT / "bench" / "peakrss.c").read_text(), []),
}


def build_helpers(work: Path):
    """{name: path} of the helpers above, compiled with the system's C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        sys.exit("guard: needs a C compiler (cc) for its two small helpers")
    out = {}
    for name, (src, flags) in HELPERS.items():
        c = work / (name.split(".")[0] + ".c")
        c.write_text(src)
        out[name] = work / name
        subprocess.run([cc, "-O2", *flags, "-o", str(out[name]), str(c)], check=True)
    return out


def native(cmd, env, peakrss):
    """Runs cmd natively; returns its peak RSS in KiB."""
    r = subprocess.run([str(peakrss)] + [str(c) for c in cmd], capture_output=True, text=True,
                       env=env)
    if r.returncode != 0:
        sys.exit(f"guard: {' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stderr[-4000:]}")
    m = re.search(r"^peak_rss_kib=(\d+) ", r.stderr, re.M)
    if m is None:
        sys.exit(f"guard: no peak RSS from {peakrss}")
    return int(m.group(1))


def callgrind(cmd, out: Path, env, step=None):
    """Runs cmd under callgrind; returns (Ir, {function: self Ir}). With `step` (a function
    name, callgrind's wildcards allowed), only what runs inside that function counts, on every
    thread: callgrind dumps its counters on entering and on leaving it, and the dumps that end
    on leaving are summed."""
    vg = ["valgrind", "--tool=callgrind", "--fair-sched=yes", f"--callgrind-out-file={out}"]
    if step:
        vg += [f"--dump-before={step}", f"--dump-after={step}"]
    r = subprocess.run(vg + [str(c) for c in cmd], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"guard: callgrind run failed ({r.returncode}):\n{r.stderr[-4000:]}")
    if not step:
        return read_profile(out)
    total, funcs, steps = 0, {}, 0
    for dump in sorted(out.parent.glob(out.name + ".*")):
        head = dump.read_text(errors="replace")[:4000]
        if not re.search(r"^desc: Trigger: --dump-after", head, re.M):
            continue
        ir, fs = read_profile(dump)
        total += ir
        steps += 1
        for f, c in fs.items():
            funcs[f] = funcs.get(f, 0) + c
    if steps == 0:
        sys.exit(f"guard: no call of {step} was counted: is STEP_FUNCTION in {__file__} still "
                 f"the trainer's step function?")
    return total, funcs


FN = re.compile(r"c?fn=\((\d+)\)(?: (.*))?$")


def read_profile(path: Path):
    """A callgrind output's total Ir and each function's self Ir (its own cost lines, not the
    inclusive cost lines that follow each `calls=`), read straight from the file."""
    names, funcs, fn, skip, total = {}, {}, None, False, None
    with open(path, errors="replace") as f:
        for line in f:
            c = line[:1]
            if c.isdigit() or c in "+-*":
                if skip:
                    skip = False
                elif fn is not None:
                    funcs[fn] = funcs.get(fn, 0) + int(line.split()[-1])
            elif line.startswith(("fn=", "cfn=")):
                m = FN.match(line.rstrip("\n"))
                if m is None:
                    name = line.split("=", 1)[1].rstrip("\n")
                else:
                    if m.group(2) is not None:
                        names[m.group(1)] = m.group(2)
                    name = names.get(m.group(1), m.group(1))
                if line.startswith("fn="):
                    fn = name
            elif line.startswith("calls="):
                skip = True
            elif line.startswith(("summary:", "totals:")):
                total = int(line.split()[1])
    if total is None:
        sys.exit(f"guard: no totals in {path}")
    return total, funcs


def measure(kiln: Path, only, work: Path):
    """{workload: {"instructions", "peak_rss_kib", "functions"}}. The data workloads and the
    training steps run under callgrind side by side (valgrind uses one core per process)."""
    import threading

    env = dict(os.environ, KILN_LOG="warn", NO_COLOR="1")
    helpers = build_helpers(work)
    vg_env = dict(env, LD_PRELOAD=str(helpers["noyield.so"]))
    results, jobs = {}, []
    if any(w.startswith("data") for w in only):
        t0 = time.time()
        listing, docs, tokens = corpora.write(work / "corpora")
        log(f"  corpora: {len(corpora.CORPORA)} datasets, {docs:,} documents, {tokens:,} tokens "
            f"({time.time() - t0:.1f} s)")

        def blend(cache):
            return [kiln, "data", "blend", listing, "--seq-len", SEQ_LEN, "--samples", SAMPLES,
                    "--seed", 1234, "--verify", "off", "--threads", 1, "--cache-dir", cache,
                    "--json"]

        rss = {"data-build": native(blend(work / "cache-native"), env, helpers["peakrss"]),
               "data-reopen": native(blend(work / "cache-native"), env, helpers["peakrss"])}

        def data():
            t0 = time.time()
            for name in ("data-build", "data-reopen"):
                ir, funcs = callgrind(blend(work / "cache-cg"), work / f"cg.{name}", vg_env)
                if name in only:
                    results[name] = {"instructions": ir, "peak_rss_kib": rss[name],
                                     "functions": funcs}
            log(f"  data: callgrind {time.time() - t0:.0f} s")

        jobs.append(data)
    if "train-steps" in only:
        def train(run):
            sets = [a for s in TRAIN_SETS for a in ("--set", s)]
            return [kiln, "train", "--run-dir", run, "--no-progress-bar"] + sets

        train_rss = native(train(work / "run-native"), env, helpers["peakrss"])

        def steps():
            t0 = time.time()
            (work / "cg-train").mkdir()
            ir, funcs = callgrind(train(work / "run-cg"), work / "cg-train" / "cg.train-steps",
                                  vg_env, step=STEP_FUNCTION)
            results["train-steps"] = {"instructions": ir, "peak_rss_kib": train_rss,
                                      "functions": funcs}
            log(f"  train: callgrind {time.time() - t0:.0f} s")

        jobs.append(steps)
    errors = []

    def run(job):
        try:
            job()
        except SystemExit as e:
            errors.append(str(e))

    threads = [threading.Thread(target=run, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        sys.exit("\n".join(errors))
    return results


def valgrind_version():
    return subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout.strip()


def compact(funcs, total):
    """The committed profile: functions at or above PROFILE_FLOOR of the total, the rest summed."""
    keep = {f: c for f, c in funcs.items() if c >= PROFILE_FLOOR * total}
    rest = total - sum(keep.values())
    rows = sorted(keep.items(), key=lambda kv: -kv[1])
    return {"total": total, "rest": rest, "functions": dict(rows)}


def grew(name, now_funcs, now_total, limit=12):
    """Prints the functions whose instructions grew most since the committed profile."""
    path = PROFILES / f"{name}.json"
    if not path.exists():
        print(f"    (no committed profile {path.relative_to(ROOT)} to compare functions with)")
        return
    base = json.loads(path.read_text())
    old = base["functions"]
    floor = PROFILE_FLOOR * base["total"]
    rows = []
    for f in set(old) | {f for f, c in now_funcs.items() if c >= floor}:
        a, b = old.get(f, 0), now_funcs.get(f, 0)
        if b > a:
            rows.append((b - a, a, b, f))
    rows.sort(reverse=True)
    print(f"    functions that grew most (self instructions, baseline -> now; "
          f"'<' = under {PROFILE_FLOOR:.2%} of the baseline's total, not in its profile):")
    for d, a, b, f in rows[:limit]:
        was = f"{a:>14,}" if f in old else f"{'<':>14}"
        print(f"      +{d:>13,}  {was} -> {b:>14,}  {f[:150]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kiln", help="the kiln binary (default: build target/release/kiln with "
                    "--features kiln/mpi, as CI's test build does)")
    ap.add_argument("--bless", action="store_true", help="write the current counts as the baselines")
    ap.add_argument("--only", action="append", help="workloads whose name starts with this (repeatable)")
    ap.add_argument("--keep", help="keep the work directory here (callgrind outputs, corpora)")
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("guard: valgrind is not installed (Debian: apt-get install valgrind)")
    kiln = Path(args.kiln) if args.kiln else None
    if kiln is None:
        target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "kiln", "--features", "kiln/mpi"],
                       cwd=ROOT, check=True)
        kiln = target / "release" / "kiln"
    kiln = kiln.resolve()
    only = [w for w in WORKLOADS if not args.only or any(w.startswith(o) for o in args.only)]
    work = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="kiln-guard-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    log(f"guard: {kiln} under {valgrind_version()}: {', '.join(only)}")
    try:
        now = measure(kiln, only, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    base = json.loads(BASELINES.read_text()) if BASELINES.exists() else {"workloads": {}}
    if args.bless:
        base["valgrind"] = valgrind_version()
        base["tolerance"] = TOLERANCE
        PROFILES.mkdir(exist_ok=True)
        for name, r in now.items():
            base["workloads"][name] = {"instructions": r["instructions"],
                                       "peak_rss_kib": r["peak_rss_kib"]}
            (PROFILES / f"{name}.json").write_text(
                json.dumps(compact(r["functions"], r["instructions"]), indent=1) + "\n")
            print(f"blessed {name}: {r['instructions']:,} instructions, "
                  f"peak RSS {r['peak_rss_kib']:,} KiB")
        BASELINES.write_text(json.dumps(base, indent=2) + "\n")
        print(f"wrote {BASELINES.relative_to(ROOT)} and {PROFILES.relative_to(ROOT)}/; commit them "
              f"with the change that moved the counts, saying why")
        return 0
    if base.get("valgrind") and base["valgrind"] != valgrind_version():
        print(f"note: baselines were counted under {base['valgrind']}, this is "
              f"{valgrind_version()}; counts may differ by that alone")
    failed = False
    print(f"{'workload':<12} {'metric':<13} {'baseline':>15} {'now':>15} {'change':>8}  limit")
    for name, r in now.items():
        b = base["workloads"].get(name)
        if b is None:
            print(f"{name:<12} no baseline: run bench/guard/guard.py --bless")
            failed = True
            continue
        bad = False
        for metric in ("instructions", "peak_rss_kib"):
            old, cur = b[metric], r[metric]
            change = cur / old - 1 if old else 0.0
            over = change > TOLERANCE[metric]
            bad |= over
            failed |= over
            flag = "FAIL" if over else ("lower: bless?" if change < -TOLERANCE[metric] else "ok")
            print(f"{name:<12} {metric:<13} {old:>15,} {cur:>15,} {change:>+8.2%}  "
                  f"+{TOLERANCE[metric]:.0%}  {flag}")
        if bad:
            grew(name, r["functions"], r["instructions"])
    print(f"guard: {time.time() - t0:.0f} s")
    if failed:
        print("guard: FAILED. If the change is meant to cost more, re-bless and commit the new "
              "baselines with it: bench/guard/guard.py --bless (bench/guard/README.md)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
