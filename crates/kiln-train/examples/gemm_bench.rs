fn cpu_s() -> f64 {
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(u.ru_utime) + tv(u.ru_stime)
}
fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(1);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| {
        for (m, k, n, ta, tb) in [
            (2048usize, 384usize, 1024usize, false, false),
            (2048, 1024, 384, false, false),
            (2048, 384, 384, false, false),
            (2048, 384, 8192, false, false),
            (384, 2048, 8192, true, false),
            (2048, 8192, 384, false, true),
            (384, 2048, 1024, true, false),
            (2048, 1024, 384, false, true),
        ] {
            let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.1).collect();
            let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 * 0.1).collect();
            let mut c = vec![0.0f32; m * n];
            let par = if threads > 1 {
                gemm::Parallelism::Rayon(0)
            } else {
                gemm::Parallelism::None
            };
            // a: [m,k] row-major unless ta (stored [k,m]); b: [k,n] unless tb (stored [n,k])
            let (a_cs, a_rs) = if ta { (m as isize, 1) } else { (1, k as isize) };
            let (b_cs, b_rs) = if tb { (k as isize, 1) } else { (1, n as isize) };
            let mut best = 1e9f64;
            let mut bestw = 1e9f64;
            for _ in 0..5 {
                let c0 = cpu_s();
                let w0 = std::time::Instant::now();
                unsafe {
                    gemm::gemm(
                        m,
                        n,
                        k,
                        c.as_mut_ptr(),
                        1,
                        n as isize,
                        false,
                        a.as_ptr(),
                        a_cs,
                        a_rs,
                        b.as_ptr(),
                        b_cs,
                        b_rs,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        par,
                    );
                }
                best = best.min(cpu_s() - c0);
                bestw = bestw.min(w0.elapsed().as_secs_f64());
            }
            println!(
                "{m} {k} {n} ta={ta} tb={tb}: {:.1} ms cpu {:.1} ms wall, {:.1} GFLOP/s (cpu)",
                best * 1e3,
                bestw * 1e3,
                2.0 * (m * k * n) as f64 / best / 1e9
            );
        }
    });
}
