//! Whole matrices in a sharded run: each rank keeps a range of every parameter, and an
//! update that needs a matrix whole (Muon's Newton-Schulz) gets it from one owner rank per
//! matrix, as Moonlight's distributed Muon does. The owners are spread over the ranks by
//! cost; each rank's pieces go to the owners in one all-to-all, every owner computes its
//! matrices (in parallel with the other owners), and the results' pieces come back in a
//! second all-to-all. A matrix's bytes travel twice, a gather and a scatter: what a
//! replicated run's optimizer never sends, but the same for every matrix as the all-gather
//! of the updated parameters that a sharded step does anyway.
//!
//! The owner computes `f` on exactly the whole the replicated run would (the pieces tile it,
//! and the element-wise steps before it give the same bits on any range): the result is the
//! replicated run's, bit for bit.
//!
//! A replicated run ([`Spread`]) shares the work the same way: every rank holds every whole
//! matrix, each computes only the matrices it owns and broadcasts the results, so that N
//! data-parallel ranks each orthogonalise about 1/N of the model instead of all of it (the
//! same bits as every rank computing everything).

use crate::tensor::{from_vec, into_vec};
use burn::tensor::{Device, Tensor};
use kiln_dist::Collective;
use std::ops::Range;

/// The owner of each matrix `which[k]` of cost `costs[k]`: the largest first, each to the
/// rank with the least cost so far (the lowest such rank on a tie), so that every rank
/// computes about as much. Deterministic: every rank computes the same owners.
pub fn owners(costs: &[f64], ranks: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..costs.len()).collect();
    order.sort_by(|&a, &b| costs[b].total_cmp(&costs[a]).then(a.cmp(&b)));
    let mut load = vec![0.0f64; ranks.max(1)];
    let mut owner = vec![0; costs.len()];
    for k in order {
        let least = (0..load.len())
            .min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b)))
            .unwrap_or(0);
        load[least] += costs[k];
        owner[k] = least;
    }
    owner
}

/// The Newton-Schulz cost of a matrix of `shape` (its iteration's matrix products): rows x
/// cols x the smaller of the two.
pub fn cost(shape: &[usize]) -> f64 {
    let (r, c) = (
        shape.first().copied().unwrap_or(1),
        shape.get(1).copied().unwrap_or(1),
    );
    r as f64 * c as f64 * r.min(c) as f64
}

/// Where the pieces of each parameter lie: `ranges[r][i]`, rank `r`'s elements of parameter
/// `i` (empty where it has none), and the cost of each.
pub struct Pieces<'a> {
    /// Per rank of the group, per parameter.
    pub ranges: &'a [Vec<Range<usize>>],
    /// Per parameter, [`cost`].
    pub costs: &'a [f64],
}

