//! The replica check: data-parallel ranks hold the same parameters, so a checksum of each
//! rank's parameters, compared at `guards.replica_check_interval` and before every save,
//! names a silently corrupted or desynced rank before its weights are written.

use crate::cadence::Every;
use crate::tensor::params_checksum;
use burn::tensor::Tensor;
use kiln_dist::Collective;

/// Ranks whose parameters differ from the majority's.
#[derive(Debug, Clone, PartialEq)]
pub struct Mismatch {
    /// The ranks that differ.
    pub ranks: Vec<usize>,
    /// Every rank's checksum, hex.
    pub checksums: Vec<String>,
}

/// The replica-check component: its cadence and the comparison.
pub struct ReplicaCheck {
    every: Every,
}

impl ReplicaCheck {
    /// Checks every `every` steps (0: only before saves).
    pub fn new(every: u64) -> Self {
        Self {
            every: Every(every),
        }
    }

    /// Whether the periodic check is due after `step`.
    pub fn due(&self, step: u64) -> bool {
        self.every.due(step)
    }

    /// Compares every rank's checksum (a collective: every rank calls it at the same step).
    pub fn compare(comm: &dyn Collective, params: &[Tensor<1>]) -> Option<Mismatch> {
        if comm.size() == 1 {
            return None;
        }
        let sums = comm.all_gather_u64(params_checksum(params));
        let ranks = minority_ranks(&sums);
        (!ranks.is_empty()).then(|| Mismatch {
            ranks,
            checksums: sums.iter().map(|s| format!("{s:016x}")).collect(),
        })
    }
}

/// Ranks whose value differs from the most common one (ties broken towards the value of
/// the lowest rank); empty when all agree.
pub fn minority_ranks(values: &[u64]) -> Vec<usize> {
    let majority = values
        .iter()
        .max_by_key(|v| {
            let count = values.iter().filter(|w| w == v).count();
            let first = values.iter().position(|w| w == *v).unwrap_or(0);
            (count, std::cmp::Reverse(first))
        })
        .copied();
    (0..values.len())
        .filter(|&r| Some(values[r]) != majority)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::minority_ranks;

    #[test]
    fn the_minority_is_named() {
        assert!(minority_ranks(&[5, 5, 5]).is_empty());
        assert_eq!(minority_ranks(&[5, 9, 5]), vec![1]);
        assert_eq!(minority_ranks(&[9, 5, 5]), vec![0]);
        // A tie: the value of the lowest rank is taken as the reference.
        assert_eq!(minority_ranks(&[5, 9]), vec![1]);
    }
}
