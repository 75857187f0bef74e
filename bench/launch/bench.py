#!/usr/bin/env python3
"""kiln launch vs ezpz launch: launch overhead of `true` and time from a hang to the kill.

Run from the repository root after `cargo build --release -p kiln`:

    python3 bench/launch/bench.py [--reps 50] [--kiln PATH]

ezpz is installed from PyPI (`ezpz-ai`) into bench/launch/.venv. If that install does not
provide `ezpz launch`, the script says exactly what it found and measures the nearest honest
stand-in: the floor any Python launcher that imports torch pays (interpreter start,
`import torch`, spawn, a line-reading loop). That is a lower bound on ezpz's overhead, not
ezpz itself, and is labelled as such.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / "bench" / "launch" / ".venv"


def median_time(argv: list[str], reps: int, env=None) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=False)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def find_kiln(arg: str | None) -> Path:
    cands = [arg] if arg else []
    cands += [os.environ.get("CARGO_TARGET_DIR", "") + "/release/kiln", str(ROOT / "target/release/kiln")]
    for c in cands:
        if c and Path(c).is_file():
            return Path(c)
    sys.exit("kiln binary not found: run `cargo build --release -p kiln` or pass --kiln")


def setup_ezpz() -> tuple[Path | None, str]:
    """Installs ezpz-ai from PyPI; returns (ezpz executable providing `launch`, or None; note)."""
    py = VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", "ezpz-ai"], capture_output=True, text=True)
    if pip.returncode != 0:
        return None, f"pip install ezpz-ai failed: {pip.stderr.strip()[-300:]}"
    show = subprocess.run([str(py), "-m", "pip", "show", "ezpz-ai", "ezpz"], capture_output=True, text=True).stdout
    probe = subprocess.run([str(py), "-c", "import ezpz.launch"], capture_output=True, text=True)
    if probe.returncode == 0:
        exe = VENV / "bin" / "ezpz"
        return exe, "ezpz.launch importable"
    versions = " / ".join(
        f"{block.split('Name: ')[1].splitlines()[0]} {block.split('Version: ')[1].splitlines()[0]}"
        for block in show.split("---")
        if "Name: " in block and "Version: " in block
    )
    summary = [l for l in show.splitlines() if l.startswith("Summary:")]
    return None, (
        f"PyPI installed {versions}; `import ezpz.launch` fails "
        f"({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else 'no module'}); "
        f"package summaries: {summary}. The PyPI `ezpz-ai` has no launcher: it only depends on "
        "`ezpz`, an unrelated image pan-zoom tool; the real ezpz lives on GitHub, which this "
        "machine cannot reach."
    )


def hang_to_kill(cmd_prefix: list[str], timeout: float, reps: int) -> list[float]:
    """Seconds from the hang starting (the last output line is read) to the launcher's exit."""
    out = []
    for _ in range(reps):
        p = subprocess.Popen(
            cmd_prefix + ["sh", "-c", "echo step=1; exec sleep 60"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert p.stdout is not None
        p.stdout.readline()
        t = time.perf_counter()
        p.wait()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50, help="repetitions of the overhead measurement")
    ap.add_argument("--kiln", help="path to the kiln binary")
    ap.add_argument("--torch-python", default=str(ROOT / "bench/.venv/bin/python"),
                    help="a Python with torch, for the Python-launcher floor")
    args = ap.parse_args()
    kiln = find_kiln(args.kiln)
    tmp = Path(tempfile.mkdtemp(prefix="kiln-bench-"))
    env = {k: v for k, v in os.environ.items() if k not in ("KILN_PROGRESS_DIR", "PBS_JOBID", "SLURM_JOB_ID")}
    env["KILN_PROGRESS_DIR"] = str(tmp / "progress")  # one shared dir: no per-run mkdir noise
    (tmp / "progress").mkdir()

    true = shutil.which("true") or "/bin/true"
    base = median_time([true], args.reps)
    kiln_t = median_time([str(kiln), "launch", "--run-dir", str(tmp / "run"), "--", true], args.reps, env)
    kiln_over = kiln_t - base
    rows = [("true (no launcher)", base, None), ("kiln launch -- true", kiln_t, kiln_over)]

    ezpz, note = setup_ezpz()
    print(f"ezpz: {note}")
    ezpz_over = None
    if ezpz is not None:
        e = median_time([str(ezpz), "launch", "--", true], max(5, args.reps // 5), env)
        ezpz_over = e - base
        rows.append(("ezpz launch -- true", e, ezpz_over))
    else:
        reader = (
            "import subprocess, sys\n"
            "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)\n"
            "for line in p.stdout: sys.stdout.buffer.write(line)\n"
            "sys.exit(p.wait())\n"
        )
        bare = median_time([sys.executable, "-c", reader, true], max(5, args.reps // 5))
        rows.append(("stand-in: python launcher, no imports", bare, bare - base))
        if Path(args.torch_python).exists():
            tp = median_time([args.torch_python, "-c", "import torch\n" + reader, true], max(5, args.reps // 10))
            ezpz_over = tp - base
            rows.append(("stand-in: python launcher + import torch", tp, ezpz_over))

    print(f"\nlaunch overhead, median of {args.reps} (stand-ins: fewer) runs")
    print(f"{'what':<44}{'wall s':>10}{'overhead s':>12}")
    for name, t, over in rows:
        print(f"{name:<44}{t:>10.4f}{'' if over is None else f'{over:>12.4f}'}")
    if ezpz_over:
        label = "ezpz" if ezpz is not None else "python+torch stand-in"
        print(f"kiln overhead / {label} overhead = {kiln_over / ezpz_over:.4f} "
              f"({ezpz_over / max(kiln_over, 1e-9):.0f}x less; goal: <= 0.1)")

    timeout = 1.0
    k = hang_to_kill([str(kiln), "launch", "--timeout", str(timeout), "--grace", "1",
                      "--run-dir", str(tmp / "hang")], timeout, 5)
    print(f"\nhang to kill with --timeout {timeout:g} (5 runs): kiln median {statistics.median(k):.3f} s, "
          f"max {max(k):.3f} s; detection beyond the timeout: {statistics.median(k) - timeout:.3f} s (goal < 1 s)")
    if ezpz is not None:
        e = hang_to_kill([str(ezpz), "launch", "--timeout", str(timeout), "--"], timeout, 5)
        print(f"ezpz median {statistics.median(e):.3f} s; ratio kiln/ezpz {statistics.median(k) / statistics.median(e):.3f}")
    else:
        print("ezpz: not measurable here (no launcher in the PyPI package). For reference, ezpz's own "
              "source (src/ezpz/launch_autoretry.py) sets its idle-output watchdog to "
              "DEFAULT_AUTO_RETRY_IDLE_TIMEOUT_S = 1800 s; any output resets it, so a hang whose "
              "heartbeat keeps printing is not caught by it (kiln's --stall-timeout catches that).")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
