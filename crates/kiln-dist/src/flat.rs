//! Long buffers over the ranks in buckets: the bucketed all-reduce of data parallelism
//! ([`BucketedAllReduce`]) and the reduce-scatter and all-gather of sharded data parallelism
//! ([`Sharded`]). A buffer may come as many slices read as their concatenation (a model's
//! gradients, one tensor each): the buckets are cut from the concatenation exactly as from one
//! flat buffer, so the calls (and the bits) do not depend on how it is cut into slices, and
//! no copy of the whole buffer is made.

use crate::collective::Collective;
use std::ops::Range;

/// All-reduce of one long buffer in buckets of a fixed number of elements: bounded message
/// sizes (as PyTorch DDP's 25 MB buckets), and the same calls on every run, which keeps the
/// reduction repeatable.
#[derive(Debug, Clone, Copy)]
pub struct BucketedAllReduce {
    bucket_elems: usize,
}

impl BucketedAllReduce {
    /// Buckets of `bucket_bytes` bytes of f32 (at least one element).
    pub fn new(bucket_bytes: usize) -> Self {
        Self {
            bucket_elems: (bucket_bytes / 4).max(1),
        }
    }

    /// The mean over ranks of `send` (sum, then times 1/size: the same scaling on every
    /// rank and every run), in a new buffer.
    pub fn mean(&self, comm: &dyn Collective, send: &[f32]) -> Vec<f32> {
        let mut out = send.to_vec();
        self.mean_in_place(comm, &mut [&mut out[..]]);
        out
    }

    /// The mean over ranks of the concatenation of `parts`, written back into them, through
    /// two buffers one bucket long (each bucket is copied in, summed by the engine into the
    /// other, and copied back scaled): no buffer as long as the whole to fault in each step.
    pub fn mean_in_place<P: AsMut<[f32]>>(&self, comm: &dyn Collective, parts: &mut [P]) {
        if comm.size() == 1 {
            return;
        }
        let total: usize = parts.iter_mut().map(|p| p.as_mut().len()).sum();
        let cap = self.bucket_elems.min(total);
        let (mut send, mut recv) = (Vec::with_capacity(cap), vec![0.0f32; cap]);
        let inv = 1.0 / comm.size() as f32;
        let mut at = Cursor::default();
        for lo in (0..total).step_by(self.bucket_elems) {
            let len = self.bucket_elems.min(total - lo);
            let start = at;
            send.clear();
            at = at.walk(parts, len, |p| send.extend_from_slice(p));
            let recv = &mut recv[..len];
            comm.all_reduce_sum_f32_into(&send, recv);
            let mut sums = recv.iter();
            start.walk(parts, len, |p| {
                for (v, s) in p.iter_mut().zip(&mut sums) {
                    *v = s * inv;
                }
            });
        }
    }
}

/// A position in a list of slices read as their concatenation.
#[derive(Debug, Clone, Copy, Default)]
struct Cursor {
    part: usize,
    at: usize,
}

impl Cursor {
    /// The position `offset` elements into the concatenation.
    fn seek<P: AsMut<[f32]>>(parts: &mut [P], offset: usize) -> Self {
        Self::default().walk(parts, offset, |_| {})
    }

    /// Visits the next `len` elements (one piece of each slice they span; stops early at the
    /// end of the last slice) and returns the position after them.
    fn walk<P: AsMut<[f32]>>(
        mut self,
        parts: &mut [P],
        mut len: usize,
        mut f: impl FnMut(&mut [f32]),
    ) -> Self {
        while len > 0 && self.part < parts.len() {
            let p = parts[self.part].as_mut();
            let take = (p.len() - self.at).min(len);
            f(&mut p[self.at..self.at + take]);
            (self.at, len) = (self.at + take, len - take);
            if self.at == p.len() {
                (self.part, self.at) = (self.part + 1, 0);
            }
        }
        self
    }
}

/// A flat buffer sharded over the ranks for sharded data parallelism: `len` elements, padded
/// to `size` equal contiguous shards; rank `r` owns `[r * shard, (r + 1) * shard)`. The
/// collectives move one bucket at a time, `bucket / size` elements of every shard per call,
/// so message sizes stay bounded and a run and its resume make the same calls (repeatable).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sharded {
    /// Elements of the (unpadded) buffer.
    pub len: usize,
    /// Elements per shard (the last one padded).
    pub shard: usize,
    /// Elements of every shard that one call moves.
    chunk: usize,
    /// Bytes of the buckets.
    pub(crate) bucket_bytes: usize,
}

