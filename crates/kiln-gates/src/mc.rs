//! Multiple-choice eval, scored as lm-evaluation-harness does: each choice's log-likelihood
//! given the context (sum of the log-probabilities of its tokens); `acc` picks the choice
//! with the highest log-likelihood, `acc_norm` the highest log-likelihood per byte of the
//! choice's text. Plus the model loading shared by `kiln eval` (run or checkpoint dirs).
//!
//! Task file format (JSON lines, one task per line; blank lines and lines starting with `#`
//! are ignored):
//!
//! ```text
//! {"context": "04213=04213\n58213=", "choices": ["58213\n", "58218\n", "50213\n", "58243\n"], "answer": 0}
//! ```
//!
//! `context` and every choice are text of the synthetic corpus (one character per token,
//! see [`kiln_train::data::synthetic::ALPHABET`]); `answer` is the 0-based index of the right
//! choice. Other fields (an `id`, say) are allowed and ignored.

use crate::{GatesError, io_err};
use burn::tensor::activation::log_softmax;
use kiln_train::data::synthetic::{self, DIGITS};
use kiln_train::{Config, Session};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One task, with its text encoded.
#[derive(Debug, Clone, PartialEq)]
pub struct McTask {
    /// The context text.
    pub context: String,
    /// The choices' texts.
    pub choices: Vec<String>,
    /// Index of the right choice.
    pub answer: usize,
    context_tokens: Vec<u32>,
    choice_tokens: Vec<Vec<u32>>,
}

/// A line of a task file.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct TaskLine {
    context: String,
    choices: Vec<String>,
    answer: usize,
}

/// Token ids of `text` in the synthetic corpus's tokenizer, or the first character it lacks.
pub fn encode(text: &str) -> Result<Vec<u32>, char> {
    text.chars()
        .map(|c| u8::try_from(c).ok().and_then(synthetic::token_of).ok_or(c))
        .collect()
}

fn vocab_text() -> String {
    synthetic::ALPHABET.escape_ascii().to_string()
}

impl McTask {
    /// A task from its texts; fails (with a message) on an empty context, fewer than two
    /// choices, an answer out of range or a character outside the vocabulary.
    pub fn new(context: &str, choices: &[String], answer: usize) -> Result<Self, String> {
        if context.is_empty() {
            return Err(
                "\"context\" is empty; a choice is scored given a non-empty context".into(),
            );
        }
        if choices.len() < 2 {
            return Err(format!(
                "\"choices\" has {} entries; a multiple-choice task needs at least 2",
                choices.len()
            ));
        }
        if answer >= choices.len() {
            return Err(format!(
                "\"answer\" is {answer} but there are only {} choices (0-based index)",
                choices.len()
            ));
        }
        let bad = |what: &str, c: char| {
            format!(
                "{what} has the character {c:?}, which is not in the synthetic corpus's vocabulary \"{}\"",
                vocab_text()
            )
        };
        let context_tokens = encode(context).map_err(|c| bad("\"context\"", c))?;
        let mut choice_tokens = Vec::with_capacity(choices.len());
        for (i, ch) in choices.iter().enumerate() {
            if ch.is_empty() {
                return Err(format!("choice {i} is empty"));
            }
            choice_tokens.push(encode(ch).map_err(|c| bad(&format!("choice {i}"), c))?);
        }
        Ok(Self {
            context: context.to_string(),
            choices: choices.to_vec(),
            answer,
            context_tokens,
            choice_tokens,
        })
    }

    /// The task as one JSON line (without the newline).
    pub fn to_json_line(&self) -> String {
        serde_json::to_string(&TaskLine {
            context: self.context.clone(),
            choices: self.choices.clone(),
            answer: self.answer,
        })
        .unwrap_or_default()
    }
}

/// Largest task file read (the shipped one is 25 KiB; lm-evaluation-harness's largest
/// multiple-choice sets are tens of MiB).
pub const MAX_TASK_FILE_BYTES: u64 = 512 * kiln_run::files::MIB;

