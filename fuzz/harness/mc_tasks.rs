//! Fuzz harness: multiple-choice task files (JSON lines, `kiln_gates::mc::load_tasks`).
//!
//! Loaded tasks are well-formed (an answer among at least two choices) and survive a save
//! and load unchanged.

use kiln_gates::mc::{load_tasks, save_tasks};

pub fn run(data: &[u8]) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("fuzz-tasks.jsonl");
    std::fs::write(&path, data).expect("write the input");
    match load_tasks(&path) {
        Ok(tasks) => {
            assert!(!tasks.is_empty());
            for t in &tasks {
                assert!(t.choices.len() >= 2 && t.answer < t.choices.len(), "{t:?}");
                assert!(!t.context.is_empty());
            }
            let again = dir.path().join("again.jsonl");
            save_tasks(&tasks, &again).expect("save");
            assert_eq!(load_tasks(&again).expect("load what was saved"), tasks);
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains("fuzz-tasks.jsonl"),
                "error does not name the file: {msg}"
            );
        }
    }
}