impl Sharded {
    /// `len` elements over `ranks` ranks, moved in buckets of `bucket_bytes` bytes of f32.
    pub fn new(len: usize, ranks: usize, bucket_bytes: usize) -> Self {
        let ranks = ranks.max(1);
        let shard = len.div_ceil(ranks);
        Self {
            len,
            shard,
            chunk: (bucket_bytes / 4 / ranks).max(1),
            bucket_bytes,
        }
    }

    /// Bytes of the buckets its collectives move (and of the all-reduce over replicas that
    /// follows a hybrid reduce-scatter).
    pub fn bucket_bytes(&self) -> usize {
        self.bucket_bytes
    }

    /// The range of the flat buffer rank `rank` owns (its padding excluded).
    pub fn range(&self, rank: usize) -> Range<usize> {
        let start = (rank * self.shard).min(self.len);
        start..((rank + 1) * self.shard).min(self.len)
    }

    /// The calls' ranges of a shard, in order.
    fn chunks(&self) -> impl Iterator<Item = Range<usize>> + use<> {
        let (shard, chunk) = (self.shard, self.chunk);
        (0..shard)
            .step_by(chunk)
            .map(move |lo| lo..(lo + chunk).min(shard))
    }

    /// This rank's shard of the mean over ranks of the concatenation of `full` (`len`
    /// elements in all; only read): bucketed reduce-scatter, then times 1/size (the same
    /// scaling on every rank and every run). Padding comes back as zeros past the buffer's
    /// end.
    pub fn reduce_scatter_mean<P: AsMut<[f32]>>(
        &self,
        comm: &dyn Collective,
        full: &mut [P],
    ) -> Vec<f32> {
        let n = comm.size();
        let mut out = vec![0.0f32; self.shard];
        let mut send = Vec::with_capacity(self.chunk * n);
        for c in self.chunks() {
            send.clear();
            for r in 0..n {
                let (a, b) = (r * self.shard + c.start, r * self.shard + c.end);
                let have = b.min(self.len).saturating_sub(a);
                Cursor::seek(full, a).walk(full, have, |p| send.extend_from_slice(p));
                send.resize(send.len() + c.len() - have, 0.0);
            }
            comm.reduce_scatter_sum_f32(&send, &mut out[c]);
        }
        let inv = 1.0 / n as f32;
        for v in out.iter_mut() {
            *v *= inv;
        }
        out
    }

    /// [`Sharded::reduce_scatter_mean`] over `shard`'s ranks, then the mean of that shard over
    /// `replica`'s ranks (those holding the same shard in the other replicas of a hybrid run;
    /// one rank without hybrid sharding), a bucketed all-reduce: this rank's shard of the mean
    /// over every rank of the job.
    pub fn reduce_scatter_mean_hybrid<P: AsMut<[f32]>>(
        &self,
        shard: &dyn Collective,
        replica: &dyn Collective,
        full: &mut [P],
    ) -> Vec<f32> {
        let mut mine = self.reduce_scatter_mean(shard, full);
        BucketedAllReduce::new(self.bucket_bytes).mean_in_place(replica, &mut [&mut mine[..]]);
        mine
    }

    /// The whole buffer from every rank's shard (`mine`, `shard` elements), written into the
    /// concatenation of `full` (`len` elements in all): bucketed all-gather.
    pub fn all_gather_into<P: AsMut<[f32]>>(
        &self,
        comm: &dyn Collective,
        mine: &[f32],
        full: &mut [P],
    ) {
        let n = comm.size();
        let mut recv = vec![0.0f32; self.chunk * n];
        for c in self.chunks() {
            let w = c.len();
            comm.all_gather_f32(&mine[c.clone()], &mut recv[..w * n]);
            for r in 0..n {
                let at = r * self.shard + c.start;
                let have = (at + w).min(self.len).saturating_sub(at);
                let mut got = recv[r * w..r * w + have].iter();
                Cursor::seek(full, at).walk(full, have, |p| {
                    for (v, g) in p.iter_mut().zip(&mut got) {
                        *v = *g;
                    }
                });
            }
        }
    }