/// Reads a task file; errors name the file and the line.
pub fn load_tasks(path: &Path) -> Result<Vec<McTask>, GatesError> {
    let text = kiln_run::files::read_to_string_limited(path, MAX_TASK_FILE_BYTES, "a task file")
        .map_err(io_err(path))?;
    let mut tasks = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let err = |message: String| GatesError::Parse {
            path: path.to_path_buf(),
            line: i + 1,
            message,
        };
        let t: TaskLine = serde_json::from_str(trimmed).map_err(|e| {
            err(format!(
                "{e}; expected {{\"context\": \"...\", \"choices\": [\"...\", \"...\"], \"answer\": 0}}"
            ))
        })?;
        tasks.push(McTask::new(&t.context, &t.choices, t.answer).map_err(err)?);
    }
    if tasks.is_empty() {
        return Err(GatesError::Parse {
            path: path.to_path_buf(),
            line: 0,
            message: "no tasks in the file".into(),
        });
    }
    Ok(tasks)
}

/// Writes tasks as JSON lines.
pub fn save_tasks(tasks: &[McTask], path: &Path) -> Result<(), GatesError> {
    let mut text = String::new();
    for t in tasks {
        text.push_str(&t.to_json_line());
        text.push('\n');
    }
    std::fs::write(path, text).map_err(io_err(path))
}

/// splitmix64: a tiny deterministic generator for the built-in task.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The built-in task of the synthetic corpus (what `tasks/synthetic-copy-mc.jsonl` holds):
/// `n` problems drawn from the held-out numbers (never seen in training), each in the corpus's
/// exact text format after one other held-out line, `04213=04213\n58213=`, with four choices:
/// the right copy `58213\n` and three near misses that change one digit each (at three
/// different positions). Chance is 25 %; a model that learned to copy gets close to 100 %.
pub fn synthetic_copy_tasks(n: usize, seed: u64) -> Vec<McTask> {
    let mut state = seed;
    let max = 10u64.pow(DIGITS as u32);
    let held_out = |state: &mut u64| loop {
        let x = (splitmix(state) % max) as u32;
        if synthetic::is_held_out(x) {
            return x;
        }
    };
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let prev = held_out(&mut state);
        let x = held_out(&mut state);
        let text = |v: u32| format!("{v:0w$}", w = DIGITS);
        let context = format!("{}={}\n{}=", text(prev), text(prev), text(x));
        let right: Vec<u8> = text(x).into_bytes();
        // three distinct positions, each with a different digit
        let mut positions: Vec<usize> = (0..DIGITS).collect();
        let mut wrong = Vec::new();
        for k in 0..3 {
            let j = k + (splitmix(&mut state) as usize) % (DIGITS - k);
            positions.swap(k, j);
            let pos = positions[k];
            let mut digits = right.clone();
            let old = digits[pos] - b'0';
            let new = (old + 1 + (splitmix(&mut state) % 9) as u8) % 10;
            digits[pos] = b'0' + new;
            wrong.push(format!("{}\n", String::from_utf8_lossy(&digits)));
        }
        let answer = (splitmix(&mut state) % 4) as usize;
        let mut choices = wrong;
        choices.insert(answer, format!("{}\n", text(x)));
        if let Ok(t) = McTask::new(&context, &choices, answer) {
            out.push(t);
        }
    }
    out
}

/// Tasks in the shipped file `tasks/synthetic-copy-mc.jsonl`.
pub const SHIPPED_TASKS: usize = 200;
/// Seed of the shipped file.
pub const SHIPPED_SEED: u64 = 20_240_905;

/// Scores of a multiple-choice eval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct McScore {
    /// Tasks scored.
    pub tasks: usize,
    /// Fraction where the highest log-likelihood choice is the answer.
    pub acc: f64,
    /// Fraction where the highest log-likelihood per byte of the choice is the answer.
    pub acc_norm: f64,
    /// Mean log-likelihood of the right choice (nats).
    pub mean_answer_loglik: f64,
    /// Chance level (mean of 1 / number of choices).
    pub chance: f64,
}

/// Sequences scored per forward pass.
const BATCH: usize = 64;

