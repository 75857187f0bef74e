//! Held-out evaluation: [`Evaluator`] decides when eval is due (`eval.interval`, and the
//! last step) and scores the model on the synthetic corpus's held-out samples.

use crate::cadence::Every;
use crate::components::metrics::EvalMetrics;
use crate::config::Config;
use crate::data::synthetic::Synthetic;
use crate::model::session::Session;
use crate::tensor::{int_tensor, target_tensor};
use burn::tensor::{Int, Tensor};

/// The eval component of a run: its cadence and what it needs from the run.
pub struct Evaluator {
    every: Every,
    total: u64,
    samples: usize,
    /// The corpus's unigram loss, reported beside the model's for comparison.
    unigram: Option<f64>,
}

impl Evaluator {
    /// The evaluator of `cfg` for a run of `total` steps over `syn` (none: no held-out data).
    pub fn new(cfg: &Config, total: u64, syn: Option<&Synthetic>) -> Self {
        Self {
            every: Every(cfg.eval.interval),
            total,
            samples: cfg.eval.samples,
            unigram: syn.map(|s| s.unigram_entropy(64, cfg.training.seq_len + 1)),
        }
    }

    /// Whether eval runs after `step` (eval.samples = 0: never, rather than a loss of 0 over
    /// no sequences).
    pub fn due(&self, step: u64) -> bool {
        self.samples > 0 && self.every.due_or_last(step, self.total)
    }

    /// Held-out loss and accuracy of `session` after `step`.
    pub fn run(&self, session: &Session, syn: &Synthetic, step: u64) -> EvalMetrics {
        synthetic(session, syn, step, self.samples, self.unigram)
    }

    /// [`Evaluator::run`] with the model's logits computed by `logits` (a parameter-sharded
    /// run's stage-by-stage forward pass).
    pub fn run_with(
        &self,
        session: &Session,
        syn: &Synthetic,
        step: u64,
        logits: &mut dyn FnMut(Tensor<2, Int>) -> Tensor<3>,
    ) -> EvalMetrics {
        scored(session, syn, (step, self.samples, self.unigram), logits)
    }
}

/// Held-out loss and answer accuracy on the synthetic corpus (`samples` sequences).
pub fn synthetic(
    session: &Session,
    syn: &Synthetic,
    step: u64,
    samples: usize,
    unigram: Option<f64>,
) -> EvalMetrics {
    let logits = &mut |x| session.model.forward(&session.params, x);
    scored(session, syn, (step, samples, unigram), logits)
}

/// [`synthetic`] with the logits of `logits`.
fn scored(
    session: &Session,
    syn: &Synthetic,
    (step, samples, unigram): (u64, usize, Option<f64>),
    logits: &mut dyn FnMut(Tensor<2, Int>) -> Tensor<3>,
) -> EvalMetrics {
    let len = session.config.training.seq_len + 1;
    let batch = session.config.training.batch_size.max(1);
    let (mut loss_sum, mut n_batches, mut correct, mut total) = (0.0f64, 0usize, 0usize, 0usize);
    let mut idx = 0u64;
    while (idx as usize) < samples {
        let rows: Vec<_> = (0..batch.min(samples - idx as usize))
            .map(|r| syn.eval_sample(idx + r as u64, len))
            .collect();
        idx += rows.len() as u64;
        let tokens: Vec<Vec<u32>> = rows.iter().map(|s| s.tokens.clone()).collect();
        let inputs = int_tensor(&tokens, len - 1, &session.device);
        let logits = logits(inputs); // [b, t, v]
        let [b, t, v] = logits.dims();
        let targets = target_tensor(&tokens, t, &session.device);
        let logp = burn::tensor::activation::log_softmax(logits.clone().reshape([b * t, v]), 1);
        loss_sum += f64::from(
            logp.gather(1, targets.reshape([b * t, 1]))
                .mean()
                .neg()
                .into_scalar::<f32>(),
        );
        n_batches += 1;
        // `iter` converts from whatever int dtype the backend uses (flex: i32).
        let pred: Vec<i64> = logits.argmax(2).into_data().iter::<i64>().collect();
        for (r, sample) in rows.iter().enumerate() {
            for &(start, end) in &sample.answers {
                // token at position p is predicted from position p-1
                if start == 0 {
                    continue;
                }
                total += 1;
                let ok = (start..end)
                    .all(|p| pred.get(r * t + p - 1).copied() == Some(i64::from(sample.tokens[p])));
                correct += usize::from(ok);
            }
        }
    }
    EvalMetrics {
        step,
        eval_loss: loss_sum / n_batches.max(1) as f64,
        eval_accuracy: (total > 0).then(|| correct as f64 / total as f64),
        unigram_loss: unigram,
        extra: serde_json::Map::new(),
    }
}
