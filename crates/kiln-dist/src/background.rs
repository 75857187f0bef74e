//! Collectives that run while the caller computes ([`Background`]): a communicator of their
//! own (split from the caller's, the same ranks) driven by a thread of their own, which runs
//! the calls handed to it one at a time, in the order they were handed over. Every rank hands
//! over the same calls in the same order (the MPI rule, per communicator), so the calls match
//! across ranks whatever the caller's own communicator is doing meanwhile; that needs an
//! engine whose communicators may be used from two threads at once
//! ([`Collective::concurrent`]: MPI_THREAD_MULTIPLE).
//!
//! The thread only ever waits on the other ranks' background threads, never on a caller, so a
//! caller blocked in a collective of its own communicator cannot hold another rank's
//! background call up.

use crate::collective::Collective;
use std::sync::mpsc;
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce(&dyn Collective) + Send>;

/// A communicator and the thread that runs its collectives (see the module documentation).
pub struct Background {
    jobs: Option<mpsc::Sender<Job>>,
    /// Hands the communicator back when the thread ends, so that it is freed on the
    /// caller's thread (MPI is finalised by the thread that initialised it).
    thread: Option<JoinHandle<Box<dyn Collective>>>,
}

/// The result of a collective handed to [`Background`], when it is done.
pub struct Pending<T>(mpsc::Receiver<T>);

impl<T> Pending<T> {
    /// Waits for the result.
    ///
    /// # Panics
    /// If the call panicked on the background thread (an engine error; MPI's own errors end
    /// the job before that).
    pub fn wait(self) -> T {
        self.0
            .recv()
            .unwrap_or_else(|_| panic!("a background collective did not finish"))
    }
}

impl Background {
    /// Collectives over the ranks of `comm` in the background: `None` when the engine does
    /// not allow two threads at once ([`Collective::concurrent`]). Every rank of `comm`
    /// calls it (it splits `comm`).
    pub fn new(comm: &dyn Collective) -> Option<Self> {
        if !comm.concurrent() {
            return None;
        }
        let own = comm.split(0, comm.rank());
        let (jobs, queue) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("kiln-collectives".into())
            .spawn(move || {
                for job in queue {
                    job(own.as_ref());
                }
                own
            })
            .ok()?;
        Some(Self {
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }

    /// Starts `call` on the background communicator after the calls handed over before it.
    pub fn start<T: Send + 'static>(
        &self,
        call: impl FnOnce(&dyn Collective) -> T + Send + 'static,
    ) -> Pending<T> {
        let (tx, rx) = mpsc::channel();
        let job: Job = Box::new(move |comm| {
            // The receiver may be gone (a result nobody waits for); the call still ran on
            // every rank, which is what keeps the ranks' calls matched.
            let _ = tx.send(call(comm));
        });
        if let Some(jobs) = &self.jobs {
            // Fails only when the thread has ended, which `Pending::wait` then reports.
            let _ = jobs.send(job);
        }
        Pending(rx)
    }
}

impl Drop for Background {
    /// Lets the thread finish the calls handed to it, then frees the communicator here.
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            drop(thread.join());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::solo::Solo;
    use crate::threads::Threads;

    /// Three ranks gather in the background while their own communicator all-reduces: the
    /// results are those of the same calls made in the foreground, in order.
    #[test]
    fn background_calls_run_in_order_beside_the_callers_own() {
        let handles: Vec<_> = Threads::job(3)
            .into_iter()
            .map(|comm| {
                std::thread::spawn(move || {
                    let bg = Background::new(&comm).expect("threads are concurrent");
                    let r = comm.rank() as f32;
                    let pending: Vec<Pending<Vec<f32>>> = (0..4)
                        .map(|i| {
                            bg.start(move |c| {
                                let mut out = vec![0.0; 3];
                                c.all_gather_f32(&[r + 10.0 * i as f32], &mut out);
                                out
                            })
                        })
                        .collect();
                    let mut sum = [r];
                    comm.all_reduce_sum_f32(&mut sum);
                    let got: Vec<Vec<f32>> = pending.into_iter().map(Pending::wait).collect();
                    (sum[0], got)
                })
            })
            .collect();
        for h in handles {
            let (sum, got) = h.join().unwrap();
            assert_eq!(sum, 3.0);
            for (i, g) in got.iter().enumerate() {
                let base = 10.0 * i as f32;
                assert_eq!(g, &[base, base + 1.0, base + 2.0]);
            }
        }
    }

    #[test]
    fn an_engine_without_concurrent_calls_has_no_background() {
        struct Funneled;
        impl Collective for Funneled {
            fn rank(&self) -> usize {
                0
            }
            fn size(&self) -> usize {
                1
            }
            fn describe(&self) -> String {
                "funneled".into()
            }
            fn all_reduce_sum_f32(&self, _: &mut [f32]) {}
            fn all_reduce_sum_f64(&self, _: &mut [f64]) {}
            fn all_reduce_max_u64(&self, _: &mut [u64]) {}
            fn all_reduce_max_f32(&self, _: &mut [f32]) {}
            fn all_to_allv_f32(&self, s: &[f32], _: &[usize], r: &mut [f32], _: &[usize]) {
                r.copy_from_slice(s);
            }
            fn send_recv_f32(&self, _: usize, s: &[f32], _: usize, r: &mut [f32]) {
                r.copy_from_slice(s);
            }
            fn send_f32(&self, _: usize, _: &[f32]) {}
            fn recv_f32(&self, _: usize, _: &mut [f32]) {}
            fn reduce_scatter_sum_f32(&self, s: &[f32], r: &mut [f32]) {
                r.copy_from_slice(s);
            }
            fn all_gather_f32(&self, s: &[f32], r: &mut [f32]) {
                r.copy_from_slice(s);
            }
            fn all_gather_u64(&self, v: u64) -> Vec<u64> {
                vec![v]
            }
            fn broadcast_bytes(&self, _: usize, _: &mut [u8]) {}
            fn barrier(&self) {}
            fn abort(&self, code: i32) -> ! {
                std::process::exit(code)
            }
            fn split(&self, _: usize, _: usize) -> Box<dyn Collective> {
                Box::new(Funneled)
            }
        }
        assert!(Background::new(&Funneled).is_none());
        let solo = Background::new(&Solo).expect("one rank makes no concurrent calls");
        assert_eq!(solo.start(|c| c.size()).wait(), 1);
    }
}
