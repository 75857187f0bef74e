//! One training step of the benchmark model, repeated, for profilers (used by
//! bench/train/profile.sh): `kiln train`'s own [`Step`] (forward/backward and global norm,
//! then clipping folded into the optimizer's update), on a fixed random batch, with no run
//! directory, data loader or checkpoint around it, so a sampling profiler sees only the step.
//!
//! Everything runs inside a rayon pool of `--threads` threads (the thread calling the model is
//! a pool thread), so at `--threads 1` every sample's call stack reaches back to the model
//! code that caused it. Prints the wall and CPU time of each phase per step, and the
//! CLOCK_MONOTONIC window of the timed steps (to cut a profile to them).
//!
//! Usage: step_profile [--threads N] [--steps N] [--warmup N] [--set key=value]...
use kiln_train::data::{SampleError, TokenSource};
use kiln_train::optim::Optimizer;
use kiln_train::step::{At, Step};
use kiln_train::{Config, Session};
use rand::{Rng, SeedableRng};
use std::time::Instant;

/// The same random batch for every step (no data loading in the profile).
struct Fixed(Vec<Vec<u32>>);

impl TokenSource for Fixed {
    fn vocab(&self) -> usize {
        0
    }
    fn sample(&self, index: u64, _len: usize) -> Result<Vec<u32>, SampleError> {
        Ok(self.0[index as usize % self.0.len()].clone())
    }
    fn describe(&self) -> String {
        "a fixed random batch".into()
    }
}

fn cpu_s() -> f64 {
    // SAFETY: getrusage only writes the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// CLOCK_MONOTONIC in seconds (the clock `perf record -k mono` stamps samples with).
fn monotonic_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes the struct it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut threads = 1usize;
    let mut steps = 5usize;
    let mut warmup = 2usize;
    let mut overrides = Vec::new();
    let mut outside = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--threads" => threads = value()?.parse()?,
            "--steps" => steps = value()?.parse()?,
            "--warmup" => warmup = value()?.parse()?,
            "--set" => overrides.push(value()?),
            "--outside-pool" => outside = true,
            _ => return Err(format!("unknown argument {a}").into()),
        }
    }
    overrides.push(format!("training.threads={threads}"));
    let cfg = Config::load(None, &overrides)?;
    if outside {
        // As `kiln train` calls the model: from a thread outside the rayon pool.
        kiln_train::model::session::set_threads(threads)?;
        run(&cfg, steps, warmup)?;
        return Ok(());
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?;
    pool.install(|| run(&cfg, steps, warmup).map_err(|e| e.to_string()))?;
    Ok(())
}

fn run(cfg: &Config, steps: usize, warmup: usize) -> Result<(), Box<dyn std::error::Error>> {
    let vocab = cfg.model.vocab_size;
    let mut s = Session::new(cfg, vocab)?;
    let step = Step::single(cfg, &s)?;
    let (b, t) = (step.layout().global_batch(), cfg.training.seq_len);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(cfg.training.seed + 1);
    let batch = Fixed(
        (0..b)
            .map(|_| (0..=t).map(|_| rng.gen_range(0..vocab as u32)).collect())
            .collect(),
    );
    let tokens = b * t as u64;
    let mut opt = Optimizer::new(&cfg.optimizer, s.model.specs(), &s.device, tokens);
    println!("step fwd_bwd_norm_ms optim_ms total_ms cpu_ms loss");
    let mut window = (0.0, 0.0);
    for i in 0..warmup + steps {
        if i == warmup {
            window.0 = monotonic_s();
        }
        let (w0, c0) = (Instant::now(), cpu_s());
        let g = step.gradients(
            &s,
            &batch,
            At {
                base: 0,
                batch_no: 1,
            },
        )?;
        let loss = g.loss;
        let w1 = Instant::now();
        step.apply(&mut s, &mut opt, &batch, g, cfg.optimizer.lr)?;
        // The update is lazy only in name on flex; read one value so it is surely done.
        let _ = s.params[0].clone().slice(0..1).into_scalar::<f32>();
        let w2 = Instant::now();
        let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
        let tag = if i < warmup { "warmup" } else { "step" };
        println!(
            "{tag} {:.1} {:.1} {:.1} {:.1} {loss:.6}",
            ms(w0, w1),
            ms(w1, w2),
            ms(w0, w2),
            (cpu_s() - c0) * 1e3
        );
    }
    window.1 = monotonic_s();
    println!("timed_window {:.6} {:.6}", window.0, window.1);
    Ok(())
}
