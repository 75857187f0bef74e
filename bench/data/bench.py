"""Data-layer benchmark: kiln vs megatron-core, side by side in one run (not a test).

Two measurements:

1. **Index build.** A synthetic corpus description of 24 corpora and 100B tokens (document
   lengths drawn from per-corpus log-normal distributions: web pages, code, papers, books...)
   is written as Megatron `.idx` files with sparse `.bin` files (only the index metadata is
   real; neither side reads token bytes while building indices). Both sides then build, from
   an empty cache, everything needed to serve `tokens / seq_len` blended samples:
   megatron-core's `BlendedMegatronDatasetBuilder` (GPTDataset document/sample/shuffle
   indices per corpus + `build_blending_indices`), and `kiln data blend` (per-corpus prefix
   tables + the same greedy blend). Per-corpus sample counts of the two blends are compared.
2. **Tokenization.** The same JSONL input through `kiln data tokenize` and through a
   re-creation of Megatron-LM's `tools/preprocess_data.py` pipeline (Megatron-LM's tools are
   not on PyPI): `multiprocessing.Pool(workers).imap(encode, lines, 32)` where encode is
   `json.loads` + the same `tokenizer.json` through the `tokenizers` library + EOD, written by
   megatron-core's `IndexedDatasetBuilder`. Both outputs must be byte-identical.

Usage: bench/data/bench.sh [--tokens 100e9] [--text-mb 64] [--workers N] [--keep-corpora]
                          [--compare NAME=KILN ...]
"""

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# name, share of all tokens, median document length (tokens), log-normal sigma, epochs drawn
# (the blend weight is share * epochs: small high-quality corpora are upsampled, big web
# crawls downsampled, as in published pre-training mixes).
CORPORA = [
    ("web-cc-2019", 0.090, 450, 1.1, 0.8),
    ("web-cc-2020", 0.090, 450, 1.1, 0.8),
    ("web-cc-2021", 0.090, 460, 1.1, 0.9),
    ("web-cc-2022", 0.090, 470, 1.1, 0.9),
    ("web-cc-2023", 0.090, 480, 1.1, 1.0),
    ("web-cc-2024", 0.090, 500, 1.1, 1.0),
    ("web-refined", 0.080, 700, 1.0, 1.5),
    ("news", 0.030, 600, 0.8, 1.0),
    ("forums", 0.030, 300, 1.3, 1.0),
    ("wikipedia-en", 0.010, 550, 1.2, 3.0),
    ("wikipedia-multi", 0.020, 400, 1.2, 2.0),
    ("books-public", 0.030, 90_000, 0.8, 2.0),
    ("books-fiction", 0.020, 70_000, 0.7, 1.5),
    ("arxiv", 0.030, 9_000, 0.7, 2.0),
    ("pubmed", 0.020, 4_000, 0.6, 2.0),
    ("patents", 0.020, 6_000, 0.8, 1.0),
    ("legal", 0.020, 3_000, 1.2, 1.0),
    ("code-python", 0.040, 900, 1.3, 2.0),
    ("code-cpp", 0.030, 1_100, 1.3, 1.0),
    ("code-js", 0.030, 700, 1.4, 1.0),
    ("code-rust", 0.010, 1_000, 1.3, 2.0),
    ("stackexchange", 0.030, 500, 1.0, 2.0),
    ("math-web", 0.020, 800, 1.0, 3.0),
    ("dialogue", 0.030, 350, 1.0, 1.0),
]
SEQ_LEN = 2048
SEED = 1234


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def write_idx(prefix: Path, lengths: np.ndarray, dtype_code: int = 8, itemsize: int = 2):
    """A Megatron .idx (one sequence per document) and a sparse .bin of the right size."""
    n = len(lengths)
    pointers = np.zeros(n, dtype="<i8")
    np.cumsum(lengths[:-1].astype("<i8") * itemsize, out=pointers[1:])
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", dtype_code))
        f.write(struct.pack("<Q", n))
        f.write(struct.pack("<Q", n + 1))
        lengths.astype("<i4").tofile(f)
        pointers.tofile(f)
        np.arange(n + 1, dtype="<i8").tofile(f)
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(int(lengths.sum()) * itemsize)


