//! The exchanges tensor, pipeline and expert parallelism make (max all-reduce, all-to-all(v),
//! point-to-point), checked on every engine against one contract: ranks as threads, and real
//! MPI ranks started by `mpirun` (this test binary runs itself as the ranks).

use kiln_dist::{Collective, Threads};

/// Checks one rank's results of the exchanges on a job of 3 ranks (panics on a difference).
fn exchanges(c: &dyn Collective) {
    assert_eq!(c.size(), 3, "the contract is written for 3 ranks");
    let r = c.rank();
    let mut max = [r as f32, -(r as f32)];
    c.all_reduce_max_f32(&mut max);
    assert_eq!(max, [2.0, 0.0]);
    // Block b of rank r holds 10 r + b, twice.
    let send: Vec<f32> = (0..3).flat_map(|b| [(10 * r + b) as f32; 2]).collect();
    let mut even = [0.0f32; 6];
    c.all_to_all_f32(&send, &mut even);
    let want: Vec<f32> = (0..3).flat_map(|s| [(10 * s + r) as f32; 2]).collect();
    assert_eq!(even.to_vec(), want, "all-to-all, rank {r}");
    // Rank r sends b + 1 elements of 10 r + b to rank b, but rank 0 sends rank 1 none (a
    // count of 0 is allowed).
    let send_counts: Vec<usize> = (0..3)
        .map(|b| if r == 0 && b == 1 { 0 } else { b + 1 })
        .collect();
    let sendv: Vec<f32> = (0..3)
        .flat_map(|b| vec![(10 * r + b) as f32; send_counts[b]])
        .collect();
    let recv_counts: Vec<usize> = (0..3)
        .map(|s| if s == 0 && r == 1 { 0 } else { r + 1 })
        .collect();
    let mut uneven = vec![0.0f32; recv_counts.iter().sum()];
    c.all_to_allv_f32(&sendv, &send_counts, &mut uneven, &recv_counts);
    let want: Vec<f32> = (0..3)
        .flat_map(|s| vec![(10 * s + r) as f32; recv_counts[s]])
        .collect();
    assert_eq!(uneven, want, "all-to-allv, rank {r}");
    // A ring: each rank sends to the next and receives from the one before.
    let (next, prev) = ((r + 1) % 3, (r + 2) % 3);
    let mut ring = [0.0f32; 2];
    c.send_recv_f32(next, &[r as f32; 2], prev, &mut ring);
    assert_eq!(ring, [prev as f32; 2], "ring, rank {r}");
    // Rank 0 sends twice to rank 2, which receives in order.
    if r == 0 {
        c.send_f32(2, &[1.0]);
        c.send_f32(2, &[2.0, 3.0]);
    } else if r == 2 {
        let (mut a, mut b) = ([0.0f32], [0.0f32; 2]);
        c.recv_f32(0, &mut a);
        c.recv_f32(0, &mut b);
        assert_eq!((a, b), ([1.0], [2.0, 3.0]));
    }
    c.barrier();
}

#[test]
fn ranks_as_threads_follow_the_contract() {
    Threads::each(3, |c| exchanges(c));
}

#[test]
fn one_rank_exchanges_with_itself() {
    let solo = kiln_dist::Solo;
    let mut got = [0.0f32; 2];
    solo.send_recv_f32(0, &[1.0, 2.0], 0, &mut got);
    assert_eq!(got, [1.0, 2.0]);
    solo.send_f32(0, &[3.0]);
    let mut one = [0.0f32];
    solo.recv_f32(0, &mut one);
    assert_eq!(one, [3.0]);
    let mut all = [0.0f32; 2];
    solo.all_to_all_f32(&[4.0, 5.0], &mut all);
    assert_eq!(all, [4.0, 5.0]);
}

/// Set in the ranks `mpirun` starts from [`mpi_ranks_follow_the_contract`].
#[cfg(feature = "mpi")]
const CHILD: &str = "KILN_DIST_EXCHANGES_RANK";

#[cfg(feature = "mpi")]
#[test]
fn mpi_ranks_follow_the_contract() {
    if std::env::var_os(CHILD).is_some() {
        let mpi = kiln_dist::Mpi::init(false).expect("MPI starts");
        exchanges(&mpi);
        return;
    }
    let exe = std::env::current_exe().expect("this test binary");
    let out = std::process::Command::new("mpirun")
        .args(["--oversubscribe", "-np", "3"])
        .arg(exe)
        .args([
            "--exact",
            "mpi_ranks_follow_the_contract",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .expect("mpirun (openmpi-bin) runs");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert_eq!(text.matches("1 passed").count(), 3, "{text}");
}
