#!/usr/bin/env python3
"""Every relative link in README.md, docs/*.md and bench/**/*.md resolves: the file exists and,
for `file.md#anchor`, the anchor is one of the file's headings (GitHub's slugs).
Usage: scripts/check-doc-links.py   (from anywhere; exit 1 naming each broken link)"""
import glob, os, re, sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
link = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slugs(path):
    out, fence = set(), False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            fence = not fence
        if fence or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


pages = ["README.md"] + sorted(glob.glob("docs/*.md", root_dir=root)) + sorted(
    glob.glob("bench/**/*.md", root_dir=root, recursive=True))
bad = []
for page in pages:
    text = open(os.path.join(root, page), encoding="utf-8").read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    for target in link.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(root, os.path.dirname(page), path)) if path else os.path.join(root, page)
        if not os.path.exists(full):
            bad.append(f"{page}: {target}: no such file")
        elif anchor and full.endswith(".md") and anchor not in slugs(full):
            bad.append(f"{page}: {target}: no such heading")
for b in bad:
    print(b)
sys.exit(1 if bad else 0)
