//! Tensor parallelism (`parallelism.tp`): the model's matrices cut over the ranks of the
//! mesh's `tp` dim, Megatron's and torchtitan's layout ([`crate::model::Llama::tensor_parallel`]):
//! q/k/v, gate and up by their outputs (column-parallel), o and down by their inputs
//! (row-parallel), the embedding and the output head by the vocabulary, K and V by their
//! heads when the ranks divide them (else whole on every rank); sequence parallelism on the
//! norms and the residual stream; the loss computed on the cut logits (loss parallelism).
//! The model's differentiable collectives ([`crate::mesh::autograd`]) make every
//! reduction inside the forward and backward pass; what sits here is what a run does around
//! them: cutting the session's weights to this rank's boxes ([`apply`]) and putting the ranks'
//! boxes back together ([`whole`]).
//!
//! The ranks of one `tp` group train on the same samples (they are one data-parallel rank),
//! so the data-parallel exchanges, the loss and the batch layout see them as one.

use crate::checkpoint::HostTensor;
use crate::error::TrainError;
use crate::mesh::autograd::Group;
use crate::mesh::placement::Placement;
use crate::mesh::{DeviceMesh, Dim};
use crate::model::Llama;
use crate::model::session::Session;
use crate::tensor::{into_vec, to_vec};
use burn::tensor::{Tensor, TensorData};

/// Cuts `session`'s model and weights over `mesh`'s `tp` ranks: the model re-laid out with
/// this rank's boxes, each weight cut from the whole one (every rank drew or loaded the
/// whole: the boxes are those of one model). Nothing to do with one `tp` rank. Every rank of
/// the mesh calls it (the model's collectives get a communicator of their own).
pub fn apply(session: &mut Session, mesh: &DeviceMesh) -> Result<(), TrainError> {
    if mesh.shape().size(Dim::Tp) == 1 {
        return Ok(());
    }
    let group = Group::split(mesh.group(Dim::Tp));
    let cfg = &session.config;
    let model = Llama::tensor_parallel(&cfg.model, session.model.vocab(), group)
        .map_err(TrainError::Parallel)?
        .with_compute(cfg.training.dtype);
    let params = (model.specs().iter())
        .zip(std::mem::take(&mut session.params))
        .map(|(spec, whole)| {
            let dtype = whole.dtype();
            let local = spec.placement.take(&into_vec(whole));
            let n = local.len();
            Tensor::<1>::from_data(TensorData::new(local, [n]), &session.device).cast(dtype)
        })
        .collect();
    session.model = model;
    session.params = params;
    Ok(())
}

/// The whole tensors of `model`'s parameters, named and in their whole shapes, from every
/// `tp` rank's boxes, `local` being this rank's values of each (row-major). Every rank of the
/// model's `tp` group calls it and gets them all.
pub fn whole(model: &Llama, local: Vec<Vec<f32>>) -> Vec<HostTensor> {
    let group = model.tensor_ranks();
    (model.specs().iter().zip(local))
        .map(|(spec, mine)| {
            let p = &spec.placement;
            let values = match p.cut {
                None => mine,
                Some((_, dim)) => {
                    let mut all = vec![0.0f32; mine.len() * group.size()];
                    group.with(|c| c.all_gather_f32(&mine, &mut all));
                    let mut out = vec![0.0f32; p.global.iter().product()];
                    for (r, block) in all.chunks(mine.len().max(1)).enumerate() {
                        let theirs = Placement::cut(&p.global, dim, Dim::Tp, group.size(), r);
                        theirs.put(block, &mut out);
                    }
                    out
                }
            };
            HostTensor::f32(spec.name.clone(), p.global.clone(), values)
        })
        .collect()
}

/// The sum of squares of this rank's `grads` (one per parameter of `model`: whole tensors,
/// boxes or pieces of them) that a global norm counts from this rank: every element of a
/// parameter the `tp` ranks cut, and a parameter they all hold whole (the same gradient on
/// each) on the first of them only. Summed over the `tp` ranks (and over the ranks a
/// sharded state is cut over), it is the square of the norm, each element counted once.
pub fn counted_square_sum(model: &Llama, grads: &[Tensor<1>]) -> f64 {
    let first = model.tensor_ranks().rank() == 0;
    (model.specs().iter().zip(grads))
        .filter(|(spec, _)| first || !spec.placement.is_whole())
        .map(|(_, g)| {
            to_vec(g)
                .iter()
                .fold(0.0f64, |s, &v| s + f64::from(v) * f64::from(v))
        })
        .sum()
}

