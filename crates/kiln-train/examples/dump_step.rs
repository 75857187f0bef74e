//! Parity helper (used by bench/train/parity.py): writes a fresh model's weights and one
//! batch to DIR, and prints the loss and the global gradient norm kiln computes for them,
//! so a PyTorch implementation of the same model can be checked against kiln.
use burn::tensor::Tensor;
use kiln_train::checkpoint::to_safetensors;
use kiln_train::{Config, Session};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args()
        .nth(1)
        .ok_or("usage: dump_step DIR [--set k=v]...")?;
    let overrides: Vec<String> = std::env::args().skip(2).filter(|a| a != "--set").collect();
    let cfg = Config::load(None, &overrides)?;
    let (b, t) = (cfg.training.batch_size, cfg.training.seq_len);
    let data = kiln_train::data::TrainData::open(&cfg, b as u64, None)?;
    let s = Session::new(&cfg, data.vocab(&cfg)?)?;
    let rows: Vec<Vec<u32>> = (0..b as u64)
        .map(|i| data.source.sample(i, t + 1))
        .collect::<Result<_, _>>()?;
    std::fs::write(
        format!("{dir}/params.safetensors"),
        to_safetensors(&s.host_params())?,
    )?;
    std::fs::write(format!("{dir}/tokens.json"), serde_json::to_string(&rows)?)?;
    let ad = s.device.clone().autodiff();
    let inputs = Session::int_tensor(&rows, t, &ad);
    let shifted: Vec<Vec<u32>> = rows.iter().map(|r| r[1..].to_vec()).collect();
    let targets = Session::int_tensor(&shifted, t, &ad);
    let leaves: Vec<Tensor<1>> = s
        .params
        .iter()
        .map(|p| p.clone().autodiff().require_grad())
        .collect();
    let loss = s.model.loss(&leaves, inputs, targets);
    let lv = loss.clone().into_scalar::<f32>();
    let g = loss.backward();
    let grads: Vec<Tensor<1>> = leaves.iter().map(|l| l.grad(&g).expect("grad")).collect();
    let norm = kiln_train::optim::global_norm(&grads);
    println!("{{\"loss\": {lv}, \"grad_norm\": {norm}}}");
    Ok(())
}