    /// The whole buffer (`len` elements) from every rank's shard (`shard` elements each):
    /// bucketed all-gather.
    pub fn all_gather(&self, comm: &dyn Collective, mine: &[f32]) -> Vec<f32> {
        let mut full = vec![0.0f32; self.len];
        self.all_gather_into(comm, mine, &mut [&mut full[..]]);
        full
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::threads::Threads;

    const LENGTHS: [usize; 7] = [0, 5, 1, 0, 13, 7, 2];

    /// Rank `r`'s buffer cut into slices of [`LENGTHS`].
    fn rank_parts(r: usize) -> Vec<Vec<f32>> {
        LENGTHS
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                (0..n)
                    .map(|j| ((r * 31 + i * 7 + j) % 17) as f32 * 0.37 - 2.0)
                    .collect()
            })
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn the_mean_of_slices_is_the_mean_of_their_concatenation_bit_for_bit() {
        for bucket_bytes in [4usize, 12, 20, 1 << 20] {
            let reduce = BucketedAllReduce::new(bucket_bytes);
            let got = Threads::each(3, move |comm| {
                let mut parts = rank_parts(comm.rank());
                let whole = reduce.mean(comm, &parts.concat());
                reduce.mean_in_place(comm, &mut parts);
                (whole, parts.concat())
            });
            let sums: Vec<f32> = (0..28)
                .map(|i| (0..3).map(|r| rank_parts(r).concat()[i]).sum::<f32>() / 3.0)
                .collect();
            for (whole, in_place) in got {
                assert_eq!(bits(&whole), bits(&in_place), "bucket {bucket_bytes} bytes");
                for (a, b) in whole.iter().zip(&sums) {
                    assert!((a - b).abs() < 1e-6, "{a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn sharded_collectives_of_slices_are_those_of_their_concatenation() {
        for (ranks, bucket_bytes) in [(1usize, 8usize), (2, 8), (3, 12), (3, 1 << 20), (4, 4)] {
            let got = Threads::each(ranks, move |comm| {
                let sh = Sharded::new(28, comm.size(), bucket_bytes);
                let mut parts = rank_parts(comm.rank());
                let flat = sh.reduce_scatter_mean(comm, &mut [parts.concat()]);
                let sliced = sh.reduce_scatter_mean(comm, &mut parts);
                let mut back = vec![vec![-1.0f32; 0], vec![-1.0; 20], vec![-1.0; 8]];
                sh.all_gather_into(comm, &sliced, &mut back);
                let whole = sh.all_gather(comm, &flat);
                (flat, sliced, back.concat(), whole)
            });
            let sh = Sharded::new(28, ranks, bucket_bytes);
            let mean: Vec<f32> = (0..28)
                .map(|i| {
                    let sum: f32 = (0..ranks).map(|r| rank_parts(r).concat()[i]).sum();
                    sum * (1.0 / ranks as f32)
                })
                .collect();
            for (r, (flat, sliced, back, whole)) in got.into_iter().enumerate() {
                assert_eq!(bits(&flat), bits(&sliced), "{ranks} ranks, rank {r}");
                let range = sh.range(r);
                assert!(flat[range.len()..].iter().all(|&v| v == 0.0), "padding");
                let want = &mean[range.clone()];
                for (a, b) in flat[..range.len()].iter().zip(want) {
                    assert!((a - b).abs() < 1e-6, "{ranks} ranks, rank {r}: {a} vs {b}");
                }
                assert_eq!(bits(&back), bits(&whole), "{ranks} ranks, rank {r}");
                assert_eq!(whole.len(), 28);
            }
        }
    }

    #[test]
    fn shards_cover_the_buffer_once_whatever_the_rank_count() {
        for len in [0usize, 1, 7, 100, 101] {
            for ranks in 1..=5 {
                let sh = Sharded::new(len, ranks, 12);
                let mut next = 0;
                for r in 0..ranks {
                    let range = sh.range(r);
                    assert_eq!(range.start, next, "len {len} ranks {ranks}");
                    assert!(range.len() <= sh.shard);
                    next = range.end;
                }
                assert_eq!(next, len);
            }
        }
    }
}
