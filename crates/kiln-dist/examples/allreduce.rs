//! Raw MPI all-reduce timing, the yardstick for the trainer's gradient all-reduce: sums
//! `--floats N` f32 (default: the reference model's 11.3M parameters) in buckets of
//! `--bucket-mb M` (default 25, the trainer's default) over the ranks, `--reps R` times, and
//! prints the median milliseconds per all-reduce on rank 0.
//!
//! `mpirun -np 2 target/release/examples/allreduce` (build with `--features mpi`).

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(default)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let floats = arg("--floats", 11_282_816);
    let bucket_mb = arg("--bucket-mb", 25);
    let reps = arg("--reps", 20).max(1);
    let comm = kiln_dist::Mpi::init(false)?;
    let comm: &dyn kiln_dist::Collective = &comm;
    let buckets = kiln_dist::BucketedAllReduce::new(bucket_mb << 20);
    let mut buf: Vec<f32> = (0..floats).map(|i| (i % 1000) as f32 * 1e-3).collect();
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps + 2 {
        comm.barrier();
        let t0 = std::time::Instant::now();
        // The trainer's path: the mean written back into the buffer, bucket by bucket.
        buckets.mean_in_place(comm, &mut [&mut buf[..]]);
        std::hint::black_box(&buf);
        times.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    let mut timed = times[2..].to_vec();
    timed.sort_by(f64::total_cmp);
    if comm.rank() == 0 {
        println!(
            "ranks={} floats={floats} bytes={} bucket_mb={bucket_mb} median_ms={:.2} min_ms={:.2} engine={}",
            comm.size(),
            floats * 4,
            timed[timed.len() / 2],
            timed[0],
            comm.describe()
        );
    }
    Ok(())
}
