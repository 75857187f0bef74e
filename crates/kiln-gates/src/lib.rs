//! Correctness gates: the bit-exact smoke gate, the LR finder, eval, and run reports (status, plots).