/// [`crate::optim::Wholes::map_whole`] over the ranks of `group` (this rank is
/// `group.rank()`), whose pieces lie as `at` says; results built on `device`.
pub fn map_whole(
    group: &dyn Collective,
    at: &Pieces,
    pieces: Vec<Option<Vec<Tensor<1>>>>,
    f: &dyn Fn(usize, Vec<Tensor<1>>) -> Tensor<1>,
    device: &Device,
) -> Vec<Option<Tensor<1>>> {
    let (me, n) = (group.rank(), group.size());
    let which: Vec<usize> = (0..pieces.len()).filter(|&i| pieces[i].is_some()).collect();
    // Tensors per parameter (the same on every rank).
    let inputs: Vec<usize> = pieces
        .iter()
        .map(|p| p.as_ref().map_or(0, Vec::len))
        .collect();
    let costs: Vec<f64> = which.iter().map(|&i| at.costs[i]).collect();
    let owner_of = owners(&costs, n);
    // Matrices by owner, each list in parameter order.
    let owned_by = |r: usize| -> Vec<usize> {
        (which.iter().zip(&owner_of))
            .filter(|(_, o)| **o == r)
            .map(|(&i, _)| i)
            .collect()
    };
    let by_owner: Vec<Vec<usize>> = (0..n).map(owned_by).collect();
    let len = |r: usize, i: usize| at.ranges[r][i].len();

    // 1. Every rank's pieces to their matrices' owners (each matrix's tensors in turn).
    let mut mine: Vec<Option<Vec<Tensor<1>>>> = pieces;
    let mut send = Vec::new();
    let mut send_counts = vec![0; n];
    for (d, list) in by_owner.iter().enumerate() {
        for &i in list {
            for piece in mine[i].take().unwrap_or_default() {
                let piece = into_vec(piece);
                send_counts[d] += piece.len();
                send.extend(piece);
            }
        }
    }
    let recv_counts: Vec<usize> = (0..n)
        .map(|s| by_owner[me].iter().map(|&i| inputs[i] * len(s, i)).sum())
        .collect();
    let mut recv = vec![0.0f32; recv_counts.iter().sum()];
    group.all_to_allv_f32(&send, &send_counts, &mut recv, &recv_counts);

    // 2. The owner's matrices, whole, through `f`.
    let mut from = source_offsets(&recv_counts);
    let results: Vec<Vec<f32>> = (by_owner[me].iter())
        .map(|&i| {
            let total: usize = (0..n).map(|r| len(r, i)).sum();
            let mut wholes = vec![vec![0.0f32; total]; inputs[i]];
            for (s, at_s) in from.iter_mut().enumerate() {
                let r = at.ranges[s][i].clone();
                for whole in wholes.iter_mut() {
                    whole[r.clone()].copy_from_slice(&recv[*at_s..*at_s + r.len()]);
                    *at_s += r.len();
                }
            }
            let wholes = wholes.into_iter().map(|w| from_vec(w, device)).collect();
            into_vec(f(i, wholes))
        })
        .collect();

    // 3. Each rank's pieces of the results back to it.
    let mut send = Vec::new();
    let mut send_counts = vec![0; n];
    for (d, count) in send_counts.iter_mut().enumerate() {
        for (&i, result) in by_owner[me].iter().zip(&results) {
            let r = at.ranges[d][i].clone();
            *count += r.len();
            send.extend_from_slice(&result[r]);
        }
    }
    let recv_counts: Vec<usize> = (0..n)
        .map(|s| by_owner[s].iter().map(|&i| len(me, i)).sum())
        .collect();
    let mut recv = vec![0.0f32; recv_counts.iter().sum()];
    group.all_to_allv_f32(&send, &send_counts, &mut recv, &recv_counts);
    let mut out: Vec<Option<Tensor<1>>> = vec![None; mine.len()];
    let mut from = source_offsets(&recv_counts);
    for (s, list) in by_owner.iter().enumerate() {
        for &i in list {
            let k = len(me, i);
            let piece = recv[from[s]..from[s] + k].to_vec();
            from[s] += k;
            out[i] = Some(from_vec(piece, device));
        }
    }
    out
}

/// [`crate::optim::Wholes`] of a replicated run over the data-parallel ranks `group`: each
/// rank computes the matrices it owns (by [`owners`] of their `costs`, one per parameter) and
/// broadcasts the results; every rank ends with every result.
pub struct Spread<'a> {
    /// The data-parallel ranks.
    pub group: &'a dyn Collective,
    /// Per parameter, [`cost`].
    pub costs: &'a [f64],
}

impl crate::optim::Wholes for Spread<'_> {
    fn map_whole(
        &self,
        pieces: Vec<Option<Vec<Tensor<1>>>>,
        f: &dyn Fn(usize, Vec<Tensor<1>>) -> Tensor<1>,
    ) -> Vec<Option<Tensor<1>>> {
        let (me, n) = (self.group.rank(), self.group.size());
        if n == 1 {
            return crate::optim::Unsharded.map_whole(pieces, f);
        }
        let which: Vec<usize> = (0..pieces.len()).filter(|&i| pieces[i].is_some()).collect();
        let costs: Vec<f64> = which.iter().map(|&i| self.costs[i]).collect();
        let owner_of = owners(&costs, n);
        // Each rank's matrices, in parameter order: this rank's computed first (all of them,
        // while the others compute theirs), then every rank's broadcast in turn.
        let owned_by = |r: usize| -> Vec<usize> {
            (which.iter().zip(&owner_of))
                .filter(|(_, o)| **o == r)
                .map(|(&i, _)| i)
                .collect()
        };
        let first = |p: &Option<Vec<Tensor<1>>>| p.as_ref().and_then(|v| v.first().cloned());
        let lengths: Vec<usize> = (pieces.iter())
            .map(|p| first(p).map_or(0, |t| t.dims()[0]))
            .collect();
        let device = pieces.iter().find_map(first).map(|t| t.device());
        let mut pieces = pieces;
        let mut mine: Vec<f32> = (owned_by(me).into_iter())
            .filter_map(|i| Some(into_vec(f(i, pieces[i].take()?))))
            .flatten()
            .collect();
        let mut out: Vec<Option<Tensor<1>>> = vec![None; pieces.len()];
        let Some(device) = device else {
            return out;
        };
        for r in 0..n {
            let list = owned_by(r);
            let mut buf = match r == me {
                true => std::mem::take(&mut mine),
                false => vec![0.0f32; list.iter().map(|&i| lengths[i]).sum()],
            };
            self.group
                .broadcast_bytes(r, bytemuck::cast_slice_mut(&mut buf));
            let mut at = 0;
            for i in list {
                out[i] = Some(from_vec(buf[at..at + lengths[i]].to_vec(), &device));
                at += lengths[i];
            }
        }
        out
    }
}

