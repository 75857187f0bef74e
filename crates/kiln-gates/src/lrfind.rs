//! The learning-rate finder (Smith 2015, fastai's `lr_find`): train from a fresh model while
//! the LR grows exponentially from `min` to `max`, smooth the loss with a debiased EMA, stop
//! when it blows up (smoothed loss above `blowup_factor` times the best so far, or not
//! finite), and suggest the LR where the smoothed loss falls fastest (steepest descent
//! against log LR) and, as a more conservative bound, the blow-up LR divided by 10.
//!
//! The steps are the trainer's own [`Step`] (same model, precision, data and batch layout,
//! optimizer (`optimizer.kind`: AdamW, Muon or SophiaG, with SophiaG's Hessian estimates),
//! gradient clipping and `parallelism.shard` from the config); only the LR differs: no
//! schedule, no warmup. Under several ranks (MPI, `kiln launch`) the sweep is one
//! data-parallel sweep over all of them: every rank sees the same averaged loss and stops at
//! the same step, and only rank 0 writes the results ([`LrFindResult::writer`]).

use crate::plot::{Panel, Series, write_plots};
use crate::{GatesError, io_err};
use kiln_train::data::TrainData;
use kiln_train::mesh::DeviceMesh;
use kiln_train::step::{At, BatchLayout, Step};
use kiln_train::{Config, Session};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// Sweep settings.
#[derive(Debug, Clone)]
pub struct LrFindOptions {
    /// First LR.
    pub min_lr: f64,
    /// Last LR.
    pub max_lr: f64,
    /// Steps of the sweep.
    pub steps: u64,
    /// EMA coefficient of the smoothing (0.9: about the last 10 steps).
    pub beta: f64,
    /// Stop when the smoothed loss exceeds this many times the best smoothed loss.
    pub blowup_factor: f64,
}

impl Default for LrFindOptions {
    fn default() -> Self {
        Self {
            min_lr: 1e-6,
            max_lr: 1.0,
            steps: 100,
            beta: 0.9,
            blowup_factor: 4.0,
        }
    }
}

/// One step of the sweep.
#[derive(Debug, Clone, Serialize)]
pub struct LrPoint {
    /// Step (1-based).
    pub step: u64,
    /// LR used.
    pub lr: f64,
    /// Raw loss.
    pub loss: f64,
    /// Debiased EMA of the loss.
    pub smoothed: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
}

/// Result of a sweep.
#[derive(Debug, Clone, Serialize)]
pub struct LrFindResult {
    /// Every step run.
    pub points: Vec<LrPoint>,
    /// LR where the smoothed loss falls fastest against log LR.
    pub steepest_lr: Option<f64>,
    /// LR at which the smoothed loss blew up, if it did.
    pub blowup_lr: Option<f64>,
    /// LR of the lowest smoothed loss.
    pub min_loss_lr: Option<f64>,
    /// The conservative suggestion: blow-up LR / 10 (or, without a blow-up, min-loss LR / 10).
    pub conservative_lr: Option<f64>,
    /// The suggestion: the steepest-descent LR.
    pub suggested_lr: Option<f64>,
    /// Whether this rank is the one that reports and writes the results (rank 0).
    #[serde(skip)]
    pub writer: bool,
}

/// LR of step `i` (0-based) of an exponential ramp over `n` steps.
pub fn ramp(min: f64, max: f64, i: u64, n: u64) -> f64 {
    if n <= 1 {
        return min;
    }
    min * (max / min).powf(i as f64 / (n - 1) as f64)
}

impl LrFindOptions {
    /// Refuses a sweep that cannot run: its range, blow-up factor, steps and smoothing.
    fn check(&self) -> Result<(), GatesError> {
        let refuse = |why: String| Err(GatesError::Usage(why));
        if !(self.min_lr > 0.0 && self.max_lr > self.min_lr && self.max_lr.is_finite()) {
            return refuse(format!(
                "need 0 < --min < --max, got --min {} --max {}",
                self.min_lr, self.max_lr
            ));
        }
        if !(self.blowup_factor.is_finite() && self.blowup_factor > 1.0) {
            return refuse(format!(
                "--blowup {}: must be a finite number > 1 (the smoothed loss over its best that ends the sweep; 4 is typical)",
                self.blowup_factor
            ));
        }
        if self.steps < 5 {
            return refuse(format!(
                "--steps {} is too few for a sweep; use at least 5 (50-200 is typical)",
                self.steps
            ));
        }
        if !(0.0..1.0).contains(&self.beta) {
            return refuse(format!(
                "smoothing beta must be in [0, 1), got {}",
                self.beta
            ));
        }
        Ok(())
    }
}

