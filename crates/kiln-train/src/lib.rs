//! The Llama-style model, AdamW, LR schedules, the step loop, exact checkpoint/resume, metrics and in-run guards.
