//! [`Every`]: the one spelling of "every N steps" that each component (metrics, snapshots,
//! the frozen and replica checks, eval, checkpoints) uses to decide when it is due. A leaf.

/// Due at every multiple of `N` steps; never when `N` is 0 (the config's "off").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Every(pub u64);

impl Every {
    /// Whether `step` (steps completed) is a multiple of the interval.
    pub fn due(self, step: u64) -> bool {
        self.0 > 0 && step.is_multiple_of(self.0)
    }

    /// Due at the interval, and also at the last step of a run of `total` steps.
    pub fn due_or_last(self, step: u64, total: u64) -> bool {
        self.due(step) || step == total
    }
}

#[cfg(test)]
mod tests {
    use super::Every;

    #[test]
    fn zero_is_off_and_the_last_step_counts() {
        assert!(!Every(0).due(0) && !Every(0).due(10));
        assert!(Every(5).due(0) && Every(5).due(10) && !Every(5).due(7));
        assert!(Every(0).due_or_last(7, 7) && !Every(5).due_or_last(7, 8));
    }
}
