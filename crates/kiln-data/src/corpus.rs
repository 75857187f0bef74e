//! Corpus lists: the blendcorpus format, one dataset per line.
//!
//! ```text
//! # weight  prefix                      [corpus]
//! 0.7       shards/web/cc_0001_text     web
//! 0.3       /data/code/stack_0001_text  code
//! ```
//!
//! Blank lines and `#` comments (whole-line or trailing) are ignored. Weights are relative
//! (they are normalised, as Megatron does). A relative prefix resolves against the list file's
//! directory, so a list and its shards can move together. A prefix may be given with its
//! `.bin`/`.idx` suffix; the suffix is dropped.

use crate::error::{DataError, Result};
use std::path::{Path, PathBuf};

/// One line of a corpus list.
#[derive(Debug, Clone, PartialEq)]
pub struct CorpusEntry {
    /// Relative weight (finite, >= 0).
    pub weight: f64,
    /// The prefix as written in the list; identifies the dataset across weight changes.
    pub key: String,
    /// The prefix resolved against the list's directory.
    pub prefix: PathBuf,
    /// Corpus name (third column), or the prefix's file name.
    pub corpus: String,
    /// 1-based line number, for error messages.
    pub line: usize,
}

/// A parsed corpus list.
#[derive(Debug, Clone, PartialEq)]
pub struct CorpusList {
    /// The list file.
    pub path: PathBuf,
    /// Its entries in file order.
    pub entries: Vec<CorpusEntry>,
}

/// `path` without `.` components and repeated separators (`..` is kept: it may cross a link).
fn lexical(path: &Path) -> PathBuf {
    path.components().collect()
}

fn duplicate(key: &str, prev: &CorpusEntry) -> String {
    format!(
        "prefix {key} names the same dataset as {} on line {}; list each dataset once and give it the combined weight",
        prev.key, prev.line
    )
}

impl CorpusList {
    /// Refuses two entries whose index files are one file (reached by different spellings,
    /// `..` or links): it would silently get the weight of both.
    fn check_distinct_files(&self) -> Result<()> {
        use std::os::unix::fs::MetadataExt;
        let mut seen: std::collections::HashMap<(u64, u64), &CorpusEntry> = Default::default();
        for e in &self.entries {
            let Ok(meta) = std::fs::metadata(crate::indexed::idx_path(&e.prefix)) else {
                continue; // a missing dataset is reported, by name, when it is opened
            };
            if let Some(prev) = seen.insert((meta.dev(), meta.ino()), e) {
                return Err(DataError::line(&self.path, e.line, duplicate(&e.key, prev)));
            }
        }
        Ok(())
    }

    /// Read and parse a list file.
    pub fn read(path: &Path) -> Result<CorpusList> {
        let text = kiln_run::files::read_to_string_limited(
            path,
            crate::error::limits::CORPUS_LIST,
            "a corpus list",
        )
        .map_err(|e| DataError::io(path, e))?;
        let base = path.parent().unwrap_or(Path::new("."));
        let list = CorpusList::parse(&text, path, base)?;
        list.check_distinct_files()?;
        Ok(list)
    }

    /// Parse list text; `path` names it in errors, `base` resolves relative prefixes.
    pub fn parse(text: &str, path: &Path, base: &Path) -> Result<CorpusList> {
        let mut entries: Vec<CorpusEntry> = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let content = raw.split('#').next().unwrap_or("").trim();
            if content.is_empty() {
                continue;
            }
            let bad = |reason: String| DataError::line(path, line, reason);
            let entry = CorpusEntry::parse(content, line, base).map_err(bad)?;
            // `a`, `./a` and `x//a`-style spellings name one dataset: compare the paths, not
            // the strings (files reached by links are compared in `read`).
            let same = lexical(&entry.prefix);
            if let Some(prev) = entries.iter().find(|e| lexical(&e.prefix) == same) {
                return Err(bad(duplicate(&entry.key, prev)));
            }
            entries.push(entry);
        }
        check_weights(&entries).map_err(|reason| DataError::List {
            path: path.to_path_buf(),
            reason: reason.into(),
        })?;
        Ok(CorpusList {
            path: path.to_path_buf(),
            entries,
        })
    }

    /// Weights normalised to sum to 1, computed exactly as megatron-core's `normalize` does
    /// (`w / sum(w)` in f64), so that the blend order matches its `build_blending_indices`.
    pub fn normalized_weights(&self) -> Vec<f64> {
        normalize(&self.entries.iter().map(|e| e.weight).collect::<Vec<_>>())
    }
}

