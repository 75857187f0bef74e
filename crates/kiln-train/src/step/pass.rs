//! This rank's forward and backward pass over its micro-batches of a step, on its own device:
//! the part of a step that involves no other rank. [`LocalPass::accumulate`] sums the loss and
//! gradients of every micro-batch; each micro-batch may be split over compute threads
//! (`training.compute_shards`) and summed in a fixed order, so the result does not depend on
//! scheduling.

use crate::error::TrainError;
use crate::model::session::Session;
use crate::model::stagewise::{self, LocalStages};
use crate::tensor::{int_tensor, target_tensor};
use burn::tensor::{FloatDType, Tensor};
use rayon::prelude::*;

/// What the loss is computed against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Labels {
    /// The data's next tokens; `poison` makes the loss NaN (a debug fault).
    Data { poison: bool },
    /// Labels drawn from the model's own predictions with this seed: the gradient is
    /// SophiaG's Gauss-Newton-Bartlett sample.
    Sampled { seed: u64 },
}

/// One micro-batch: its rows of `seq + 1` tokens and what the loss is computed against.
pub struct MicroBatch {
    /// Token rows.
    pub rows: Vec<Vec<u32>>,
    /// The labels.
    pub labels: Labels,
}

/// The micro-batches of one step on this rank, read as the pass asks for them.
pub struct MicroBatches<'a> {
    /// How many there are.
    pub count: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Micro-batch `m`.
    pub read: &'a mut dyn FnMut(usize) -> Result<MicroBatch, TrainError>,
}

impl MicroBatches<'_> {
    /// The factor each micro-batch's mean loss is scaled by, so that they sum to the mean.
    pub fn scale(&self) -> f64 {
        1.0 / self.count.max(1) as f64
    }
}

/// The whole-model pass of a rank (see the module documentation).
#[derive(Debug, Clone, Copy)]
pub struct LocalPass {
    /// Threads a micro-batch's forward and backward are split over.
    pub compute_threads: usize,
    /// Keep only each block's input and recompute the block in the backward pass
    /// (`training.activation_checkpointing = "blocks"`; not for sampled labels, whose
    /// Hessian pass keeps every activation).
    pub checkpoint_blocks: bool,
}

impl LocalPass {
    /// The summed loss and gradients (f32) of every micro-batch of `batches`, each scaled
    /// so that they add up to the mean over the step.
    pub fn accumulate(
        &self,
        session: &Session,
        batches: MicroBatches,
    ) -> Result<(f32, Vec<Tensor<1>>), TrainError> {
        let (mut loss, mut grads) = (0.0f32, None::<Vec<Tensor<1>>>);
        let scale = batches.scale();
        for m in 0..batches.count {
            let b = (batches.read)(m)?;
            let (l, g) = self.micro_batch(session, &b.rows, batches.seq, scale, b.labels);
            loss += l;
            grads = Some(match grads {
                None => g,
                Some(acc) => acc.into_iter().zip(g).map(|(a, b)| a + b).collect(),
            });
        }
        Ok((loss, grads.unwrap_or_default()))
    }

    /// Mean loss of `rows` times `scale`, and its gradients, computed as pieces on as many
    /// compute threads and summed in a fixed order (deterministic whatever the scheduling).
    ///
    /// Why pieces: burn's flex backend runs element-wise kernels on one thread, and they
    /// are a large share of a step; two pieces keep both cores busy through them. The math
    /// is gradient accumulation over the pieces, exact up to f32 summation order.
    ///
    /// The pieces are tasks of the worker pool (rayon's), not threads of their own: a
    /// piece's matrix products and kernels split into tasks of the same pool, which stay on
    /// the worker that made them while every worker has a piece, and are stolen when one
    /// finishes early. Pieces on threads of their own would run beside the pool's
    /// workers: twice as many busy threads as cores, and a step ~20 % slower.
    fn micro_batch(
        &self,
        session: &Session,
        rows: &[Vec<u32>],
        seq: usize,
        scale: f64,
        labels: Labels,
    ) -> (f32, Vec<Tensor<1>>) {
        let threads = match crate::tensor::on_host_threads(&session.device) {
            true => self.compute_threads.min(rows.len()).max(1),
            false => 1, // one stream: see `on_host_threads`
        };
        let recompute = self.checkpoint_blocks;
        if threads == 1 {
            return piece_loss_and_grads(session, rows, seq, scale, labels, (0, recompute));
        }
        let per = rows.len().div_ceil(threads);
        let n = rows.len() as f64;
        let piece = |(i, chunk): (usize, &[Vec<u32>])| {
            let s = scale * chunk.len() as f64 / n;
            piece_loss_and_grads(session, chunk, seq, s, labels, (i, recompute))
        };
        let results: Vec<(f32, Vec<Tensor<1>>)> = match session.model.tensor_ranks().size() {
            // Tensor parallelism: the same pieces one after the other, whose collectives on
            // the model's one communicator must not interleave.
            1 => rows.par_chunks(per).enumerate().map(piece).collect(),
            _ => rows.chunks(per).enumerate().map(piece).collect(),
        };
        let mut iter = results.into_iter();
        let (mut loss, mut grads) = iter.next().unwrap_or_default();
        for (l, g) in iter {
            loss += l;
            grads = grads.into_par_iter().zip(g).map(|(a, b)| a + b).collect();
        }
        (loss, grads)
    }
}

