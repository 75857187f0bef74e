"""The guard's synthetic corpus set: Megatron .idx files with sparse .bin files (the index
build never reads tokens), written from an integer-only generator so that every machine and
Python version writes the same bytes (the instruction counts depend on them)."""

import struct
from array import array
from pathlib import Path

# name, documents, median length: the bench's 24-corpus mix (bench/data/bench.py) at about
# 1/200 of its documents.
CORPORA = [
    ("web-cc-2019", 54600, 450), ("web-cc-2020", 54600, 450), ("web-cc-2021", 53400, 460),
    ("web-cc-2022", 52300, 470), ("web-cc-2023", 51200, 480), ("web-cc-2024", 49100, 500),
    ("web-refined", 34700, 700), ("news", 18200, 600), ("forums", 21500, 300),
    ("wikipedia-en", 4400, 550), ("wikipedia-multi", 12200, 400), ("books-public", 121, 90000),
    ("books-fiction", 112, 70000), ("arxiv", 1300, 9000), ("pubmed", 2100, 4000),
    ("patents", 1200, 6000), ("legal", 1600, 3000), ("code-python", 9500, 900),
    ("code-cpp", 5900, 1100), ("code-js", 8000, 700), ("code-rust", 2100, 1000),
    ("stackexchange", 18200, 500), ("math-web", 7600, 800), ("dialogue", 26000, 350),
]
# Blend weights (share x epochs in the bench), as integers per mille.
WEIGHTS = [72, 72, 81, 81, 90, 90, 120, 30, 30, 30, 40, 60, 30, 60, 40, 20, 20, 80, 30, 30, 20,
           60, 60, 30]
MASK = (1 << 64) - 1


def splitmix(state):
    state = (state + 0x9E3779B97F4A7C15) & MASK
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return state, z ^ (z >> 31)


def lengths(n, median, seed):
    """Heavy-tailed lengths around `median`: a sum of two uniforms, one draw in eight scaled up."""
    out = array("i")
    s = seed
    for _ in range(n):
        s, r = splitmix(s)
        a, b, c = r & 0xFFFF, (r >> 16) & 0xFFFF, (r >> 32) & 0xFF
        length = 1 + (a * median >> 16) + (b * median >> 17)
        if c < 32:
            length *= 1 + (c & 7)
        out.append(min(length, 2**31 - 1))
    return out


def write(root: Path):
    """Writes the corpora and `list.txt` under `root`; returns (list path, documents, tokens)."""
    root.mkdir(parents=True, exist_ok=True)
    docs = tokens = 0
    lines = []
    for i, ((name, n, median), w) in enumerate(zip(CORPORA, WEIGHTS)):
        lens = lengths(n, median, 1234 + i)
        ptrs = array("q", bytes(8 * n))
        acc = 0
        for k, l in enumerate(lens):
            ptrs[k] = acc
            acc += 2 * l
        with open(root / f"{name}.idx", "wb") as f:
            f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, n, n + 1))
            for a in (lens, ptrs, array("q", range(n + 1))):
                if a.itemsize != (4 if a.typecode == "i" else 8):
                    raise SystemExit("unexpected C type sizes")
                a.tofile(f)
        with open(root / f"{name}.bin", "wb") as f:
            f.truncate(acc)
        docs += n
        tokens += acc // 2
        lines.append(f"{w / 1000:.3f} {name} {name.split('-')[0]}\n")
    (root / "list.txt").write_text("".join(lines))
    return root / "list.txt", docs, tokens


if __name__ == "__main__":
    import sys

    print(write(Path(sys.argv[1])))