impl CorpusEntry {
    /// The entry of list line number `line`, `content` without its comment; the reason when
    /// it is not `weight prefix [corpus]`.
    fn parse(content: &str, line: usize, base: &Path) -> std::result::Result<Self, String> {
        let fields: Vec<&str> = content.split_whitespace().collect();
        if fields.len() < 2 || fields.len() > 3 {
            return Err(format!(
                "expected `weight prefix [corpus]`, found {} field(s): {content:?}",
                fields.len()
            ));
        }
        let weight: f64 = fields[0].parse().map_err(|_| {
            format!(
                "weight {:?} is not a number (expected `weight prefix [corpus]`)",
                fields[0]
            )
        })?;
        if !weight.is_finite() || weight < 0.0 {
            return Err(format!("weight {} must be a finite number >= 0", fields[0]));
        }
        let mut key = fields[1].to_string();
        for suffix in [".bin", ".idx"] {
            if let Some(stripped) = key.strip_suffix(suffix) {
                key = stripped.to_string();
            }
        }
        // `.idx`, `dir/`, `dir/.` or `..` name no dataset: `PREFIX.idx` would be a hidden
        // file of a directory, not a shard.
        if matches!(key.rsplit('/').next(), Some("" | "." | "..")) {
            return Err(format!(
                "prefix {:?} names no dataset; expected the path of PREFIX.bin/PREFIX.idx without the suffix",
                fields[1]
            ));
        }
        let p = Path::new(&key);
        let prefix = if p.is_absolute() {
            p.to_path_buf()
        } else {
            base.join(p)
        };
        let corpus = match fields.get(2) {
            Some(c) => c.to_string(),
            None => p
                .file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| key.clone()),
        };
        Ok(CorpusEntry {
            weight,
            key,
            prefix,
            corpus,
            line,
        })
    }
}

/// Why a list's weights cannot make a blend: no entries, a sum past what a float holds, or
/// no positive weight.
fn check_weights(entries: &[CorpusEntry]) -> std::result::Result<(), &'static str> {
    if entries.is_empty() {
        return Err("no datasets listed (expected lines of `weight prefix [corpus]`)");
    }
    let weights: Vec<f64> = entries.iter().map(|e| e.weight).collect();
    let positive = weights.iter().any(|&w| w > 0.0);
    if !weights_sum_finite(&weights) && positive {
        return Err(
            "the weights sum to more than a float holds; they are relative, so scale them down",
        );
    }
    if !positive {
        return Err("every weight is 0; at least one dataset needs a positive weight");
    }
    Ok(())
}

/// `w / sum(w)` in f64, summing left to right like `numpy.sum` does for short arrays.
pub fn normalize(weights: &[f64]) -> Vec<f64> {
    let sum = pairwise_sum(weights);
    weights.iter().map(|w| w / sum).collect()
}

/// Whether relative weights normalise: their sum must be finite (two weights of 1e308 sum to
/// infinity, and every weight would normalise to 0).
pub fn weights_sum_finite(weights: &[f64]) -> bool {
    let w = normalize(weights);
    w.iter().all(|x| x.is_finite()) && w.iter().any(|x| *x > 0.0)
}

