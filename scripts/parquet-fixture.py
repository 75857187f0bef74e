#!/usr/bin/env python3
"""Writes the parquet fixtures `kiln data tokenize` is tested on, with pyarrow itself
(crates/kiln/tests/suite/data_parquet.rs): the same documents as parquet and as JSONL, so the
test can require byte-identical token shards from both.

  docs.parquet       column "text" (string) and "id", snappy, row groups of 7 rows, with null
                     values (skipped), empty strings, unicode and a long document
  docs-zstd.parquet  the documents in column "content" (large_string), zstd, one row group
  docs.jsonl         the non-null documents, one {"text": ...} per line

Usage: $(scripts/peer-venv.sh) scripts/parquet-fixture.py [OUT_DIR]
(default OUT_DIR: crates/kiln/tests/fixtures/parquet). The fixtures are committed.
"""

import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq

WORDS = ["ant", "bée", "cat", "dog", "eel", "fox", "gnu", "hen", "owl", "yak", "日本", "\n"]


def docs():
    out = []
    for i in range(60):
        if i % 9 == 4:
            out.append(None)
            continue
        if i % 17 == 5:
            out.append("")
            continue
        n = 3 + (i * 7) % 40 + (400 if i == 30 else 0)
        out.append(" ".join(WORDS[(i * 31 + k * k) % len(WORDS)] for k in range(n)))
    return out


def main():
    root = os.path.join(os.path.dirname(__file__), "..")
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "crates/kiln/tests/fixtures/parquet")
    os.makedirs(out, exist_ok=True)
    texts = docs()
    table = pa.table({"id": pa.array(range(len(texts)), pa.int64()), "text": pa.array(texts, pa.string())})
    pq.write_table(table, os.path.join(out, "docs.parquet"), row_group_size=7, compression="snappy")
    big = pa.table({"content": pa.array(texts, pa.large_string())})
    pq.write_table(big, os.path.join(out, "docs-zstd.parquet"), compression="zstd")
    with open(os.path.join(out, "docs.jsonl"), "w", encoding="utf-8") as f:
        for t in texts:
            if t is not None:
                f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    print("pyarrow", pa.__version__, "wrote", sorted(os.listdir(out)),
          "rows", len(texts), "nulls", sum(t is None for t in texts))


if __name__ == "__main__":
    main()
