#!/usr/bin/env python3
"""Loads a `kiln export --to hf` directory with transformers and compares its logits with
kiln's on the same tokens.

Usage: hf-parity.py EXPORT_DIR KILN_LOGITS.json
KILN_LOGITS.json holds {"text", "ids", "shape": [1, T, V], "logits": [...]} (written by
crates/kiln/tests/export.rs from kiln's own forward pass). Prints one JSON line:
max_abs_diff of the logits, whether the shipped tokenizer maps the text to the same ids,
and the argmax agreement.
"""
import json, sys
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

out, ref_path = sys.argv[1], sys.argv[2]
ref = json.load(open(ref_path))
model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
model.eval()
assert type(model).__name__ == "LlamaForCausalLM", type(model).__name__
tok = AutoTokenizer.from_pretrained(out)
ids = tok(ref["text"], add_special_tokens=False)["input_ids"]
with torch.no_grad():
    logits = model(torch.tensor([ref["ids"]])).logits
kiln = torch.tensor(ref["logits"], dtype=torch.float32).view(*ref["shape"])
diff = (logits - kiln).abs()
print(json.dumps({
    "transformers": transformers.__version__,
    "torch": torch.__version__,
    "model_class": type(model).__name__,
    "tokens": len(ref["ids"]),
    "max_abs_diff": float(diff.max()),
    "mean_abs_diff": float(diff.mean()),
    "logit_scale": float(kiln.abs().max()),
    "argmax_agree": bool((logits.argmax(-1) == kiln.argmax(-1)).all()),
    "tokenizer_ids_match": ids == ref["ids"],
}))
