//! Ranks as threads of one process ([`Threads`]): the collectives of a job without an engine,
//! for tests of code that shards over ranks (several ranks' logic in one `cargo test`, no MPI
//! launcher). Sums add the ranks' values in rank order, so results are repeatable.
//!
//! Written here rather than taken from a crate: the collectives are a few lines each on top of
//! one exchange through a mutex and a barrier, and they must follow kiln's [`Collective`]
//! contract exactly.

use crate::collective::Collective;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Barrier, Condvar, Mutex};

/// One rank of a job whose ranks are threads (see the module documentation).
#[derive(Clone)]
pub struct Threads {
    rank: usize,
    size: usize,
    shared: Arc<Shared>,
}

/// Messages sent and not yet received, by (sender, receiver), oldest first.
type Mailboxes = HashMap<(usize, usize), VecDeque<Vec<f32>>>;

struct Shared {
    slots: Mutex<Vec<Vec<u8>>>,
    /// Point-to-point messages not received yet, by (from, to), in the order sent.
    mail: Mutex<Mailboxes>,
    /// Signalled whenever a message is posted.
    posted: Condvar,
    /// Where the first rank of each group a split makes leaves the group's exchange for
    /// the others (indexed by that rank).
    splits: Mutex<Vec<Option<Arc<Shared>>>>,
    barrier: Barrier,
}

impl Shared {
    fn new(size: usize) -> Arc<Self> {
        Arc::new(Shared {
            slots: Mutex::new(vec![Vec::new(); size]),
            mail: Mutex::new(HashMap::new()),
            posted: Condvar::new(),
            splits: Mutex::new(vec![None; size]),
            barrier: Barrier::new(size),
        })
    }
}

