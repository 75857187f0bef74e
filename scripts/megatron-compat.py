"""kiln <-> megatron-core compatibility checks (run by scripts/megatron-compat.sh)."""
import json
import os
import subprocess
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
import numpy as np
import torch
from megatron.core.datasets import helpers_cpp
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
from megatron.core.datasets.utils import normalize

KILN = sys.argv[1]
failures = []


def kiln(*args):
    r = subprocess.run([KILN, "data", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"kiln data {' '.join(args)} failed: {r.stderr}")
    return r.stdout


def check(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail and not ok else ''}")
    if not ok:
        failures.append(name)


def write_megatron(prefix, docs, dtype):
    """docs: list of documents, each a list of sequences (lists of ids)."""
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        for seq in doc:
            b.add_item(torch.tensor(seq, dtype=torch.int64))
        b.end_document()
    b.finalize(prefix + ".idx")


def random_docs(rng, n, vocab, multi=False):
    docs = []
    for _ in range(n):
        parts = int(rng.integers(1, 4)) if multi else 1
        docs.append([rng.integers(0, vocab, int(rng.integers(0, 300))).tolist() for _ in range(parts)])
    return docs


with tempfile.TemporaryDirectory() as tmp:
    rng = np.random.default_rng(0)
    # 1. megatron-core writes, kiln reads.
    for dtype, vocab in [(np.uint16, 65_000), (np.int32, 200_000)]:
        for multi in (False, True):
            prefix = os.path.join(tmp, f"mg_{dtype.__name__}_{multi}")
            docs = random_docs(rng, 60, vocab, multi)
            write_megatron(prefix, docs, dtype)
            info = json.loads(kiln("inspect", prefix, "--json", "--check"))
            got = [json.loads(l) for l in kiln("inspect", prefix, "--dump-doc", f"0..{len(docs)}").splitlines()]
            want = [[t for seq in doc for t in seq] for doc in docs]
            check(f"megatron-core {dtype.__name__} {'multi-sequence ' if multi else ''}dataset reads identically in kiln",
                  got == want and info["dtype"] == dtype.__name__ and info["documents"] == len(docs)
                  and info["sequences"] == sum(len(d) for d in docs), str(info))

    # 2. kiln writes (tokenize), megatron-core reads, and megatron-core's builder rewrites
    #    the same tokens into byte-identical files.
    text = os.path.join(tmp, "corpus.jsonl")
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    with open(text, "w") as f:
        for _ in range(500):
            f.write(json.dumps({"text": " ".join(rng.choice(words, int(rng.integers(1, 120))))}) + "\n")
    tok = os.path.join(tmp, "tokenizer.json")
    kiln("train-tokenizer", "-i", text, "--vocab-size", "300", "-o", tok)
    kprefix = os.path.join(tmp, "kiln_out")
    kiln("tokenize", "-t", tok, "-i", text, "-o", kprefix)
    ds = IndexedDataset(kprefix)
    kdocs = [json.loads(l) for l in kiln("inspect", kprefix, "--dump-doc", f"0..{len(ds)}").splitlines()]
    mdocs = [ds[i].tolist() for i in range(len(ds))]
    check("kiln-tokenized dataset reads identically in megatron-core",
          mdocs == kdocs and len(ds) == 500 and ds.index.dtype == np.uint16)
    rewritten = os.path.join(tmp, "rewritten")
    write_megatron(rewritten, [[d] for d in mdocs], DType.optimal_dtype(300))
    same = all(open(kprefix + ext, "rb").read() == open(rewritten + ext, "rb").read() for ext in (".bin", ".idx"))
    check("kiln's .bin/.idx are byte-identical to megatron-core's for the same tokens", same)

    # 3. Blend order equals build_blending_indices.
    for k in range(1, 6):
        write_megatron(os.path.join(tmp, f"blend{k}"), random_docs(rng, 20, 1000), np.uint16)
    cases = [[1.0], [0.5, 0.5], [0.2, 0.3, 0.5], [1, 2, 3, 4, 5], [0.001, 0.999],
             [1 / 3, 1 / 3, 1 / 3], [7.5, 0.25, 3.0, 1e-3, 2.0]]
    cases += [list(rng.random(int(rng.integers(2, 6))) + 1e-3) for _ in range(8)]
    for weights in cases:
        for size in (1, 17, 1000, 123_457):
            lst = os.path.join(tmp, "list.txt")
            with open(lst, "w") as f:
                for i, w in enumerate(weights):
                    f.write(f"{float(w)!r} blend{i + 1}\n")
            got = json.loads(kiln("blend", lst, "--samples", str(size), "--seq-len", "16", "--verify", "off",
                                  "--cache-dir", os.path.join(tmp, "cache"), "--dump-order", str(size)))
            w = normalize(weights)
            di = np.zeros(size, dtype=np.int16)
            dsi = np.zeros(size, dtype=np.int64)
            helpers_cpp.build_blending_indices(di, dsi, np.array(w, dtype=np.float64), len(w), size, False)
            ok = got["dataset_index"] == di.tolist() and got["dataset_sample_index"] == dsi.tolist()
            check(f"blend order == build_blending_indices (weights {len(weights)}, size {size})", ok)

print(f"{'FAILED' if failures else 'OK'}: {len(failures)} failed")
sys.exit(1 if failures else 0)