/// Log-likelihood of every choice of every task given its context, `[task][choice]`.
/// Each (context + choice) is one sequence; sequences longer than the training `seq_len`
/// keep their last `seq_len` tokens (lm-evaluation-harness truncates the context the same way).
pub fn choice_logliks(
    session: &Session,
    tasks: &[McTask],
    progress: &mut dyn FnMut(usize, usize),
) -> Vec<Vec<f64>> {
    let max_len = session.config.training.seq_len.max(2) + 1;
    // (task, choice, tokens, index of the first choice token in tokens)
    let mut items: Vec<(usize, usize, Vec<u32>, usize)> = Vec::new();
    for (ti, t) in tasks.iter().enumerate() {
        for (ci, ch) in t.choice_tokens.iter().enumerate() {
            let mut seq = t.context_tokens.clone();
            seq.extend_from_slice(ch);
            let mut start = t.context_tokens.len();
            if seq.len() > max_len {
                let cut = seq.len() - max_len;
                seq.drain(..cut);
                start = start.saturating_sub(cut).max(1);
            }
            items.push((ti, ci, seq, start));
        }
    }
    let mut out: Vec<Vec<f64>> = tasks.iter().map(|t| vec![0.0; t.choices.len()]).collect();
    let mut done = 0;
    for chunk in items.chunks(BATCH) {
        let len = chunk.iter().map(|(_, _, s, _)| s.len()).max().unwrap_or(2);
        let t = len - 1;
        let pad = |s: &[u32], from: usize| -> Vec<u32> {
            let mut v: Vec<u32> = s.iter().skip(from).copied().collect();
            v.resize(t, 0);
            v
        };
        let inputs: Vec<Vec<u32>> = chunk.iter().map(|(_, _, s, _)| pad(s, 0)).collect();
        let targets: Vec<Vec<u32>> = chunk.iter().map(|(_, _, s, _)| pad(s, 1)).collect();
        let b = chunk.len();
        let x = kiln_train::tensor::int_tensor(&inputs, t, &session.device);
        let y = kiln_train::tensor::int_tensor(&targets, t, &session.device);
        let logits = session.model.forward(&session.params, x);
        let v = logits.dims()[2];
        let logp = log_softmax(logits.reshape([b * t, v]), 1)
            .gather(1, y.reshape([b * t, 1]))
            .into_data()
            .iter::<f32>()
            .collect::<Vec<f32>>();
        for (r, (ti, ci, seq, start)) in chunk.iter().enumerate() {
            // token at position p is predicted from position p - 1
            let ll: f64 = (*start..seq.len())
                .map(|p| f64::from(logp.get(r * t + p - 1).copied().unwrap_or(f32::NAN)))
                .sum();
            out[*ti][*ci] = ll;
        }
        done += chunk.len();
        progress(done, items.len());
    }
    out
}

fn argmax(values: impl Iterator<Item = f64>) -> usize {
    let mut best = (0, f64::NEG_INFINITY);
    for (i, v) in values.enumerate() {
        if v > best.1 {
            best = (i, v);
        }
    }
    best.0
}

/// Scores `tasks` with the session's current parameters (no gradients): `acc`, `acc_norm`
/// (log-likelihood divided by the choice's length in bytes), as lm-evaluation-harness.
/// This is the function the trainer calls for its in-training eval.
/// `progress(done, total)` is called after each batch of scored sequences (one per choice).
pub fn score_multiple_choice(
    session: &Session,
    tasks: &[McTask],
    progress: &mut dyn FnMut(usize, usize),
) -> McScore {
    if tasks.is_empty() {
        return McScore {
            tasks: 0,
            acc: 0.0,
            acc_norm: 0.0,
            mean_answer_loglik: 0.0,
            chance: 0.0,
        };
    }
    let ll = choice_logliks(session, tasks, progress);
    let (mut acc, mut acc_norm, mut answer_ll, mut chance) = (0usize, 0usize, 0.0f64, 0.0f64);
    for (t, lls) in tasks.iter().zip(&ll) {
        acc += usize::from(argmax(lls.iter().copied()) == t.answer);
        let norm = lls
            .iter()
            .zip(&t.choices)
            .map(|(l, c)| l / c.len().max(1) as f64);
        acc_norm += usize::from(argmax(norm) == t.answer);
        answer_ll += lls[t.answer];
        chance += 1.0 / t.choices.len() as f64;
    }
    let n = tasks.len() as f64;
    McScore {
        tasks: tasks.len(),
        acc: acc as f64 / n,
        acc_norm: acc_norm as f64 / n,
        mean_answer_loglik: answer_ll / n,
        chance: chance / n,
    }
}

