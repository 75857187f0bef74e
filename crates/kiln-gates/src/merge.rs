//! `kiln merge`: checkpoint averaging (the seeds' WSM merging, "model soups" of one run): the
//! weights of several checkpoints of one run, averaged element by element, uniformly or with
//! the given weights (normalised to sum 1, accumulated in f64, rounded once to each tensor's
//! dtype).
//!
//! Each checkpoint is read as `kiln eval` reads it (verified against its manifest; the
//! shards of a sharded run assembled) and rebuilt with its run's recorded config, so
//! checkpoints written by any rank count or sharding mode of the run merge alike. They must
//! share a lineage (`state.json`'s `run_id`) and a model shape; any other is refused naming
//! both checkpoints. The result is a run directory of its own (`config.toml` of the source
//! run, `model.safetensors`, `merge.json` saying what was merged), which `kiln eval` and
//! `kiln export` take like any run's final weights; it is written to a temporary directory
//! beside `OUT` and renamed, and `OUT` must not exist or be empty.

use crate::{GatesError, io_err};
use kiln_train::checkpoint::{HostTensor, StoredDtype, to_safetensors};
use kiln_train::{Config, Session};
use serde_json::json;
use std::path::{Path, PathBuf};

/// What to merge and where.
#[derive(Debug, Clone)]
pub struct MergeOptions {
    /// Checkpoint directories (`RUN_DIR/checkpoints/step-N`), two or more.
    pub checkpoints: Vec<PathBuf>,
    /// One weight per checkpoint (normalised); `None`: uniform.
    pub weights: Option<Vec<f64>>,
    /// The output directory.
    pub out: PathBuf,
}

/// What a merge wrote.
#[derive(Debug, Clone)]
pub struct MergeReport {
    /// The output directory.
    pub out: PathBuf,
    /// The step of each checkpoint merged.
    pub steps: Vec<u64>,
    /// The normalised weight of each.
    pub weights: Vec<f64>,
    /// The run's lineage.
    pub run_id: String,
    /// Tensors averaged.
    pub tensors: usize,
}

/// The normalised weights of `n` checkpoints: `given` (one each, finite, not negative, not
/// all zero) over their sum, or uniform.
pub fn normalised_weights(given: Option<&[f64]>, n: usize) -> Result<Vec<f64>, GatesError> {
    let Some(w) = given else {
        return Ok(vec![1.0 / n as f64; n]);
    };
    if w.len() != n {
        return Err(GatesError::Usage(format!(
            "--weights has {} value(s) for {n} checkpoint(s); give one weight per checkpoint",
            w.len()
        )));
    }
    if let Some(bad) = w.iter().find(|x| !x.is_finite() || **x < 0.0) {
        return Err(GatesError::Usage(format!(
            "--weights {bad}: every weight must be a finite number >= 0"
        )));
    }
    // Scaled by the largest first: weights near f64's limit sum without overflowing (their
    // ratios are what counts).
    let largest = w.iter().copied().fold(0.0f64, f64::max);
    if largest <= 0.0 {
        return Err(GatesError::Usage(
            "--weights: the weights sum to 0; give at least one positive weight".into(),
        ));
    }
    let sum: f64 = w.iter().map(|x| x / largest).sum();
    Ok(w.iter().map(|x| x / largest / sum).collect())
}

/// One checkpoint, read and rebuilt.
struct Source {
    dir: PathBuf,
    run_dir: PathBuf,
    step: u64,
    run_id: String,
    model_hash: String,
    tensors: Vec<HostTensor>,
}

/// Reads checkpoint `dir` (verified, shards assembled) into its model's logical tensors.
fn read(dir: &Path) -> Result<Source, GatesError> {
    if !dir.join(kiln_run::layout::CHECKPOINT_MANIFEST).is_file() {
        return Err(GatesError::Invalid(format!(
            "{}: not a checkpoint directory (no {}); give checkpoints of one run, RUN_DIR/checkpoints/step-N",
            dir.display(),
            kiln_run::layout::CHECKPOINT_MANIFEST
        )));
    }
    let ck = kiln_train::checkpoint::load(dir)?;
    let run_dir = dir
        .parent()
        .and_then(Path::parent)
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
    let config_path = run_dir.join(kiln_run::layout::CONFIG);
    if !config_path.is_file() {
        return Err(GatesError::Invalid(format!(
            "{}: missing; the run's config is needed to rebuild the model of {}",
            config_path.display(),
            dir.display()
        )));
    }
    let cfg = Config::load_recorded(&config_path).map_err(kiln_train::TrainError::from)?;
    let text = |k: &str| {
        ck.state
            .get(k)
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_string()
    };
    let session = Session::from_weights(&cfg, &ck.model, dir)?;
    Ok(Source {
        dir: dir.to_path_buf(),
        run_dir,
        step: ck.step,
        run_id: text("run_id"),
        model_hash: text("model_hash"),
        tensors: session.host_params(),
    })
}