/// Runs the sweep over every rank of the job (one rank outside a launcher); `progress` sees
/// each point on rank 0. An error on one rank ends them all (MPI_Abort), so none waits in a collective.
pub fn run(
    config: &Config,
    opts: &LrFindOptions,
    progress: &mut dyn FnMut(&LrPoint),
) -> Result<LrFindResult, GatesError> {
    opts.check()?;
    let mesh =
        kiln_train::mesh::start(&config.parallelism).map_err(|e| GatesError::Train(e.into()))?;
    let comm = mesh.world();
    sweep(config, opts, &mesh, progress).inspect_err(|e| {
        if comm.size() > 1 {
            tracing::error!("rank {}: {e}", comm.rank());
            comm.abort(kiln_run::exit::ExitCoded::exit_code(e));
        }
    })
}

/// The sweep on this rank of `mesh`.
fn sweep(
    config: &Config,
    opts: &LrFindOptions,
    mesh: &DeviceMesh,
    progress: &mut dyn FnMut(&LrPoint),
) -> Result<LrFindResult, GatesError> {
    let invalid = |e: String| GatesError::Invalid(format!("data: {e}"));
    let layout = BatchLayout::of(&config.training, mesh).map_err(GatesError::Invalid)?;
    let comm = mesh.world();
    let samples = opts.steps.saturating_mul(layout.global_batch());
    let data = TrainData::open(config, samples, None).map_err(invalid)?;
    let vocab = data.vocab(config).map_err(invalid)?;
    let mut s = Session::for_rank_of(config, vocab, comm.size())?;
    let (step, mut optimizer) = Step::for_run(config, &mut s, layout, mesh)?;
    let mut points: Vec<LrPoint> = Vec::new();
    let (mut avg, mut best) = (0.0f64, f64::INFINITY);
    let mut blowup = None;
    for i in 0..opts.steps {
        let lr = ramp(opts.min_lr, opts.max_lr, i, opts.steps);
        let at = At {
            base: i * layout.global_batch(),
            batch_no: i + 1,
        };
        let g = step.gradients(&s, data.source.as_ref(), at)?;
        let value = f64::from(g.loss);
        avg = opts.beta * avg + (1.0 - opts.beta) * value;
        let smoothed = avg / (1.0 - opts.beta.powi(i as i32 + 1));
        let p = LrPoint {
            step: i + 1,
            lr,
            loss: value,
            smoothed,
            grad_norm: f64::from(g.norm),
        };
        if comm.rank() == 0 {
            progress(&p);
        }
        points.push(p);
        let blew_up = !smoothed.is_finite() || (i > 0 && smoothed > opts.blowup_factor * best);
        best = best.min(smoothed);
        if blew_up || !g.norm.is_finite() {
            blowup = Some(lr);
            break;
        }
        step.apply(&mut s, &mut optimizer, data.source.as_ref(), g, lr)?;
    }
    Ok(LrFindResult {
        writer: comm.rank() == 0,
        ..analyse(points, blowup)
    })
}

/// The suggestions from a sweep's points (exposed for tests).
pub fn analyse(points: Vec<LrPoint>, blowup_lr: Option<f64>) -> LrFindResult {
    // Points before the blow-up (the last point is the blow-up itself when there was one).
    let usable = if blowup_lr.is_some() {
        points.len().saturating_sub(1)
    } else {
        points.len()
    };
    let pts = &points[..usable];
    let min_loss_lr = pts
        .iter()
        .filter(|p| p.smoothed.is_finite())
        .min_by(|a, b| a.smoothed.total_cmp(&b.smoothed))
        .map(|p| p.lr);
    // Steepest descent: differences of the smoothed loss against ln(lr) over a window of
    // +-k points (k = 1/20 of the sweep, at least 2: single-step differences pick noise),
    // skipping the first tenth (the EMA is still warming up) and the region past the minimum.
    let k = (points.len() / 20).max(2);
    let skip = (points.len() / 10).max(k);
    let end = pts
        .iter()
        .position(|p| Some(p.lr) == min_loss_lr)
        .map_or(pts.len(), |i| (i + 1).min(pts.len()));
    let mut steepest: Option<(f64, f64)> = None;
    for i in skip..end.saturating_sub(k) {
        let (a, b) = (&pts[i - k], &pts[i + k]);
        let slope = (b.smoothed - a.smoothed) / (b.lr.ln() - a.lr.ln());
        if slope.is_finite() && steepest.is_none_or(|(s, _)| slope < s) {
            steepest = Some((slope, pts[i].lr));
        }
    }
    let steepest_lr = steepest.map(|(_, lr)| lr);
    let conservative_lr = blowup_lr.or(min_loss_lr).map(|lr| lr / 10.0);
    LrFindResult {
        points,
        steepest_lr,
        blowup_lr,
        min_loss_lr,
        conservative_lr,
        suggested_lr: steepest_lr.or(conservative_lr),
        writer: true,
    }
}