def make_corpora(root: Path, total_tokens: float):
    """Writes the corpus description; returns (prefixes, weights, documents, tokens)."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    prefixes, weights, docs, tokens = [], [], 0, 0
    t0 = time.time()
    for i, (name, share, median, sigma, epochs) in enumerate(CORPORA):
        target = int(total_tokens * share)
        mean = median * np.exp(sigma * sigma / 2)
        n = max(1, int(target / mean))
        lengths = np.maximum(1, rng.lognormal(np.log(median), sigma, n)).astype(np.int64)
        lengths = np.minimum(lengths, 2**31 - 1)
        prefix = root / name
        write_idx(prefix, lengths)
        prefixes.append(str(prefix))
        weights.append(share * epochs)
        docs += n
        tokens += int(lengths.sum())
        log(f"  [{i + 1}/{len(CORPORA)}] {name}: {n:,} documents, {int(lengths.sum()):,} tokens "
            f"({time.time() - t0:.0f}s)")
    with open(root / "list.txt", "w") as f:
        f.write(f"# {len(CORPORA)} synthetic corpora, {tokens:,} tokens, {docs:,} documents\n")
        for (name, *_), w in zip(CORPORA, weights):
            f.write(f"{w:.6f} {name} {name.split('-')[0]}\n")
    return prefixes, weights, docs, tokens


def peakrss_launcher():
    """bench/peakrss.c compiled (once), or None without a C compiler."""
    global PEAKRSS
    if PEAKRSS is None:
        import tempfile

        cc = shutil.which("cc") or shutil.which("gcc")
        src = Path(__file__).resolve().parent.parent / "peakrss.c"
        PEAKRSS = ""
        if cc and src.exists():
            out = Path(tempfile.mkdtemp(prefix="kiln-bench-")) / "peakrss"
            if subprocess.run([cc, "-O2", "-o", str(out), str(src)]).returncode == 0:
                PEAKRSS = str(out)
            else:
                log("  (no peakrss launcher: peak RSS below this process's size reads as its size)")
    return PEAKRSS or None


PEAKRSS = None
# CPU seconds (user + system) of the last run_measured command: beside the wall time, a figure
# that a busy machine inflates far less.
LAST_CPU_S = 0.0


def run_measured(cmd):
    """Runs cmd; returns (wall seconds, peak RSS in MiB, stdout); its CPU seconds in LAST_CPU_S.
    The peak comes from bench/peakrss.c: a child spawned from this process would carry this
    process's size (numpy's corpora, hundreds of MiB) in its peak."""
    import tempfile

    global LAST_CPU_S
    launcher = peakrss_launcher()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.time()
        p = subprocess.Popen(([launcher] if launcher else []) + [str(c) for c in cmd],
                             stdout=out, stderr=err)
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.time() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        text = err.read().decode(errors="replace")
        m = re.search(r"^peak_rss_kib=(\d+) cpu_s=([\d.]+)$", text, re.M) if launcher else None
        sys.stderr.write(re.sub(r"^peak_rss_kib=.*\n?", "", text, flags=re.M))
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(map(str, cmd))} failed with {p.returncode}")
        LAST_CPU_S = usage.ru_utime + usage.ru_stime
        rss_kib = int(m.group(1)) if m else usage.ru_maxrss
        out.seek(0)
        return wall, rss_kib / 1024, out.read().decode()


# ---- megatron-core side (runs in a child process so that its time and memory are its own) ----


def megatron_build(prefixes, weights, samples, cache, threads):
    import logging

    logging.disable(logging.WARNING)
    import warnings

    warnings.filterwarnings("ignore")
    t_import = time.time()
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    class Tok:  # GPTDataset only reads these attributes
        vocab_size = 32_000
        eod = 0
        pad = 1
        bos = None
        unique_identifiers = {"class": "BenchTokenizer", "vocab_size": 32_000}

    import tempfile

    import torch.distributed as dist

    # A one-rank process group, as in a real Megatron job (the builder asks for the rank).
    with tempfile.NamedTemporaryFile() as rendezvous:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous.name}", rank=0,
                                world_size=1)
    import_s = time.time() - t_import
    t0 = time.time()
    config = GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=SEQ_LEN,
        blend=(prefixes, weights),
        split="100,0,0",
        path_to_cache=cache,
        tokenizer=Tok(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        num_dataset_builder_threads=threads,
        mmap_bin_files=True,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [samples, 0, 0], lambda: True, config
    ).build()
    build_s = time.time() - t0
    totals = np.bincount(np.asarray(train.dataset_index), minlength=len(prefixes))
    print(json.dumps({"import_s": import_s, "build_s": build_s, "samples": len(train),
                      "totals": totals.tolist()}))


# ---- tokenization: a re-creation of Megatron-LM tools/preprocess_data.py's pipeline ----


class Encoder:
    tokenizer_file = None
    key = "text"

    @classmethod
    def init(cls):
        from tokenizers import Tokenizer

        cls.tok = Tokenizer.from_file(cls.tokenizer_file)
        cls.eod = cls.tok.token_to_id("<|endoftext|>")

    @classmethod
    def encode(cls, line):
        text = json.loads(line)[cls.key]
        ids = cls.tok.encode(text, add_special_tokens=False).ids
        lens = [len(ids)] if ids else []
        if ids:
            ids.append(cls.eod)
            lens[-1] += 1
        return ids, lens, len(line)


def megatron_preprocess(tokenizer, inp, prefix, workers):
    import multiprocessing

    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tokenizers import Tokenizer

    Encoder.tokenizer_file = tokenizer
    vocab = Tokenizer.from_file(tokenizer).get_vocab_size(True)
    t0 = time.time()
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab))
    tokens = docs = 0
    with open(inp, encoding="utf-8") as fin, multiprocessing.Pool(workers, Encoder.init) as pool:
        for ids, lens, _ in pool.imap(Encoder.encode, fin, 32):
            builder.add_document(ids, lens)
            tokens += len(ids)
            docs += 1
    builder.finalize(prefix + ".idx")
    secs = time.time() - t0
    print(json.dumps({"seconds": secs, "tokens": tokens, "documents": docs}))


# ---- text corpus for the tokenization benchmark ----


def make_text(out: Path, megabytes: float):
    """JSONL documents from the Markdown and Rust files of the local cargo registry: real
    English prose and real code, in a fixed order."""
    src = Path.home() / ".cargo" / "registry" / "src"
    files = sorted(p for p in src.rglob("*") if p.suffix in (".md", ".rs") and p.is_file())
    if not files:
        raise SystemExit(f"no .md/.rs files under {src} for the text corpus")
    budget = int(megabytes * 1e6)
    written = 0
    with open(out, "w", encoding="utf-8") as f:
        while written < budget:
            for p in files:
                try:
                    text = p.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                if not text.strip():
                    continue
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                written += len(line.encode())
                if written >= budget:
                    break
    return written


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--tokens", type=float, default=100e9)
    ap.add_argument("--text-mb", type=float, default=64)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="target/bench-data")
    ap.add_argument("--skip-index", action="store_true")
    ap.add_argument("--keep-corpora", action="store_true", help="keep the generated .idx files")
    ap.add_argument("--skip-tokenize", action="store_true")
    ap.add_argument("--compare", action="append", default=[], metavar="NAME=KILN",
                    help="also build and reopen the index with another kiln binary (an older "
                         "commit's, say), in the same run on the same corpora (repeatable)")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report = {"machine": {"cpus": os.cpu_count(), "workers": args.workers}}

    if not args.skip_index:
        log(f"== index build: {len(CORPORA)} corpora, {args.tokens:.3g} tokens, seq_len {SEQ_LEN}")
        corpora = out / "corpora"
        if not args.keep_corpora:
            shutil.rmtree(corpora, ignore_errors=True)
        prefixes, weights, docs, tokens = make_corpora(corpora, args.tokens)
        samples = tokens // SEQ_LEN
        log(f"  {docs:,} documents, {tokens:,} tokens; building indices for {samples:,} samples")
        for name in ("cache-megatron", "cache-kiln"):
            shutil.rmtree(out / name, ignore_errors=True)
        log("  megatron-core BlendedMegatronDatasetBuilder ...")
        m_wall, m_rss, m_out = run_measured([sys.executable, __file__, "_megatron", json.dumps(
            [prefixes, weights, samples, str(out / "cache-megatron"), args.workers])])
        m = json.loads(m_out.strip().splitlines()[-1])
        m_cpu = LAST_CPU_S
        log(f"    {m['build_s']:.1f}s build (+{m['import_s']:.1f}s import; {m_cpu:.1f}s CPU in all), "
            f"peak RSS {m_rss:.0f} MiB")
        # megatron-core's blend holds sum(ceil(weight * samples)) samples (each corpus rounds up):
        # kiln builds the same number, so the blends are the same size and comparable.
        samples = m["samples"]
        log(f"  kiln data blend ({samples:,} samples, as megatron-core's blend) ...")

        def kiln_blend(binary, cache, threads):
            cmd = [binary, "data", "blend", str(corpora / "list.txt"), "--seq-len", str(SEQ_LEN),
                   "--samples", str(samples), "--seed", str(SEED), "--verify", "off",
                   "--cache-dir", str(cache), "--json"]
            return cmd + (["--threads", str(threads)] if threads else [])

        def kiln_side(binary, cache):
            """Cold build, then three reopens (what every later job start and rank pays)."""
            shutil.rmtree(cache, ignore_errors=True)
            wall, rss, out = run_measured(kiln_blend(binary, cache, args.workers))
            cpu = LAST_CPU_S
            reopens = []
            for _ in range(3):
                w, r, _ = run_measured(kiln_blend(binary, cache, None))
                reopens.append((w, r, LAST_CPU_S))
            return wall, rss, dict(json.loads(out), cpu_s=cpu), reopens

        k_wall, k_rss, k, k_reopens = kiln_side(args.kiln, out / "cache-kiln")
        k_warm = min(w for w, _, _ in k_reopens)
        log(f"    {k_wall:.2f}s wall ({k['seconds']:.2f}s inside, {k['cpu_s']:.2f}s CPU), peak RSS "
            f"{k_rss:.0f} MiB; reopen {', '.join(f'{w:.2f}' for w, _, _ in k_reopens)} s")
        compared = {}
        for name, binary in (c.split("=", 1) for c in args.compare):
            log(f"  {name}: {binary} ...")
            c_wall, c_rss, c, c_reopens = kiln_side(binary, out / f"cache-{name}")
            compared[name] = {
                "binary": binary, "wall_s": c_wall, "seconds_inside": c["seconds"],
                "cpu_s": c["cpu_s"], "peak_rss_mib": c_rss,
                "reopen_s": [w for w, _, _ in c_reopens],
                "reopen_cpu_s": [u for _, _, u in c_reopens],
                "reopen_peak_rss_mib": max(r for _, r, _ in c_reopens),
                "per_corpus_samples": [d["samples"] for d in c["datasets"]],
            }
            log(f"    {c_wall:.2f}s wall ({c['cpu_s']:.2f}s CPU), peak RSS {c_rss:.0f} MiB; reopen "
                f"{', '.join(f'{w:.2f}' for w, _, _ in c_reopens)} s")
        _, _, m_warm_out = run_measured([sys.executable, __file__, "_megatron", json.dumps(
            [prefixes, weights, samples, str(out / "cache-megatron"), args.workers])])
        m_warm = json.loads(m_warm_out.strip().splitlines()[-1])
        k_totals = [d["samples"] for d in k["datasets"]]
        same_totals = k_totals == m["totals"] and all(
            c["per_corpus_samples"] == m["totals"] for c in compared.values())
        du = lambda p: sum(f.stat().st_size for f in Path(p).rglob("*") if f.is_file())
        report["index"] = {
            "corpora": len(CORPORA), "documents": docs, "tokens": tokens, "seq_len": SEQ_LEN,
            "samples": samples,
            "megatron_build_s": m["build_s"], "megatron_wall_s": m_wall,
            "megatron_cpu_s_with_import": m_cpu,
            "megatron_peak_rss_mib": m_rss, "kiln_peak_rss_mib": k_rss,
            "megatron_cached_load_s": m_warm["build_s"],
            "megatron_cache_bytes": du(out / "cache-megatron"),
            "kiln_wall_s": k_wall, "kiln_cached_load_s": k_warm,
            "kiln_cpu_s": k["cpu_s"],
            "kiln_reopen_s": [w for w, _, _ in k_reopens],
            "kiln_reopen_cpu_s": [u for _, _, u in k_reopens],
            "kiln_reopen_peak_rss_mib": max(r for _, r, _ in k_reopens),
            "kiln_cache_bytes": du(out / "cache-kiln"),
            "compared": compared,
            "speedup": m["build_s"] / k_wall,
            "per_corpus_samples_equal": same_totals,
            "projection_2T": {"megatron_s": m["build_s"] * 2e12 / tokens,
                              "kiln_s": k_wall * 2e12 / tokens},
        }
        if not same_totals:
            log(f"  WARNING: per-corpus sample counts differ:\n    kiln     {k_totals}\n    megatron {m['totals']}")
        if not args.keep_corpora:
            shutil.rmtree(corpora, ignore_errors=True)

    if not args.skip_tokenize:
        log(f"== tokenization: {args.text_mb:g} MB of JSONL, {args.workers} workers")
        text = out / "text.jsonl"
        nbytes = make_text(text, args.text_mb)
        tok = out / "tokenizer.json"
        sample = out / "tokenizer-sample.jsonl"
        with open(text, encoding="utf-8") as f, open(sample, "w", encoding="utf-8") as g:
            for _, line in zip(range(2000), f):
                g.write(line)
        subprocess.run([args.kiln, "data", "train-tokenizer", "--input", str(sample),
                        "--vocab-size", "32000", "--output", str(tok)], check=True)
        k_wall, _, k_out = run_measured([args.kiln, "data", "tokenize", "--tokenizer", str(tok),
                                      "--input", str(text), "--output-prefix",
                                      str(out / "tok-kiln"), "--workers", str(args.workers),
                                      "--json"])
        k = json.loads(k_out)
        _, _, m_out = run_measured([sys.executable, __file__, "_preprocess", json.dumps(
            [str(tok), str(text), str(out / "tok-megatron"), args.workers])])
        m = json.loads(m_out.strip().splitlines()[-1])
        identical = all(
            (out / f"tok-kiln{ext}").read_bytes() == (out / f"tok-megatron{ext}").read_bytes()
            for ext in (".bin", ".idx"))
        report["tokenize"] = {
            "input_bytes": nbytes, "tokens": k["tokens"], "documents": k["documents"],
            "kiln_s": k_wall, "megatron_s": m["seconds"],
            "kiln_tokens_per_s": k["tokens"] / k_wall,
            "megatron_tokens_per_s": m["tokens"] / m["seconds"],
            "speedup": m["seconds"] / k_wall, "outputs_identical": identical,
        }
        if not identical:
            log("  WARNING: kiln and megatron outputs differ")

    print(json.dumps(report, indent=2))
    print_table(report)


def print_table(r):
    if "index" in r:
        i = r["index"]
        print(f"\nindex build, {i['corpora']} corpora, {i['tokens'] / 1e9:.1f}B tokens, "
              f"{i['documents'] / 1e6:.1f}M documents, {i['samples'] / 1e6:.1f}M samples:")
        print(f"  megatron-core  {i['megatron_build_s']:8.1f} s   peak RSS {i['megatron_peak_rss_mib']:6.0f} MiB   cache {i['megatron_cache_bytes'] / 2**20:8.0f} MiB"
              f"   reload {i['megatron_cached_load_s']:.1f} s")
        print(f"  kiln           {i['kiln_wall_s']:8.1f} s   peak RSS {i['kiln_peak_rss_mib']:6.0f} MiB   cache {i['kiln_cache_bytes'] / 2**20:8.0f} MiB"
              f"   reload {i['kiln_cached_load_s']:.2f} s")
        for name, c in i.get("compared", {}).items():
            print(f"  kiln {name:<9}{c['wall_s']:8.1f} s   peak RSS {c['peak_rss_mib']:6.0f} MiB"
                  f"   reload {min(c['reopen_s']):.2f} s")
        print(f"  speedup {i['speedup']:.1f}x; same per-corpus sample counts: {i['per_corpus_samples_equal']}")
        p = i["projection_2T"]
        print(f"  projected for 2T tokens: megatron-core {p['megatron_s'] / 60:.1f} min, kiln {p['kiln_s'] / 60:.1f} min")
    if "tokenize" in r:
        t = r["tokenize"]
        print(f"\ntokenization, {t['input_bytes'] / 1e6:.0f} MB, {t['tokens'] / 1e6:.1f}M tokens:")
        print(f"  preprocess_data.py pipeline  {t['megatron_tokens_per_s'] / 1e6:6.2f} M tokens/s")
        print(f"  kiln data tokenize           {t['kiln_tokens_per_s'] / 1e6:6.2f} M tokens/s")
        print(f"  speedup {t['speedup']:.1f}x; byte-identical outputs: {t['outputs_identical']}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_megatron":
        megatron_build(*json.loads(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_preprocess":
        megatron_preprocess(*json.loads(sys.argv[2]))
    else:
        main()