/// Merges the checkpoints; see the module documentation.
pub fn merge(opts: &MergeOptions) -> Result<MergeReport, GatesError> {
    let n = opts.checkpoints.len();
    if n < 2 {
        return Err(GatesError::Usage(format!(
            "kiln merge needs two or more checkpoints, got {n}"
        )));
    }
    let weights = normalised_weights(opts.weights.as_deref(), n)?;
    crate::export::refuse_non_empty(&opts.out)?;
    let first = read(&opts.checkpoints[0])?;
    let mut sums: Vec<Vec<f64>> = first
        .tensors
        .iter()
        .map(|t| {
            t.values
                .iter()
                .map(|&v| f64::from(v) * weights[0])
                .collect()
        })
        .collect();
    let mut steps = vec![first.step];
    for (dir, &w) in opts.checkpoints.iter().zip(&weights).skip(1) {
        let other = read(dir)?;
        check_same_run(&first, &other)?;
        for (sum, t) in sums.iter_mut().zip(&other.tensors) {
            for (s, &v) in sum.iter_mut().zip(&t.values) {
                *s += f64::from(v) * w;
            }
        }
        steps.push(other.step);
    }
    let merged: Vec<HostTensor> = first
        .tensors
        .iter()
        .zip(sums)
        .map(|(t, sum)| HostTensor {
            name: t.name.clone(),
            shape: t.shape.clone(),
            dtype: t.dtype,
            values: sum.into_iter().map(|s| round(s, t.dtype)).collect(),
        })
        .collect();
    let bytes = to_safetensors(&merged)
        .map_err(|e| GatesError::Invalid(format!("serialising the merged weights: {e}")))?;
    let config_path = first.run_dir.join(kiln_run::layout::CONFIG);
    let config = std::fs::read(&config_path).map_err(io_err(&config_path))?;
    let record = json!({
        "merged": opts.checkpoints.iter().zip(&steps).zip(&weights)
            .map(|((p, s), w)| json!({"checkpoint": p.to_string_lossy(), "step": s, "weight": w}))
            .collect::<Vec<_>>(),
        "run_id": first.run_id,
        "tensors": merged.len(),
    });
    let files = vec![
        (kiln_run::layout::FINAL_MODEL.to_string(), bytes),
        (kiln_run::layout::CONFIG.to_string(), config),
        (
            MERGE_RECORD.to_string(),
            format!("{record:#}\n").into_bytes(),
        ),
    ];
    crate::export::publish(&opts.out, &files)?;
    Ok(MergeReport {
        out: opts.out.clone(),
        steps,
        weights,
        run_id: first.run_id,
        tensors: merged.len(),
    })
}

/// What a merged directory records about its sources.
pub const MERGE_RECORD: &str = "merge.json";

/// `s` rounded to `dtype` (through f32: bf16 rounds to nearest even from the f32 value, as
/// every bf16 weight kiln writes).
fn round(s: f64, dtype: StoredDtype) -> f32 {
    let v = s as f32;
    match dtype {
        StoredDtype::F32 => v,
        StoredDtype::Bf16 => burn::tensor::bf16::from_f32(v).to_f32(),
    }
}

/// Refuses `b` unless it is of `a`'s run (lineage) and model shape, naming both.
fn check_same_run(a: &Source, b: &Source) -> Result<(), GatesError> {
    let (pa, pb) = (a.dir.display(), b.dir.display());
    if a.run_id != b.run_id {
        return Err(GatesError::Invalid(format!(
            "{pb} is of another run (lineage {:?}) than {pa} (lineage {:?}); kiln merge averages checkpoints of one run",
            b.run_id, a.run_id
        )));
    }
    let shapes = |s: &Source| -> Vec<(String, Vec<usize>)> {
        s.tensors
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone()))
            .collect()
    };
    let (sa, sb) = (shapes(a), shapes(b));
    if sa != sb || a.model_hash != b.model_hash {
        let differ = sa.iter().zip(&sb).find(|(x, y)| x != y).map_or_else(
            || format!("{} tensors against {}", sb.len(), sa.len()),
            |(x, y)| {
                format!(
                    "tensor {} is {:?} in {pa} but {} is {:?} in {pb}",
                    x.0, x.1, y.0, y.1
                )
            },
        );
        return Err(GatesError::Invalid(format!(
            "{pb} and {pa} have different model shapes ({differ}); kiln merge averages checkpoints of one model"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_are_checked_and_normalised() {
        assert_eq!(normalised_weights(None, 4).unwrap(), [0.25; 4]);
        assert_eq!(
            normalised_weights(Some(&[1.0, 3.0]), 2).unwrap(),
            [0.25, 0.75]
        );
        // Issue 60: weights whose sum overflows f64 were "summing to 0".
        assert_eq!(
            normalised_weights(Some(&[1e308, 1e308]), 2).unwrap(),
            [0.5, 0.5]
        );
        assert_eq!(
            normalised_weights(Some(&[f64::MAX, 0.0, f64::MAX]), 3).unwrap(),
            [0.5, 0.0, 0.5]
        );
        for (w, want) in [
            (vec![1.0], "1 value(s) for 2"),
            (vec![1.0, f64::NAN], "finite number >= 0"),
            (vec![-1.0, 2.0], "finite number >= 0"),
            (vec![0.0, 0.0], "sum to 0"),
        ] {
            let err = normalised_weights(Some(&w), 2).unwrap_err().to_string();
            assert!(err.contains(want), "{w:?}: {err}");
        }
    }

    #[test]
    fn bf16_weights_round_once() {
        let v = round(1.0 + 2f64.powi(-9), StoredDtype::Bf16);
        assert!(v == 1.0 || v == 1.0 + 2f32.powi(-7), "{v}");
        assert_eq!(round(0.1, StoredDtype::F32), 0.1f32);
    }
}
