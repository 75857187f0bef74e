"""The models kiln's GPU benchmark runs and the GPUs' peaks MFU is measured against, shared by
bench.py (which needs no PyTorch, so its plumbing can be tried without a GPU: --device flex)
and torch_llama.py (the PyTorch peer)."""

# (vocab, d_model, layers, heads, kv heads, ffn hidden, default batch, default seq)
MODELS = {
    # kiln's reference model (bench/train): 15.7M parameters.
    "ref": (8192, 384, 6, 6, 2, 1024, 8, 256),
    # A 1B-class Llama (issue 18): 1.1B parameters.
    "1b": (32000, 2048, 16, 16, 4, 5632, 4, 2048),
    # The same model at sequence length 8192, one sequence a step (issue 19: activation memory
    # must let 8192 fit where PyTorch with SDPA fits).
    "1b-8k": (32000, 2048, 16, 16, 4, 5632, 1, 8192),
    # The 1B-class model one sequence a rank a step: the data-parallel rows, several ranks on
    # one GPU (issue 42), where 4 replicated ranks of batch 4 would not fit its memory.
    "1b-dp": (32000, 2048, 16, 16, 4, 5632, 1, 2048),
    # A 7B-class Llama (issue 42): d 4096, 32 layers, 32/8 heads, SwiGLU 11008, 6.7B
    # parameters; fully sharded over 4 ranks with activation checkpointing.
    "7b": (32000, 4096, 32, 32, 8, 11008, 1, 2048),
}

# Dense bf16 tensor-core peak (FLOP/s) by device name; MFU is measured against it.
PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "GH200": 989e12, "B200": 2250e12}


def peak_flops(name):
    for key, flops in PEAKS.items():
        if key in name:
            return flops
    return float("nan")
