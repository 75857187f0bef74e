//! What a run asks of the machine, checked before anything is allocated: the memory of the
//! model, its optimizer and one step, estimated from the config alone and compared with the
//! memory this process may use ([`kiln_run::host::available_memory`]); and the worker
//! threads. A config that cannot fit is refused with the estimate, the limit and the key to
//! change, instead of an allocation abort (`memory allocation of N bytes failed`, exit 134)
//! after minutes of work.
//!
//! # The estimate
//!
//! All tensors are f32. With `P` parameters, `s` compute shards, `N = batch_size x seq_len`
//! tokens per micro-batch, `L` layers, width `d`, SwiGLU width `f`, key/value width `kv`,
//! `H` heads, sequence `T`, vocabulary `V`:
//!
//! | part | bytes | why |
//! | --- | --- | --- |
//! | weights + AdamW moments | `12 P` | always live |
//! | rollback snapshot | `12 P` | weights and moments, when `guards.snapshot_interval > 0` |
//! | frozen-parameter check | `4 P` | the previous weights, when `guards.frozen_check_interval > 0` |
//! | step: weights and gradients | `4 P (2 s + 1)` | per shard an autodiff copy and its gradients, plus their sum |
//! | step: activations | `4 N (L (24 d + 5 f + 6 kv + 3 H T) + 2 H T + 3.5 V + 2 d)` | saved for backward per token and layer (norms, projections, RoPE temporaries, SwiGLU, attention scores and softmax), one layer's score gradients, and the logits with their log-softmax and gradient |
//! | checkpoint | `32 P` | weights and moments copied to the host, serialised, the final weights |
//! | eval | `4 N (24 d + 5 f + 3 H T + 3 V)` | forward only, one layer live at a time |
//! | memory snapshots | `12 P (K + 2)` less what the store holds | a training rank's memory tier when it is on a memory file system (tmpfs, `/dev/shm`): `checkpoint.snapshot_keep` = K copies of weights and moments, one more while the next is written, one at the guards' rollback point (none with `guards.snapshot_interval = 0`); snapshots already there are out of the available memory already |
//!
//! Sharded (`parallelism.shard`, over `R` ranks: the job's, or with `parallelism.dp_replicate`
//! = D replicas the job's ranks / D of one replica): each rank keeps the whole weights but only
//! `1/R` of AdamW's moments, so the weights + moments part is `4 P + 8 P / R`, the rollback
//! snapshot likewise, and a checkpoint copies `4 P` of weights three times (host copy,
//! serialised, final) on rank 0 and `8 P / R` twice (its shard, serialised) on every rank.
//! Parameters sharded too (`parallelism.shard = "parameters"`): weights, moments, the
//! rollback snapshot and the frozen check's copy are all `1/R`; the step holds one stage's
//! whole weights (the largest of the embedding, a block, the head: `S` parameters) with their
//! autodiff copy and two copies of their gradients (`16 S`; `20 S` with
//! `parallelism.prefetch`, which holds the next stage's weights too), this rank's accumulated
//! gradients (`4 P / R`) and, as activations, every block's input (`4 N L d`) plus one
//! block's and the head's; a checkpoint copies `24 P / R` (its shards, serialised), and the
//! final weights, gathered to the writer rank, `8 P` (host copy, serialised).
//! Tensor parallelism (`parallelism.tp`): a rank holds `1/tp` of every part above that scales
//! with `P` (the matrices are cut; the norms, a negligible share, are counted cut too), and of
//! a layer's activations but the two block inputs it gathers whole (`2 d` a token); the
//! logits and eval are `1/tp`; the data-parallel ranks that shard the state are the job's
//! over `tp`. When a run does not fit, the least `tp` that would is named beside the
//! sharding advice.
//! With `training.activation_checkpointing = "blocks"` the activations are those of the
//! parameter-sharded step: every block's input plus one block's and the head's.
//! When a run does not fit, the error names the least sharding (`"gradients"`, then
//! `"parameters"`) that would make it fit on these ranks, or the fewest ranks one would, or
//! with hybrid sharding the most replicas (`parallelism.dp_replicate`) that would.
//!
//! The need is the always-live parts plus the largest of (step, checkpoint, eval), times
//! [`SAFETY`], plus the memory snapshots (files of a known size), plus [`OVERHEAD`] for the
//! program itself. On an accelerator (`training.device` a GPU) the weights, moments, step and
//! eval are in the device's memory, so the host's need is the checkpoint's host copies,
//! the snapshots and the overhead (counting the rest on the host would refuse a 1B-class run
//! on an H200 for 177 GiB of host memory it never uses), and the device's memory has an
//! estimate of its own ([`device_estimate_on`], below). When the snapshots are what does not
//! fit, the error names `checkpoint.snapshot_keep`, `checkpoint.snapshot_dir` and
//! `checkpoint.snapshot_interval`.
//!
//! # The device estimate (accelerators)
//!
//! Per rank, in the device's memory, with `b` bytes per saved activation (2 with
//! `training.dtype = "bf16"`, else 4) and `c` bytes per weight cast for the products (2 with
//! bf16, else 0). On GPUs attention saves each row's log-sum-exp, not its scores, and the
//! head's logits are never whole (kiln's chunked kernels), so the activations are
//! `b N L (24 d + 5 f + 6 kv)` (with activation checkpointing, or parameters sharded: every
//! block's input in f32, `4 N L d`, plus one block's) plus one attention chunk's scores
//! (at most 256 MiB, four of them live) and one head chunk's logits (16 Mi, three live):
//!
//! | mode | always live | during the backward pass | exchange and update (activations freed) |
//! | --- | --- | --- | --- |
//! | `none` | `12 P` (+ snapshot `12 P`, frozen check `4 P`) | gradients `4 P`, casts `c P`, activations | gradients packed into buckets: `4 P` more |
//! | `optimizer` | `4 P + 8 P / R` | the same | the packed gradients; then the gathered weights, `4 P` |
//! | `gradients` | `4 P + 8 P / R` | the same | the packed gradients and this rank's shard `4 P / R`; then the gathered weights |
//! | `parameters` | `12 P / R` | this rank's gradient shard `4 P / R`, a stage's weights gathered (two: the next one is gathered ahead), cast, their gradients and two packed reduce-scatters in flight: `(16 + c) S`, staged activations | — |
//!
//! plus [`DEVICE_CONTEXT`] (the CUDA context, cuBLAS's and NCCL's buffers), the sum times
//! [`SAFETY`]. Calibrated on the one measurement there is: the 1B-class model (0.85B, batch 4
//! x 2048, bf16 on f32 masters, replicated) on an H200 peaked at 34,966 MiB (nvidia-smi); the
//! table gives 36.1 GiB before the safety factor (6 % above). The limit is `training.device_memory_gb`,
//! else the device's total memory as CUDA reports it (other accelerators: unchecked), divided
//! among the ranks of a node that share one device. A run that does not fit is refused
//! naming the least sharding mode, or the fewest ranks, that would fit, as on the host.
//!
//! Calibrated against the peak resident memory (VmHWM) of 2-step runs with a checkpoint and
//! an eval, on the flex backend (2 cores, AVX-512). The need is above every measured peak,
//! at most about 2x above it (the 256 MiB overhead dominates tiny runs):
//!
//! | run (defaults unless named) | need | measured peak |
//! | --- | --- | --- |
//! | default (0.8M params, 16 x 64) | 425 MiB | 120 MiB |
//! | seq_len 1024, batch 4 | 1.8 GiB | 1074 MiB |
//! | d 64, 4 heads, 2 layers, seq_len 2048, batch 1 | 948 MiB | 477 MiB |
//! | vocab 65536, d 64, 1 layer | 1.8 GiB | 1061 MiB |
//! | d 1024, 8/8 heads, 2 layers, ffn 256, batch 8 | 1000 MiB | 620 MiB |
//! | ffn 16384 | 3.3 GiB | 2061 MiB |
//! | d 1024, 2 layers, ffn 4096 (34M params), batch 1 x 8 | 2.6 GiB | 1842 MiB |
//! | the same without snapshot and frozen check | 2.0 GiB | 1447 MiB |
//! | bench model (16M params), batch 4 / 8 / 12 x 256 | 1.8 / 2.6 / 3.3 GiB | 1227 / 1223 / 1840 MiB |

mod advice;
mod device;
mod host;
mod threads;
mod verdict;

pub use device::{DEVICE_CONTEXT, DeviceEstimate, check_device, device_estimate_on, device_limit};
pub use host::{
    Estimate, OVERHEAD, SAFETY, estimate, estimate_on, known_vocab, on_accelerator, param_count,
    snapshot_bytes,
};
pub use threads::start_threads;
pub use verdict::{check, check_run};

#[cfg(test)]
mod tests;