/// Writes `lr-find.csv`, `lr-find.json` (the suggestions) and `lr-find.svg`/`.png` into `dir`;
/// returns the paths written.
pub fn write_outputs(result: &LrFindResult, dir: &Path) -> Result<Vec<PathBuf>, GatesError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let csv = dir.join("lr-find.csv");
    let mut text = String::from("step,lr,loss,smoothed_loss,grad_norm\n");
    for p in &result.points {
        text.push_str(&format!(
            "{},{:e},{},{},{}\n",
            p.step, p.lr, p.loss, p.smoothed, p.grad_norm
        ));
    }
    std::fs::write(&csv, text).map_err(io_err(&csv))?;
    let json = dir.join("lr-find.json");
    let summary = serde_json::json!({
        "suggested_lr": result.suggested_lr,
        "steepest_lr": result.steepest_lr,
        "conservative_lr": result.conservative_lr,
        "blowup_lr": result.blowup_lr,
        "min_loss_lr": result.min_loss_lr,
        "steps_run": result.points.len(),
    });
    std::fs::write(&json, format!("{summary:#}\n")).map_err(io_err(&json))?;
    let mut markers = Vec::new();
    if let Some(lr) = result.steepest_lr {
        markers.push((lr, format!("steepest {lr:.1e}")));
    }
    if let Some(lr) = result.conservative_lr {
        markers.push((lr, format!("{lr:.1e}")));
    }
    let panels = vec![Panel {
        title: "loss vs learning rate".into(),
        x_label: "learning rate (log)".into(),
        log_x: true,
        series: vec![
            Series {
                name: "loss".into(),
                points: result.points.iter().map(|p| (p.lr, p.loss)).collect(),
            },
            Series {
                name: "smoothed".into(),
                points: result.points.iter().map(|p| (p.lr, p.smoothed)).collect(),
            },
        ],
        markers,
        ..Default::default()
    }];
    let (svg, png) = write_plots(&dir.join("lr-find"), "kiln lr-find", &panels, 1)?;
    Ok(vec![csv, json, svg, png])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pts(losses: &[f64]) -> Vec<LrPoint> {
        losses
            .iter()
            .enumerate()
            .map(|(i, &l)| LrPoint {
                step: i as u64 + 1,
                lr: ramp(1e-5, 1.0, i as u64, losses.len() as u64),
                loss: l,
                smoothed: l,
                grad_norm: 1.0,
            })
            .collect()
    }

    #[test]
    fn ramp_is_exponential() {
        assert_eq!(ramp(1e-4, 1e-2, 0, 3), 1e-4);
        assert!((ramp(1e-4, 1e-2, 1, 3) - 1e-3).abs() < 1e-12);
        assert!((ramp(1e-4, 1e-2, 2, 3) - 1e-2).abs() < 1e-12);
    }

    #[test]
    fn steepest_descent_and_blowup() {
        // flat, then a steep fall over indices 3-6, a minimum, then a blow-up
        let losses = [3.0, 3.0, 3.0, 2.9, 2.7, 2.0, 1.0, 0.9, 0.85, 0.8, 1.5, 9.0];
        let r = analyse(pts(&losses), Some(1.0));
        let lrs: Vec<f64> = r.points.iter().map(|p| p.lr).collect();
        assert_eq!(r.steepest_lr, Some(lrs[4]));
        assert_eq!(r.min_loss_lr, Some(lrs[9]));
        assert_eq!(r.conservative_lr, Some(0.1));
        assert_eq!(r.suggested_lr, r.steepest_lr);
    }
}