/// The value behind `m`, whether or not another thread panicked holding it.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Threads {
    /// The `size` ranks of one job, to be moved to one thread each. Every rank must make the
    /// same collective calls in the same order, as under MPI, or the job deadlocks.
    pub fn job(size: usize) -> Vec<Threads> {
        let size = size.max(1);
        let shared = Shared::new(size);
        (0..size)
            .map(|rank| Threads {
                rank,
                size,
                shared: Arc::clone(&shared),
            })
            .collect()
    }

    /// `f` run by each rank of a job of `size` thread ranks, on a thread of its own; the
    /// results in rank order (what tests of code that shards over ranks do).
    pub fn each<T: Send>(size: usize, f: impl Fn(&Threads) -> T + Sync) -> Vec<T> {
        std::thread::scope(|s| {
            let handles: Vec<_> = Threads::job(size)
                .into_iter()
                .map(|c| {
                    let f = &f;
                    s.spawn(move || f(&c))
                })
                .collect();
            (handles.into_iter())
                .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        })
    }

    /// Every rank's `mine`, in rank order.
    fn exchange(&self, mine: Vec<u8>) -> Vec<Vec<u8>> {
        lock(&self.shared.slots)[self.rank] = mine;
        self.shared.barrier.wait();
        let all = lock(&self.shared.slots).clone();
        // Nobody writes the next call's values before everyone has read these.
        self.shared.barrier.wait();
        all
    }

    /// Every rank's `values`, in rank order.
    fn gather<T: bytemuck::Pod>(&self, values: &[T]) -> Vec<Vec<T>> {
        self.exchange(bytemuck::cast_slice(values).to_vec())
            .iter()
            .map(|b| {
                b.chunks_exact(size_of::<T>())
                    .map(bytemuck::pod_read_unaligned)
                    .collect()
            })
            .collect()
    }

    /// Posts `buf` for rank `to`.
    fn post(&self, to: usize, buf: &[f32]) {
        let mut mail = lock(&self.shared.mail);
        let queue = mail.entry((self.rank, to)).or_default();
        queue.push_back(buf.to_vec());
        self.shared.posted.notify_all();
    }

    /// The oldest message from rank `from` to this rank, waiting for it.
    fn take(&self, from: usize) -> Vec<f32> {
        let mut mail = lock(&self.shared.mail);
        loop {
            if let Some(m) = mail
                .get_mut(&(from, self.rank))
                .and_then(VecDeque::pop_front)
            {
                return m;
            }
            mail =
                (self.shared.posted.wait(mail)).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    /// Element-wise sum in rank order.
    fn sum<T: bytemuck::Pod + std::ops::Add<Output = T>>(&self, buf: &mut [T]) {
        let all = self.gather(buf);
        for (i, v) in buf.iter_mut().enumerate() {
            *v = all[0][i];
            for other in &all[1..] {
                *v = *v + other[i];
            }
        }
    }
}

impl Collective for Threads {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn describe(&self) -> String {
        format!("threads ({} ranks in one process)", self.size)
    }
    fn all_reduce_sum_f32(&self, buf: &mut [f32]) {
        self.sum(buf);
    }
    fn all_reduce_sum_f64(&self, buf: &mut [f64]) {
        self.sum(buf);
    }
    fn all_reduce_max_u64(&self, buf: &mut [u64]) {
        let all = self.gather(buf);
        for (i, v) in buf.iter_mut().enumerate() {
            *v = all.iter().map(|r| r[i]).max().unwrap_or(*v);
        }
    }
    fn all_reduce_max_f32(&self, buf: &mut [f32]) {
        let all = self.gather(buf);
        for (i, v) in buf.iter_mut().enumerate() {
            *v = all.iter().map(|r| r[i]).fold(f32::NEG_INFINITY, f32::max);
        }
    }
    fn reduce_scatter_sum_f32(&self, send: &[f32], recv: &mut [f32]) {
        let mut all = send.to_vec();
        self.sum(&mut all);
        let n = recv.len();
        recv.copy_from_slice(&all[self.rank * n..(self.rank + 1) * n]);
    }
    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32]) {
        let all = self.gather(send);
        for (r, part) in all.iter().enumerate() {
            recv[r * send.len()..(r + 1) * send.len()].copy_from_slice(part);
        }
    }
    fn all_gather_u64(&self, value: u64) -> Vec<u64> {
        self.gather(&[value]).into_iter().flatten().collect()
    }
    fn all_to_allv_f32(
        &self,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &[usize],
    ) {
        let counts: Vec<u64> = send_counts.iter().map(|&c| c as u64).collect();
        let all_counts = self.gather(&counts);
        let all = self.gather(send);
        let mut at = 0;
        for (r, want) in recv_counts.iter().enumerate() {
            let from: usize = all_counts[r][..self.rank].iter().sum::<u64>() as usize;
            recv[at..at + want].copy_from_slice(&all[r][from..from + want]);
            at += want;
        }
    }
    fn send_recv_f32(&self, to: usize, send: &[f32], from: usize, recv: &mut [f32]) {
        self.post(to, send);
        recv.copy_from_slice(&self.take(from));
    }
    fn send_f32(&self, to: usize, buf: &[f32]) {
        self.post(to, buf);
    }
    fn recv_f32(&self, from: usize, buf: &mut [f32]) {
        buf.copy_from_slice(&self.take(from));
    }
    fn broadcast_bytes(&self, root: usize, buf: &mut [u8]) {
        let all = self.exchange(buf.to_vec());
        buf.copy_from_slice(&all[root]);
    }
    fn barrier(&self) {
        self.exchange(Vec::new());
    }
    fn abort(&self, code: i32) -> ! {
        std::process::exit(code)
    }
    fn split(&self, color: usize, key: usize) -> Box<dyn Collective> {
        let all: Vec<[u64; 2]> = self
            .gather(&[color as u64, key as u64])
            .into_iter()
            .map(|v| [v[0], v[1]])
            .collect();
        // This rank's group, in (key, rank) order, as MPI_Comm_split orders it.
        let mut group: Vec<usize> = (0..self.size)
            .filter(|&r| all[r][0] == color as u64)
            .collect();
        group.sort_by_key(|&r| (all[r][1], r));
        let first = group.iter().copied().min().unwrap_or(self.rank);
        if first == self.rank {
            lock(&self.shared.splits)[first] = Some(Shared::new(group.len()));
        }
        self.shared.barrier.wait();
        let shared = lock(&self.shared.splits)[first].clone();
        // Nobody leaves a new group before every member has taken it.
        self.shared.barrier.wait();
        Box::new(Threads {
            rank: group.iter().position(|&r| r == self.rank).unwrap_or(0),
            size: group.len(),
            shared: shared.unwrap_or_else(|| Shared::new(1)),
        })
    }
    fn concurrent(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flat::Sharded;

    #[test]
    fn the_collectives_follow_the_contract() {
        let out = Threads::each(3, |c| {
            let r = c.rank() as f32;
            let mut sum = [r, 1.0];
            c.all_reduce_sum_f32(&mut sum);
            let mut max = [c.rank() as u64 * 2];
            c.all_reduce_max_u64(&mut max);
            let mut gathered = [0.0f32; 6];
            c.all_gather_f32(&[r, -r], &mut gathered);
            let mut mine = [0.0f32; 2];
            c.reduce_scatter_sum_f32(&[1.0, 2.0, 3.0, 4.0, 5.0, r], &mut mine);
            let mut b = [c.rank() as u8; 2];
            c.broadcast_bytes(2, &mut b);
            c.barrier();
            (
                sum,
                max,
                gathered,
                mine,
                b,
                c.all_gather_u64(c.rank() as u64 + 10),
            )
        });
        for (rank, (sum, max, gathered, mine, b, ids)) in out.into_iter().enumerate() {
            assert_eq!(sum, [3.0, 3.0]);
            assert_eq!(max, [4]);
            assert_eq!(gathered, [0.0, 0.0, 1.0, -1.0, 2.0, -2.0]);
            let want = [[3.0, 6.0], [9.0, 12.0], [15.0, 3.0]][rank];
            assert_eq!(mine, want, "rank {rank}");
            assert_eq!(b, [2, 2]);
            assert_eq!(ids, [10, 11, 12]);
        }
    }

    #[test]
    fn sharded_gather_and_reduce_scatter_round_trip_over_three_ranks() {
        let full: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let out = Threads::each(3, |c| {
            let sh = Sharded::new(full.len(), 3, 8);
            let mut mine = full[sh.range(c.rank())].to_vec();
            mine.resize(sh.shard, 0.0);
            let back = sh.all_gather(c, &mine);
            let mean = sh.reduce_scatter_mean(c, &mut [full.clone()]);
            (back, mean, sh.range(c.rank()))
        });
        for (back, mean, range) in out {
            assert_eq!(back, full);
            assert_eq!(&mean[..range.len()], &full[range]);
        }
    }
}