/// Loss of one piece of a micro-batch times `scale`, and its gradients (f32); `piece`: its
/// number, and whether its blocks are recomputed in the backward pass.
fn piece_loss_and_grads(
    session: &Session,
    chunk: &[Vec<u32>],
    seq: usize,
    scale: f64,
    labels: Labels,
    (piece, recompute): (usize, bool),
) -> (f32, Vec<Tensor<1>>) {
    if let (true, Labels::Data { poison }) = (recompute, labels) {
        return recomputed_loss_and_grads(session, chunk, seq, scale, poison && piece == 0);
    }
    let device = session.device.clone().autodiff();
    let (model, params) = (&session.model, &session.params);
    let inputs = int_tensor(chunk, seq, &device);
    let leaves: Vec<Tensor<1>> = params
        .iter()
        .map(|p| p.clone().autodiff().require_grad())
        .collect();
    let (mut loss, poison) = match labels {
        Labels::Data { poison } => {
            let targets = target_tensor(chunk, seq, &device);
            (model.loss(&leaves, inputs, targets), poison && piece == 0)
        }
        Labels::Sampled { seed } => {
            let seed = seed ^ (piece as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let logits = model.forward(&leaves, inputs);
            (crate::model::sampled_label_loss(logits, seed), false)
        }
    };
    if scale != 1.0 {
        loss = loss.mul_scalar(scale);
    }
    let mut value = loss.clone().into_scalar::<f32>();
    if poison {
        loss = loss.mul_scalar(f64::NAN);
        value = f32::NAN;
    }
    let g = loss.backward();
    let grads = leaves
        .iter()
        .zip(params)
        .map(|(leaf, p)| {
            leaf.grad(&g)
                .unwrap_or_else(|| p.zeros_like())
                .cast(FloatDType::F32)
        })
        .collect();
    (value, grads)
}

/// [`piece_loss_and_grads`] with activation checkpointing: the stage-by-stage pass over this
/// rank's whole weights, which keeps each block's input and recomputes the block in the
/// backward pass (the same gradient bits). A poisoned batch (a debug fault) makes the loss
/// and every gradient NaN, as in the whole-model pass.
fn recomputed_loss_and_grads(
    session: &Session,
    chunk: &[Vec<u32>],
    seq: usize,
    scale: f64,
    poison: bool,
) -> (f32, Vec<Tensor<1>>) {
    let (model, params) = (&session.model, &session.params);
    let mut stages = LocalStages::new(model, params);
    let inputs = int_tensor(chunk, seq, &session.device);
    let targets = target_tensor(chunk, seq, &session.device);
    let scale = if poison { f64::NAN } else { scale };
    let targets = crate::model::Targets::Data(Box::new(targets));
    let loss = stagewise::loss_and_grads(model, &mut stages, inputs, targets, scale);
    (loss, stages.into_grads())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    /// Recomputing each block in the backward pass gives the gradients and loss of keeping
    /// its activations, bit for bit, on every compute-thread split.
    #[test]
    fn activation_checkpointing_gives_the_same_bits() {
        let mut cfg = Config::default();
        (cfg.model.d_model, cfg.model.n_layers, cfg.model.ffn_hidden) = (32, 3, 64);
        (cfg.model.n_heads, cfg.model.n_kv_heads) = (4, 2);
        cfg.training.seq_len = 16;
        let session = Session::new(&cfg, 40).unwrap();
        let rows: Vec<Vec<u32>> = (0..4u32)
            .map(|r| (0..17).map(|i| (r * 7 + i * 3) % 40).collect())
            .collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for threads in [1, 2] {
            let pass = |checkpoint_blocks| {
                let p = LocalPass {
                    compute_threads: threads,
                    checkpoint_blocks,
                };
                let mut read = |_| {
                    Ok(MicroBatch {
                        rows: rows.clone(),
                        labels: Labels::Data { poison: false },
                    })
                };
                let batches = MicroBatches {
                    count: 2,
                    seq: 16,
                    read: &mut read,
                };
                let (loss, grads) = p.accumulate(&session, batches).unwrap();
                let grads: Vec<Vec<f32>> = grads.iter().map(crate::tensor::to_vec).collect();
                (loss, grads)
            };
            let (kept, recomputed) = (pass(false), pass(true));
            assert_eq!(
                kept.0.to_bits(),
                recomputed.0.to_bits(),
                "loss, {threads} threads"
            );
            assert_eq!(kept.1.len(), recomputed.1.len());
            for (i, (a, b)) in kept.1.iter().zip(&recomputed.1).enumerate() {
                assert_eq!(bits(a), bits(b), "gradient {i}, {threads} threads");
            }
        }
    }
}