/// Where each source rank's block starts in a buffer of blocks of `counts`.
fn source_offsets(counts: &[usize]) -> Vec<usize> {
    let mut at = 0;
    counts
        .iter()
        .map(|c| {
            at += c;
            at - c
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_dist::Threads;

    /// Every rank of a replicated run ends with `f` of every whole, each computed once.
    #[test]
    fn a_replicated_run_computes_each_whole_once_and_every_rank_gets_all() {
        use crate::optim::Wholes;
        let device = Device::flex();
        let sizes = [6usize, 3, 8];
        let got = Threads::each(2, |comm| {
            let calls = std::sync::atomic::AtomicUsize::new(0);
            let spread = Spread {
                group: comm,
                costs: &[6.0, 3.0, 8.0],
            };
            let pieces = (0..3)
                .map(|i| Some(vec![from_vec(vec![i as f32; sizes[i]], &device)]))
                .collect();
            let f = |i: usize, mut t: Vec<Tensor<1>>| {
                calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                t.remove(0).add_scalar(10.0 * i as f64)
            };
            let out = spread.map_whole(pieces, &f);
            let out: Vec<Vec<f32>> = out.into_iter().map(|t| into_vec(t.unwrap())).collect();
            (out, calls.into_inner())
        });
        let expect: Vec<Vec<f32>> = (0..3).map(|i| vec![11.0 * i as f32; sizes[i]]).collect();
        for (r, (out, _)) in got.iter().enumerate() {
            assert_eq!(out, &expect, "rank {r}");
        }
        assert_eq!(
            got.iter().map(|(_, c)| c).sum::<usize>(),
            3,
            "each whole once"
        );
    }

    #[test]
    fn owners_spread_the_cost_largest_first() {
        assert_eq!(owners(&[1.0, 8.0, 4.0, 4.0], 2), [0, 0, 1, 1]);
        assert_eq!(owners(&[1.0, 1.0, 1.0], 3), [0, 1, 2]);
        assert_eq!(owners(&[5.0], 4), [0]);
        assert!(owners(&[], 2).is_empty());
    }

    /// Three ranks holding ranges of four parameters (one rank holds none of one, one
    /// parameter is not asked for) get back exactly their ranges of `f` of each whole: here
    /// `f` reverses the whole and adds its index, so that a piece put in the wrong place or
    /// sent to the wrong rank shows.
    #[test]
    fn every_rank_gets_its_pieces_of_f_of_each_whole() {
        let device = Device::flex();
        let sizes = [7usize, 12, 5, 9];
        // Rank r's range of parameter i: cuts of each parameter (rank 2 holds none of 2).
        let cuts: [[usize; 4]; 4] = [[0, 3, 5, 7], [0, 4, 8, 12], [0, 2, 5, 5], [0, 0, 9, 9]];
        let ranges: Vec<Vec<Range<usize>>> = (0..3)
            .map(|r| (0..4).map(|i| cuts[i][r]..cuts[i][r + 1]).collect())
            .collect();
        let costs: Vec<f64> = sizes.iter().map(|&s| s as f64).collect();
        let whole =
            |i: usize| -> Vec<f32> { (0..sizes[i]).map(|e| (i * 100 + e) as f32).collect() };
        // Two tensors per matrix, the whole and its double: f reverses their difference.
        let f = |i: usize, mut t: Vec<Tensor<1>>| {
            let (a, b) = (t.remove(0), t.remove(0));
            let mut v = into_vec(b - a);
            v.reverse();
            from_vec(
                v.into_iter().map(|x| x + i as f32).collect(),
                &Device::flex(),
            )
        };
        let got = Threads::each(3, |comm| {
            let r = comm.rank();
            let piece = |i: usize| from_vec(whole(i)[ranges[r][i].clone()].to_vec(), &device);
            let pieces: Vec<Option<Vec<Tensor<1>>>> = (0..4)
                .map(|i| (i != 1).then(|| vec![piece(i), piece(i).mul_scalar(2.0)]))
                .collect();
            let at = Pieces {
                ranges: &ranges,
                costs: &costs,
            };
            let out = map_whole(comm, &at, pieces, &f, &device);
            out.into_iter().map(|t| t.map(into_vec)).collect::<Vec<_>>()
        });
        for (r, out) in got.iter().enumerate() {
            for i in 0..4 {
                if i == 1 {
                    assert!(out[i].is_none());
                    continue;
                }
                let mut expect = whole(i);
                expect.reverse();
                let expect: Vec<f32> = expect.into_iter().map(|x| x + i as f32).collect();
                assert_eq!(
                    out[i].as_deref(),
                    Some(&expect[ranges[r][i].clone()]),
                    "rank {r}, {i}"
                );
            }
        }
    }
}