/// numpy's pairwise summation (blocks of 8 accumulators below 128 elements), so that even
/// long weight lists normalise to the same bits as megatron-core's.
fn pairwise_sum(a: &[f64]) -> f64 {
    let n = a.len();
    if n < 8 {
        let mut s = 0.0;
        for &x in a {
            s += x;
        }
        s
    } else if n <= 128 {
        let mut r = [0.0f64; 8];
        r.copy_from_slice(&a[..8]);
        let mut i = 8;
        while i + 8 <= n {
            for (j, rj) in r.iter_mut().enumerate() {
                *rj += a[i + j];
            }
            i += 8;
        }
        let mut res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        while i < n {
            res += a[i];
            i += 1;
        }
        res
    } else {
        let mut n2 = n / 2;
        n2 -= n2 % 8;
        pairwise_sum(&a[..n2]) + pairwise_sum(&a[n2..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<CorpusList> {
        CorpusList::parse(text, Path::new("list.txt"), Path::new("/base"))
    }

    #[test]
    fn parses_weights_prefixes_and_corpora() {
        let l = parse("# header\n0.7 a/b_text web\n\n0.3 /abs/c.bin  # trailing\n").unwrap();
        assert_eq!(l.entries.len(), 2);
        assert_eq!(l.entries[0].prefix, PathBuf::from("/base/a/b_text"));
        assert_eq!(l.entries[0].corpus, "web");
        assert_eq!(l.entries[0].line, 2);
        assert_eq!(l.entries[1].prefix, PathBuf::from("/abs/c"));
        assert_eq!(l.entries[1].corpus, "c");
        assert_eq!(l.normalized_weights(), vec![0.7 / 1.0, 0.3 / 1.0]);
    }

    #[test]
    fn bad_lines_name_file_and_line() {
        for (text, want) in [
            ("0.5 a\nx b\n", "list.txt:2: weight \"x\""),
            ("0.5\n", "list.txt:1: expected"),
            ("0.5 a b c d\n", "list.txt:1: expected"),
            ("-1 a\n", "list.txt:1: weight -1"),
            ("nan a\n", "list.txt:1: weight nan"),
            (
                "1 a\n1 a\n",
                "list.txt:2: prefix a names the same dataset as a on line 1",
            ),
            (
                "1 a\n1 ./a.bin\n",
                "list.txt:2: prefix ./a names the same dataset as a on line 1",
            ),
            (
                "1 d/a\n1 d//./a\n",
                "list.txt:2: prefix d//./a names the same dataset as d/a on line 1",
            ),
            ("# nothing\n", "list.txt: no datasets"),
            ("0 a\n0 b\n", "list.txt: every weight is 0"),
        ] {
            let err = parse(text).unwrap_err().to_string();
            assert!(err.starts_with(want), "{text:?}: {err}");
        }
    }

    /// Fuzz finding (corpus_list): a prefix that is only a suffix (`.idx`, `.bin`) became an
    /// empty key resolving to the list's directory (so `DIR/.idx` would be opened).
    #[test]
    fn fuzz_prefix_that_is_only_a_suffix_is_refused() {
        for prefix in [
            ".idx", ".bin", "x/.bin", "data/", "data/.", "data/..", "..", ".",
        ] {
            let err = parse(&format!("1 {prefix}\n")).unwrap_err().to_string();
            assert!(
                err.starts_with(&format!("list.txt:1: prefix {prefix:?} names no dataset")),
                "{prefix}: {err}"
            );
        }
        assert!(parse("1 data/.hidden\n1 ../up/x.bin\n").is_ok());
    }

    /// Finding (the corpus_list harness's normalisation invariant, by review): weights whose
    /// sum overflows (`1e308` twice) normalised to all zeros, a
    /// blend without a distribution.
    #[test]
    fn fuzz_weights_whose_sum_overflows_are_refused() {
        let err = parse("1e308 a\n1e308 b\n").unwrap_err().to_string();
        assert!(
            err.starts_with("list.txt: the weights sum to more"),
            "{err}"
        );
        let l = parse("1e308 a\n1e307 b\n").unwrap();
        let w = l.normalized_weights();
        assert!(w.iter().all(|x| x.is_finite()) && (w.iter().sum::<f64>() - 1.0).abs() < 1e-12);
    }
}
