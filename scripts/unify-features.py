#!/usr/bin/env python3
"""Regenerates crates/kiln-workspace-hack/Cargo.toml (see the comment at its top).

For the two builds CI runs (.ci/run), reads `cargo tree` (features of every package, host
side and target side apart), finds the crates both builds compile with different features,
and writes them as dependencies of kiln-workspace-hack with the union of their features:
[dependencies] for the target side, [build-dependencies] for the host side (build scripts,
proc macros and what they use), as resolver 2 resolves the two apart.

Usage: scripts/unify-features.py [--check]   (--check: exit 1 if the file is out of date)
"""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HACK = ROOT / "crates/kiln-workspace-hack/Cargo.toml"
BUILDS = [
    ["--workspace", "--features", "kiln/mpi"],
    ["-p", "kiln-train", "-p", "kiln", "--features", "kiln/mpi,kiln/cubecl-cpu,kiln/cuda,kiln/rocm"],
]
MAX_NEW = 2
BEGIN, END = "# BEGIN GENERATED (scripts/unify-features.py)", "# END GENERATED"
LINE = re.compile(r"^(?P<indent>[│├└─ ]*)(?P<body>.*)$")
NODE = re.compile(r"^(?P<name>\S+) v(?P<ver>\S+)(?P<kind>(?: \([^)]*\))*) \[(?P<feats>[^\]]*)\]")


def tree(args):
    """{(name, version): {side: features}} of one build, side "host" or "target" where the
    build compiles the package on that side."""
    out = subprocess.run(
        ["cargo", "tree", "-e", "normal,build,dev", "-f", "{p} [{f}]", *args],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout
    found = {}
    stack = []  # (depth, host) of the ancestors
    for raw in out.splitlines():
        m = LINE.match(raw)
        depth, body = len(m["indent"]) // 4, m["body"]
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parent_host = stack[-1][1] if stack else False
        if body.startswith("["):  # "[build-dependencies]" or "[dev-dependencies]"
            stack.append((depth, parent_host or body == "[build-dependencies]"))
            continue
        n = NODE.match(body)
        if not n:
            continue
        host = parent_host or "(proc-macro)" in n["kind"]
        stack.append((depth, host))
        if "(/" in n["kind"] and "/patches/" not in n["kind"]:
            continue  # a workspace crate
        feats = {f for f in n["feats"].split(",") if f}
        sides = found.setdefault((n["name"], n["ver"]), {})
        sides.setdefault("host" if host else "target", set()).update(feats)
    return found


def candidates(one, two):
    """(side, dependency line) for each crate both builds compile on one side with different
    features: the union of the two."""
    shared = sorted(one.keys() & two.keys())
    versions = {}
    for name, ver in shared:
        versions.setdefault(name, set()).add(ver)
    found = []
    for key in shared:
        name, ver = key
        for side in ("target", "host"):
            a, b = one[key].get(side), two[key].get(side)
            if a is None or b is None or a == b:
                continue  # compiled on this side by one build only, or alike by both
            alias = name if len(versions[name]) == 1 else f"{name}-{ver.replace('.', '_')}"
            pkg = "" if alias == name else f'package = "{name}", '
            feats = ", ".join(f'"{f}"' for f in sorted(a | b))
            # A caret requirement, not `=`: `cargo update` may still move the crate (and
            # --check then asks for a rerun), where an exact pin would hold it back unseen.
            found.append((side, f'{alias} = {{ {pkg}version = "{ver}", '
                                f"default-features = false, features = [{feats}] }}"))
    return found


def section(entries):
    text = [BEGIN]
    for head, side in (("[dependencies]", "target"), ("[build-dependencies]", "host")):
        text += ["", head, *(line for s, line in entries if s == side)]
    return "\n".join(text + ["", END])


def main():
    old = HACK.read_text()
    start, stop = old.index(BEGIN), old.index(END) + len(END)

    def generated(entries):
        return old[:start] + section(entries) + old[stop:]

    def write(entries):
        HACK.write_text(generated(entries))

    try:
        # The builds as they are without the list: what this file adds must not feed back.
        write([])
        first, second = (tree(args) for args in BUILDS)
        # Keep an entry only if the first build compiles at most a few more (small) crates
        # with it (cc's `parallel` adds jobserver): a union that turns on the GPU backends
        # (burn's `cuda`: CubeCL and LLVM) or CubeCL's `persistence` (a database) would grow
        # the README's build for the second's sake.
        keep = []
        for entry in candidates(first, second):
            write([entry])
            if len(tree(BUILDS[0]).keys() - first.keys()) <= MAX_NEW:
                keep.append(entry)
        write(keep)
        grown = sorted(tree(BUILDS[0]).keys() - first.keys())
    finally:
        HACK.write_text(old)
    if len(grown) > MAX_NEW * len(keep):
        sys.exit(f"{HACK}: the entries together grow the first build by {grown}")
    text = generated(keep)
    if "--check" in sys.argv:
        if text != old:
            print(f"{HACK} is out of date: run scripts/unify-features.py", file=sys.stderr)
            sys.exit(1)
        return
    HACK.write_text(text)
    print(f"wrote {HACK}: {len(keep)} crates unified")


if __name__ == "__main__":
    main()