/// A model to evaluate: the session with loaded weights and where they came from.
pub struct LoadedModel {
    /// Model and parameters.
    pub session: Session,
    /// The weights file or checkpoint directory.
    pub weights: PathBuf,
    /// The config file used.
    pub config_path: PathBuf,
    /// Step of the checkpoint, when known.
    pub step: Option<u64>,
}

/// Loads a model from a run directory (its `model.safetensors`, or else its newest valid
/// checkpoint) or a checkpoint directory (`RUN_DIR/checkpoints/step-N`, verified against
/// its manifest). The config is `config` if given, else the run's `config.toml`.
pub fn load_model(path: &Path, config: Option<&Path>) -> Result<LoadedModel, GatesError> {
    check_model_dir(path)?;
    let found = find_weights(path)?;
    let config_path = config.map_or_else(
        || found.run_dir.join(kiln_run::layout::CONFIG),
        Path::to_path_buf,
    );
    if !config_path.exists() {
        return Err(GatesError::Invalid(format!(
            "{}: missing; the run's config is needed to rebuild the model (or pass --config FILE)",
            config_path.display()
        )));
    }
    // The run's own record is complete (its model keys resolved at start); a config given
    // with --config is loaded as `kiln train` would.
    let cfg = match config {
        None => Config::load_recorded(&config_path),
        Some(_) => Config::load(Some(&config_path), &[]),
    }
    .map_err(kiln_train::TrainError::from)?;
    let session = Session::from_weights(&cfg, &found.tensors, &found.weights)?;
    Ok(LoadedModel {
        session,
        weights: found.weights,
        config_path,
        step: found.step,
    })
}

/// Refuses a path that is not a directory, and a checkpoint directory without its manifest.
fn check_model_dir(path: &Path) -> Result<(), GatesError> {
    if !path.exists() {
        return Err(GatesError::Invalid(format!(
            "{}: no such run or checkpoint directory",
            path.display()
        )));
    }
    if !path.is_dir() {
        return Err(GatesError::Invalid(format!(
            "{}: not a directory; give a run directory (with config.toml and model.safetensors or checkpoints/) or a checkpoint directory (checkpoints/step-N)",
            path.display()
        )));
    }
    // A checkpoint directory (`step-N`, with its state.json) whose manifest is missing was
    // torn while being written or damaged since: it cannot be verified, and it is not a run
    // directory either (whose config.toml would then be blamed).
    let named_like_one = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(kiln_run::layout::parse_checkpoint_dir)
        .is_some();
    let is_checkpoint = path.join(kiln_run::layout::CHECKPOINT_STATE).exists()
        || (named_like_one && !path.join(kiln_run::layout::CONFIG).exists());
    if is_checkpoint && !path.join(kiln_run::layout::CHECKPOINT_MANIFEST).exists() {
        return Err(GatesError::Invalid(format!(
            "{}: a checkpoint directory without manifest.json: it is incomplete (torn while being written) or damaged, so its files cannot be verified; evaluate the run directory instead (its newest valid checkpoint is used)",
            path.display()
        )));
    }
    Ok(())
}

/// The weights [`find_weights`] found.
struct Found {
    tensors: Vec<kiln_train::checkpoint::HostTensor>,
    /// The file or checkpoint directory they came from.
    weights: PathBuf,
    run_dir: PathBuf,
    /// The checkpoint's step (`None` for the final weights).
    step: Option<u64>,
}

