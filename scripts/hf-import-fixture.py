#!/usr/bin/env python3
"""Writes the Hugging Face fixtures that `model.init_from` is tested on, with transformers
itself: small random `LlamaForCausalLM`s saved by `save_pretrained`, and the logits
transformers computes for a fixed prompt, which kiln's forward pass must match
(crates/kiln-train/tests/suite/hf_import.rs).

  untied/  GQA (4 query heads, 2 KV heads), untied output head, f32, sharded into several
           model-0000N-of-0000M.safetensors files with model.safetensors.index.json
  tied/    GQA, tied embeddings, bf16 weights in one model.safetensors (the logits are
           transformers' f32 forward pass on those bf16 values)

Usage: $(scripts/peer-venv.sh) scripts/hf-import-fixture.py [OUT_DIR]
(default OUT_DIR: crates/kiln-train/tests/fixtures/hf-llama). The fixtures are committed;
rerunning rewrites them from the same seeds.
"""

import json
import os
import sys

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, decoders

PROMPT = [1, 5, 9, 2, 17, 30, 0, 12, 3, 25, 8, 4, 31, 16]
VOCAB = 32


def tokenizer_json(path):
    # One token per character of a 31-letter alphabet plus <|endoftext|> (id 31).
    alphabet = "abcdefghijklmnopqrstuvwxyz .,=\n"
    vocab = {c: i for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(path)


def build(tied, seed):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        initializer_range=0.2,
        eos_token_id=31,
        bos_token_id=None,
        pad_token_id=None,
    )
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms: not all ones, so a mixed-up norm shows
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def logits_of(model):
    with torch.no_grad():
        out = model(torch.tensor([PROMPT])).logits[0]
    return out


def write(out, name, tied, dtype, shard):
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(d):
        os.remove(os.path.join(d, f))
    model = build(tied, seed=7 if tied else 3)
    if dtype == torch.bfloat16:
        model = model.to(torch.bfloat16)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(d, safe_serialization=True, **kwargs)
    tokenizer_json(os.path.join(d, "tokenizer.json"))
    # The reference: transformers' f32 forward pass on exactly the saved values, in a fresh
    # f32 model (casting the bf16 model back would leave its RoPE inv_freq buffer rounded to
    # bf16, which no checkpoint holds).
    reference = build(tied, seed=0)
    reference.load_state_dict({k: v.to(torch.float32) for k, v in model.state_dict().items()})
    logits = logits_of(reference)
    record = {
        "ids": PROMPT,
        "shape": list(logits.shape),
        "logits": [float(x) for x in logits.flatten()],
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": str(dtype),
        "tied": tied,
    }
    with open(os.path.join(out, f"{name}.logits.json"), "w") as f:
        json.dump(record, f)
        f.write("\n")
    print(name, sorted(os.listdir(d)), "logits", list(logits.shape),
          "max |logit| %.3f" % logits.abs().max().item())


def main():
    root = os.path.join(os.path.dirname(__file__), "..")
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        root, "crates/kiln-train/tests/fixtures/hf-llama")
    os.makedirs(out, exist_ok=True)
    write(out, "untied", tied=False, dtype=torch.float32, shard="30KB")
    write(out, "tied", tied=True, dtype=torch.bfloat16, shard=None)


if __name__ == "__main__":
    main()
