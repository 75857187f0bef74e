//! Where a parameter's values live on the mesh ([`Placement`]): its whole (global) shape, the
//! box of it this rank's tensor holds, and the mesh dim that cuts it (tensor parallelism cuts
//! a matrix along one of its dims; every other dim of the mesh replicates it). What reads
//! parameters across ranks reads this: the gradient norm and the guards (each element counted
//! once), the checkpoints (pieces named by their box), the final gather, the memory estimate.
//!
//! The data-parallel ranks that shard the state (`parallelism.shard`) cut this rank's box
//! further, into flat ranges ([`crate::parallel::shard`]).

use super::Dim;
use crate::checkpoint::region::{Region, box_text, for_each_row};
use std::ops::Range;

/// Where one parameter's values live (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The whole tensor's shape.
    pub global: Vec<usize>,
    /// Per dim, the range of the whole tensor this rank's tensor holds.
    pub boxed: Vec<Range<usize>>,
    /// The mesh dim that cuts the tensor and the tensor dim it cuts (`None`: every rank of
    /// the mesh holds it whole).
    pub cut: Option<(Dim, usize)>,
}

impl Placement {
    /// A tensor of `shape` held whole on every rank.
    pub fn whole(shape: &[usize]) -> Self {
        Self {
            global: shape.to_vec(),
            boxed: shape.iter().map(|&n| 0..n).collect(),
            cut: None,
        }
    }

    /// A tensor of `shape` cut along tensor dim `dim` into `parts` equal blocks over mesh dim
    /// `over`, of which this rank holds block `index` (`parts` must divide the dim).
    pub fn cut(shape: &[usize], dim: usize, over: Dim, parts: usize, index: usize) -> Self {
        let mut p = Self::whole(shape);
        if parts > 1 {
            let n = shape[dim] / parts;
            p.boxed[dim] = index * n..(index + 1) * n;
            p.cut = Some((over, dim));
        }
        p
    }

    /// The shape of this rank's tensor.
    pub fn local_shape(&self) -> Vec<usize> {
        self.boxed.iter().map(Range::len).collect()
    }

    /// Whether this rank holds the whole tensor.
    pub fn is_whole(&self) -> bool {
        self.cut.is_none()
    }

    /// This rank's box cut out of the whole tensor's values (row-major, `global` shape).
    pub fn take(&self, whole: &[f32]) -> Vec<f32> {
        if self.is_whole() {
            return whole.to_vec();
        }
        let mut out = Vec::with_capacity(self.local_shape().iter().product());
        for_each_row(&self.global, &self.boxed, |at, len| {
            out.extend_from_slice(&whole[at..at + len]);
        });
        out
    }

    /// Writes this rank's box `local` (row-major, [`Placement::local_shape`]) into the
    /// whole tensor's values `whole`.
    pub fn put(&self, local: &[f32], whole: &mut [f32]) {
        let mut from = 0;
        for_each_row(&self.global, &self.boxed, |at, len| {
            whole[at..at + len].copy_from_slice(&local[from..from + len]);
            from += len;
        });
    }

    /// Where elements `held` of this rank's tensor lie in the whole tensor, as a checkpoint
    /// piece names them: a flat range of a tensor held whole, a range of this rank's box.
    pub fn region(&self, held: Range<usize>) -> Region {
        match self.is_whole() {
            true => Region::flat(held),
            false => Region::boxed(self.boxed.clone(), held),
        }
    }

    /// The box as `a:b,c:d` (one range a dim), the suffix of a checkpoint piece's name.
    pub fn box_name(&self) -> String {
        box_text(&self.boxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boxes_of_every_rank_tile_the_whole_and_come_back() {
        let shape = [4, 6];
        let whole: Vec<f32> = (0..24).map(|i| i as f32).collect();
        for dim in [0, 1] {
            for parts in [1, 2] {
                let mut back = vec![-1.0f32; 24];
                for index in 0..parts {
                    let p = Placement::cut(&shape, dim, Dim::Tp, parts, index);
                    let local = p.take(&whole);
                    assert_eq!(local.len(), 24 / parts);
                    p.put(&local, &mut back);
                }
                assert_eq!(back, whole, "dim {dim}, {parts} parts");
            }
        }
        let col = Placement::cut(&shape, 1, Dim::Tp, 2, 1);
        assert_eq!(col.local_shape(), vec![4, 3]);
        assert_eq!(col.take(&whole)[..4], [3.0, 4.0, 5.0, 9.0]);
        assert_eq!(col.box_name(), "0:4,3:6");
        assert!(Placement::whole(&shape).is_whole() && !col.is_whole());
    }
}