/// The weights at `path`: a checkpoint directory's, else a run directory's final weights,
/// else its newest valid checkpoint's.
fn find_weights(path: &Path) -> Result<Found, GatesError> {
    if path.join(kiln_run::layout::CHECKPOINT_MANIFEST).exists() {
        let ck = kiln_train::checkpoint::load(path)?;
        // RUN_DIR/checkpoints/step-N
        let run_dir = path
            .parent()
            .and_then(Path::parent)
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
        return Ok(Found {
            step: Some(ck.step),
            tensors: ck.model,
            weights: path.to_path_buf(),
            run_dir,
        });
    }
    let file = path.join(kiln_run::layout::FINAL_MODEL);
    if file.exists() {
        use std::io::Read;
        let mut bytes = Vec::new();
        kiln_run::files::open_regular(&file)
            .and_then(|mut f| f.read_to_end(&mut bytes))
            .map_err(io_err(&file))?;
        return Ok(Found {
            tensors: kiln_train::checkpoint::from_safetensors(&bytes, &file)?,
            weights: file,
            run_dir: path.to_path_buf(),
            step: None,
        });
    }
    let root = path.join(kiln_run::layout::CHECKPOINTS);
    let mut rejected = Vec::new();
    let found = kiln_train::checkpoint::load_latest_valid(&root, |p, why| {
        rejected.push(format!("{}: {why}", p.display()));
    });
    let Some((dir, ck)) = found else {
        let rejected = match rejected.is_empty() {
            true => String::new(),
            false => format!(" (rejected: {})", rejected.join("; ")),
        };
        return Err(GatesError::Invalid(format!(
            "{}: no model.safetensors and no valid checkpoint under checkpoints/{rejected}",
            path.display(),
        )));
    };
    Ok(Found {
        tensors: ck.model,
        weights: dir,
        run_dir: path.to_path_buf(),
        step: Some(ck.step),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_tasks_are_well_formed() {
        let tasks = synthetic_copy_tasks(50, 1);
        assert_eq!(tasks.len(), 50);
        let mut answers = [0usize; 4];
        for t in &tasks {
            assert_eq!(t.choices.len(), 4);
            let n = t.context.rsplit('\n').next().unwrap().trim_end_matches('=');
            assert!(synthetic::is_held_out(n.parse().unwrap()));
            assert_eq!(t.choices[t.answer], format!("{n}\n"));
            let mut c = t.choices.clone();
            c.sort();
            c.dedup();
            assert_eq!(c.len(), 4, "{:?}", t.choices);
            answers[t.answer] += 1;
        }
        assert!(answers.iter().all(|&a| a > 3), "{answers:?}");
    }

    #[test]
    fn bad_lines_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        std::fs::write(
            &p,
            "{\"context\": \"1=\", \"choices\": [\"1\", \"2\"], \"answer\": 0}\n\n{\"context\": \"a=\", \"choices\": [\"1\", \"2\"], \"answer\": 0}\n",
        )
        .unwrap();
        let e = load_tasks(&p).unwrap_err().to_string();
        assert!(e.contains("t.jsonl line 3") && e.contains("'a'"), "{e}");
        std::fs::write(
            &p,
            "{\"context\": \"1=\", \"choices\": [\"1\", \"2\"], \"answer\": 2}\n",
        )
        .unwrap();
        let e = load_tasks(&p).unwrap_err().to_string();
        assert!(e.contains("line 1") && e.contains("answer"), "{e}");
        std::fs::write(&p, "not json\n").unwrap();
        let e = load_tasks(&p).unwrap_err().to_string();
        assert!(e.contains("line 1") && e.contains("expected"), "{e}");
    }

    /// The shipped task file is exactly the generator's output (regenerate it with
    /// `KILN_WRITE_TASKS=1 cargo test -p kiln-gates shipped_task_file`).
    #[test]
    fn shipped_task_file_matches_generator() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tasks/synthetic-copy-mc.jsonl");
        let tasks = synthetic_copy_tasks(SHIPPED_TASKS, SHIPPED_SEED);
        if std::env::var_os("KILN_WRITE_TASKS").is_some() {
            save_tasks(&tasks, &path).unwrap();
        }
        let loaded = load_tasks(&path).unwrap();
        assert_eq!(loaded, tasks);
    }

    #[test]
    fn scoring_a_fresh_model_is_near_chance_and_deterministic() {
        let cfg = Config::load(
            None,
            &[
                "model.d_model=16".into(),
                "model.n_layers=1".into(),
                "model.n_heads=2".into(),
                "model.n_kv_heads=1".into(),
                "model.ffn_hidden=32".into(),
                "training.seq_len=16".into(),
            ],
        )
        .unwrap();
        let s = Session::new(&cfg, synthetic::VOCAB).unwrap();
        let tasks = synthetic_copy_tasks(40, 3);
        let a = score_multiple_choice(&s, &tasks, &mut |_, _| {});
        let b = score_multiple_choice(&s, &tasks, &mut |_, _| {});
        assert_eq!(a, b);
        assert_eq!(a.tasks, 40);
        assert!((a.chance - 0.25).abs() < 1e-9);
        assert!(a.mean_answer_loglik < 0.0 && a.mean_answer_loglik.is_finite());
        // all choices have the same length: acc and acc_norm agree
        assert_eq!(a.acc, a.acc_norm);
    }
}
