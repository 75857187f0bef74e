//! Parity helper (used by bench/train/parity.py): writes a fresh model's weights and one
//! batch to DIR, and prints the loss and the global gradient norm kiln computes for them,
//! so a PyTorch implementation of the same model can be checked against kiln.
use kiln_train::checkpoint::to_safetensors;
use kiln_train::step::{At, BatchLayout, Step};
use kiln_train::{Config, Session};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args()
        .nth(1)
        .ok_or("usage: dump_step DIR [--set k=v]...")?;
    let overrides: Vec<String> = std::env::args().skip(2).filter(|a| a != "--set").collect();
    let cfg = Config::load(None, &overrides)?;
    let rows_needed = BatchLayout::new(&cfg.training, 0, 1)?.global_batch();
    let data = kiln_train::data::TrainData::open(&cfg, rows_needed, None)?;
    let s = Session::new(&cfg, data.vocab(&cfg)?)?;
    // The trainer's own step, on the first global batch.
    let step = Step::single(&cfg, &s)?;
    let (b, t) = (step.layout().global_batch(), cfg.training.seq_len);
    let rows: Vec<Vec<u32>> = (0..b)
        .map(|i| data.source.sample(i, t + 1))
        .collect::<Result<_, _>>()?;
    std::fs::write(
        format!("{dir}/params.safetensors"),
        to_safetensors(&s.host_params())?,
    )?;
    std::fs::write(format!("{dir}/tokens.json"), serde_json::to_string(&rows)?)?;
    let g = step.gradients(
        &s,
        data.source.as_ref(),
        At {
            base: 0,
            batch_no: 1,
        },
    )?;
    println!("{{\"loss\": {}, \"grad_norm\": {}}}", g.loss, g.norm);
    Ok(())
}