/// The global norm of the gradients of `model`'s parameters of which this rank holds
/// `grads` (whole on one `tp` rank, its boxes under tensor parallelism): the one-rank norm,
/// bit for bit, on one rank; else [`counted_square_sum`] summed over the `tp` ranks.
pub fn global_norm(model: &Llama, grads: &[Tensor<1>]) -> f32 {
    let group = model.tensor_ranks();
    if group.size() == 1 {
        return crate::optim::global_norm(grads);
    }
    let mut sq = [counted_square_sum(model, grads)];
    group.with(|c| c.all_reduce_sum_f64(&mut sq));
    sq[0].sqrt() as f32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, ModelConfig};
    use crate::mesh::MeshShape;
    use crate::step::pass::{Labels, LocalPass, MicroBatch, MicroBatches};
    use kiln_dist::Threads;

    /// A tiny model whose shapes every tested `tp` divides.
    fn cfg(heads: usize, kv: usize, tie: bool, qk_norm: bool) -> Config {
        let mut c = Config::default();
        c.model = ModelConfig {
            d_model: 32,
            n_layers: 2,
            n_heads: heads,
            n_kv_heads: kv,
            ffn_hidden: 64,
            tie_embeddings: tie,
            qk_norm,
            ..c.model
        };
        c.training.seq_len = 8;
        c.training.compute_shards = 1;
        c
    }

    /// Four rows of 9 tokens from a vocabulary of 48.
    fn rows() -> Vec<Vec<u32>> {
        (0..4u32)
            .map(|r| (0..9).map(|i| (r * 11 + i * 5) % 48).collect())
            .collect()
    }

    /// The loss and the whole gradients of one micro-batch on this rank of a `tp`-way run.
    fn loss_and_grads(c: &Config, mesh: &DeviceMesh) -> (f32, Vec<Vec<f32>>) {
        let mut s = Session::new(c, 48).unwrap();
        apply(&mut s, mesh).unwrap();
        let pass = LocalPass {
            compute_threads: 1,
            checkpoint_blocks: false,
        };
        let mut read = |_| {
            Ok(MicroBatch {
                rows: rows(),
                labels: Labels::Data { poison: false },
            })
        };
        let batches = MicroBatches {
            count: 1,
            seq: 8,
            read: &mut read,
        };
        let (loss, grads) = pass.accumulate(&s, batches).unwrap();
        let local = grads.iter().map(to_vec).collect();
        (
            loss,
            whole(&s.model, local)
                .into_iter()
                .map(|t| t.values)
                .collect(),
        )
    }

    fn on_tp(c: &Config, tp: usize) -> Vec<(f32, Vec<Vec<f32>>)> {
        Threads::each(tp, |comm| {
            let shape = MeshShape::default().with(Dim::Tp, tp);
            let mesh = DeviceMesh::new(Box::new(comm.clone()), shape, &[]).unwrap();
            loss_and_grads(c, &mesh)
        })
    }

    fn worst(a: &[f32], b: &[f32]) -> f32 {
        let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
        a.iter()
            .zip(b)
            .fold(0.0f32, |m, (x, y)| m.max((x - y).abs() / scale))
    }

    /// TP = 2 and 4 give the one-rank loss and gradients (each parameter's whole gradient
    /// put back from the ranks' boxes), with K/V cut by their heads and whole, tied and
    /// untied heads, and QK-norm: every rank has the same loss, and no gradient is off by
    /// more than float rounding.
    #[test]
    fn tensor_parallel_ranks_give_the_one_rank_loss_and_gradients() {
        for (heads, kv, tie, qk) in [
            (4, 4, false, false),
            (4, 2, true, true),
            (8, 2, false, true),
        ] {
            let c = cfg(heads, kv, tie, qk);
            let (loss, grads) = on_tp(&c, 1).remove(0);
            for tp in [2, 4] {
                for (r, (l, g)) in on_tp(&c, tp).into_iter().enumerate() {
                    let what =
                        format!("heads {heads} kv {kv} tied {tie} qk {qk}, tp {tp} rank {r}");
                    assert!(
                        (l - loss).abs() <= 2e-6 * loss.abs(),
                        "{what}: loss {l} vs {loss}"
                    );
                    for (i, (a, b)) in g.iter().zip(&grads).enumerate() {
                        let w = worst(a, b);
                        assert!(w < 2e-5, "{what}: gradient {i} off by {w:e}");
                    }
                }
            }
        }
    }
}
