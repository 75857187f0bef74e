//! Fuzz harness: a checkpoint's `state.json` as resume interprets it: the JSON value
//! `checkpoint::load` returns, the trainer's `TrainState` (its data cursor and global batch,
//! which resume turns into a batch layout), and the data schedule (`data_schedule`, a
//! `kiln_data::BlendSchedule`) that the loader continues, bounds and builds a blend from.
//!
//! A schedule that resolves must give per-dataset bounds and a blend whose every sample
//! comes from a listed dataset, within its bound.

use kiln_data::blend::{Blend, BlendSchedule, sample_bounds};
use kiln_train::step::BatchLayout;
use kiln_train::{Config, TrainState};

/// What `Trainer::restore` computes from the state before training resumes: the first
/// sample of the next step, and the batch layout that keeps the checkpoint's global batch.
fn restore_arithmetic(state: &TrainState) {
    let cfg = Config::default();
    let mut st = state.clone();
    if st.global_batch == 0 {
        st.global_batch = (cfg.training.batch_size * cfg.training.grad_accum_steps) as u64;
    }
    let _ = st.next_sample();
    let layout = BatchLayout::new(&cfg.training, 0, 1).expect("default layout");
    if let Ok(l) = layout.with_global_batch(st.global_batch) {
        assert_eq!(l.global_batch(), st.global_batch);
        let _ = l.samples_for(cfg.training.steps);
    }
}

pub fn run(data: &[u8]) {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let state = serde_json::from_value::<TrainState>(value.clone()).ok();
    if let Some(st) = &state {
        restore_arithmetic(st);
    }
    let at_sample = state
        .as_ref()
        .map_or(0, |s| s.sample_cursor.unwrap_or(s.data_cursor));
    let far = state.as_ref().map_or(u64::MAX, |s| s.tokens_seen);
    let Some(schedule) = value.get("data_schedule").filter(|v| !v.is_null()) else {
        return;
    };
    let Ok(schedule) = serde_json::from_value::<BlendSchedule>(schedule.clone()) else {
        return;
    };
    // The corpus list of the resumed run: every key the schedule names (so that it resolves),
    // with the weights of its last segment, or one new dataset.
    let mut table: Vec<String> = Vec::new();
    for seg in &schedule.segments {
        for (k, _) in &seg.weights {
            if !table.contains(k) {
                table.push(k.clone());
            }
        }
    }
    let weights = match schedule.segments.last() {
        Some(s) if !s.weights.is_empty() => s.weights.clone(),
        _ => {
            table.push("new".into());
            vec![("new".to_string(), 1.0)]
        }
    };
    for sched in [schedule.clone(), schedule.continued(weights, at_sample)] {
        for samples in [far, at_sample, u64::MAX] {
            if let Ok(bounds) = sample_bounds(&sched, &table, samples) {
                assert_eq!(bounds.len(), table.len());
                assert!(
                    bounds.iter().all(|&b| b <= samples),
                    "bounds {bounds:?} > {samples}"
                );
            }
        }
        let samples = at_sample.min(3000) + 17;
        let dir = tempfile::tempdir().expect("temporary directory");
        let Ok(blend) = Blend::build(&sched, &table, samples, dir.path()) else {
            continue;
        };
        let totals = blend.totals();
        assert_eq!(totals.len(), table.len());
        assert_eq!(
            totals.iter().sum::<u64>(),
            samples,
            "every sample has one dataset"
        );
        let bounds = sample_bounds(&sched, &table, samples).expect("resolved once already");
        for (d, (&t, &b)) in totals.iter().zip(&bounds).enumerate() {
            assert!(t <= b, "dataset {d} serves {t} samples, over its bound {b}");
        }
        for i in [0, samples / 2, samples - 1] {
            let (d, j) = blend.get(i).expect("sample in range");
            assert!(d < table.len());
            assert!(
                j < totals[d],
                "sample {i}: dataset {d} sample {j} of {}",
                totals[d]
            );
        }
        assert!(blend.get(samples).is_err());
    }
}
