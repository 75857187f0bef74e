//! Tokenizer training and corpus tokenization with Hugging Face `tokenizers`.
//!
//! Inputs are `.jsonl`/`.json` files (one JSON object per line, text under `--json-key`, as
//! Megatron's `preprocess_data.py` reads them), `.parquet` files (a string column,
//! `--text-column`, streamed row group by row group: [`crate::parquet`]) or plain text files, split into documents by
//! paragraph (blank lines, the default), by line, or taken whole. Each document becomes one
//! sequence and one document of the indexed dataset, followed by EOS, exactly as
//! `preprocess_data.py --append-eod` writes it.

pub use crate::documents::{DocReader, DocSource, MAX_LINE_BYTES, TextSplit};
use crate::error::{DataError, Result};
use crate::indexed::{DType, IndexedDatasetBuilder};
use rayon::prelude::*;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tokenizers::Tokenizer;

/// Longest piece of a document given to the tokenizer at once. A tokenizer's working memory
/// is about 100 times the text it encodes (offsets, pre-tokens, words), so a longer document
/// is encoded in pieces of at most this size, cut before a whitespace character that starts
/// a word: byte-level BPE tokenizers with the GPT-2 pre-tokenizer give the same ids as for
/// the whole document. Peak memory of `tokenize` is then about 3 times its longest input line
/// (at most [`MAX_LINE_BYTES`]) plus about 100 times this size per thread, whatever the
/// document length; [`TokenizeStats::split_documents`] counts the documents encoded so.
pub const PIECE_BYTES: usize = 256 << 10;

/// End-of-document tokens looked for, in order, when none is named.
pub const EOS_CANDIDATES: &[&str] = &["<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>"];

/// Load a `tokenizer.json`.
pub fn load(path: &Path) -> Result<Tokenizer> {
    let bytes = kiln_run::files::read_limited(path, crate::error::limits::TOKENIZER, "a tokenizer")
        .map_err(|e| DataError::io(path, e))?;
    Tokenizer::from_bytes(&bytes).map_err(|e| DataError::Tokenizer {
        path: path.to_path_buf(),
        reason: format!("cannot load tokenizer: {e}"),
    })
}

/// Options for [`train_bpe`].
#[derive(Debug, Clone)]
pub struct TrainOptions {
    pub vocab_size: usize,
    pub min_frequency: u64,
    /// Special tokens, the first of which serves as end-of-document.
    pub special_tokens: Vec<String>,
}

/// Refuses outputs that are (through any path or link) one of the inputs: writing them would
/// destroy the input, and the tokenizer or tokenized data with it.
fn refuse_overwriting_inputs(outputs: &[PathBuf], inputs: &[&Path]) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let id = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    for out in outputs {
        let Some(out_id) = id(out) else { continue };
        if let Some(input) = inputs.iter().find(|i| id(i) == Some(out_id)) {
            return Err(DataError::Invalid(format!(
                "output {} is the input {}: writing it would destroy the input; choose another output",
                out.display(),
                input.display()
            )));
        }
    }
    Ok(())
}

/// Largest vocabulary a tokenizer may have: ids must fit Megatron's int32 dtype.
pub const MAX_VOCAB: usize = i32::MAX as usize;

/// Checks a byte-level BPE vocabulary size: it holds the 256 byte tokens and the special
/// tokens, so it must be at least `256 + specials` (the trainer silently exceeds a smaller
/// one). The error says what is allowed.
pub fn check_vocab_size(vocab_size: usize, specials: usize) -> std::result::Result<(), String> {
    let min = 256 + specials;
    if (min..=MAX_VOCAB).contains(&vocab_size) {
        Ok(())
    } else {
        Err(format!(
            "{vocab_size}: must be in [{min}, {MAX_VOCAB}] (a byte-level vocabulary holds the 256 byte tokens and the {specials} special token(s), then the merges)"
        ))
    }
}

/// Train a byte-level BPE tokenizer (GPT-2 style: byte-level pre-tokenizer and decoder, no
/// normaliser) on the documents and save it as `tokenizer.json` at `output`.
pub fn train_bpe(src: &DocSource, opts: &TrainOptions, output: &Path) -> Result<Tokenizer> {
    check_vocab_size(opts.vocab_size, opts.special_tokens.len())
        .map_err(|e| DataError::Invalid(format!("vocabulary size {e}")))?;
    let inputs: Vec<&Path> = src.files.iter().map(PathBuf::as_path).collect();
    refuse_overwriting_inputs(&[output.to_path_buf()], &inputs)?;
    use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{
        AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
        TokenizerBuilder,
    };
    let tok_err = |e: tokenizers::Error| DataError::Tokenizer {
        path: output.to_path_buf(),
        reason: e.to_string(),
    };
    let mut trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(opts.vocab_size)
        .min_frequency(opts.min_frequency)
        .special_tokens(
            opts.special_tokens
                .iter()
                .map(|t| AddedToken::from(t.clone(), true))
                .collect(),
        )
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let byte_level = ByteLevel::new(false, true, true);
    let mut tokenizer = TokenizerBuilder::<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(BPE::default())
    .with_normalizer(None)
    .with_pre_tokenizer(Some(byte_level.into()))
    .with_post_processor(Some(byte_level.into()))
    .with_decoder(Some(byte_level.into()))
    .build()
    .map_err(tok_err)?;

    // The trainer pulls documents through an iterator; a read error is parked here and
    // reported after training stops.
    let mut reader = src.reader();
    let bar = crate::progress::bytes_bar(src.total_bytes(), "read");
    let mut failure: Option<DataError> = None;
    let docs = std::iter::from_fn(|| match reader.next_doc() {
        Ok(d) => {
            bar.set_position(reader.bytes());
            d
        }
        Err(e) => {
            failure = Some(e);
            None
        }
    });
    tokenizer.train(&mut trainer, docs).map_err(tok_err)?;
    bar.finish_and_clear();
    if let Some(e) = failure {
        return Err(e);
    }
    let tokenizer: Tokenizer = tokenizer.into();
    let tmp = crate::indexed::tmp_name(output);
    let saved = tokenizer
        .save(&tmp, true)
        .map_err(tok_err)
        .and_then(|()| std::fs::rename(&tmp, output).map_err(|e| DataError::io(output, e)));
    if saved.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    saved?;
    Ok(tokenizer)
}

/// What `kiln tokenize` records next to a dataset (`PREFIX.kiln.json`), so that the loader
/// and `inspect` know the vocabulary and EOS without the tokenizer at hand.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sidecar {
    pub vocab_size: usize,
    pub eos_id: Option<u32>,
    pub tokenizer_sha256: String,
    pub documents: u64,
    pub tokens: u64,
    pub dtype: DType,
}

/// Path of a dataset's sidecar.
pub fn sidecar_path(prefix: &Path) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(".kiln.json");
    PathBuf::from(s)
}

/// The sidecar of a dataset, if it has a readable one.
pub fn read_sidecar(prefix: &Path) -> Option<Sidecar> {
    let path = sidecar_path(prefix);
    let text = match kiln_run::files::read_to_string_limited(
        &path,
        crate::error::limits::SIDECAR,
        "a dataset sidecar",
    ) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "ignoring unreadable dataset sidecar");
            return None;
        }
    };
    match serde_json::from_str(&text) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "ignoring malformed dataset sidecar");
            None
        }
    }
}

/// Options for [`tokenize`].
#[derive(Debug, Clone)]
pub struct TokenizeOptions {
    /// Append this token after each document (`None`: don't).
    pub eos: Option<String>,
    /// Documents encoded per parallel batch.
    pub batch_docs: usize,
}

/// What [`tokenize`] did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TokenizeStats {
    pub documents: u64,
    pub tokens: u64,
    pub input_bytes: u64,
    /// Bytes of the documents' text (UTF-8) tokenized: what the throughput is of (the
    /// input's bytes are a parquet file's compressed ones).
    pub text_bytes: u64,
    pub seconds: f64,
    pub tokens_per_second: f64,
    pub dtype: DType,
    /// Documents longer than [`PIECE_BYTES`], encoded in pieces.
    pub split_documents: u64,
    /// Null values of parquet text columns, skipped (no document).
    pub null_rows: u64,
    /// Temporary outputs of earlier writers killed before they finished, removed (path,
    /// bytes).
    pub abandoned_removed: Vec<(String, u64)>,
}

/// Where to end the piece of `text` that starts at `start`: at most `piece` bytes on, before
/// a whitespace character followed by a non-whitespace one (a word's leading space stays
/// with the word), else at a character boundary.
fn piece_end(text: &str, start: usize, piece: usize) -> usize {
    if text.len() - start <= piece {
        return text.len();
    }
    let mut limit = start + piece.max(4);
    while !text.is_char_boundary(limit) {
        limit -= 1;
    }
    let window = &text[start..limit];
    let mut next_is_word = text[limit..]
        .chars()
        .next()
        .is_some_and(|c| !c.is_whitespace());
    for (i, c) in window.char_indices().rev() {
        if c.is_whitespace() && next_is_word && i > 0 {
            return start + i;
        }
        next_is_word = !c.is_whitespace();
    }
    limit
}

/// Encodes `text` in pieces of at most `piece` bytes (see [`PIECE_BYTES`]).
fn encode_pieces(tok: &Tokenizer, text: &str, piece: usize) -> tokenizers::Result<Vec<u32>> {
    let mut ids = Vec::new();
    let mut start = 0;
    while start < text.len() {
        let end = piece_end(text, start, piece);
        let enc = tok.encode_fast(&text[start..end], false)?;
        ids.extend_from_slice(enc.get_ids());
        start = end;
    }
    Ok(ids)
}

/// Find the end-of-document token id: the named token, or the first of [`EOS_CANDIDATES`].
pub fn find_eos(tok: &Tokenizer, tok_path: &Path, name: Option<&str>) -> Result<(String, u32)> {
    let candidates: Vec<&str> = match name {
        Some(n) => vec![n],
        None => EOS_CANDIDATES.to_vec(),
    };
    for c in &candidates {
        if let Some(id) = tok.token_to_id(c) {
            return Ok((c.to_string(), id));
        }
    }
    Err(DataError::Tokenizer {
        path: tok_path.to_path_buf(),
        reason: format!(
            "no end-of-document token among {candidates:?}; name one with --eos or pass --no-eos"
        ),
    })
}

/// Tokenize documents into `output_prefix.{bin,idx}` (+ sidecar), in parallel batches whose
/// order is kept, so the output is the same for any thread count.
pub fn tokenize(
    tokenizer_path: &Path,
    src: &DocSource,
    output_prefix: &Path,
    opts: &TokenizeOptions,
) -> Result<TokenizeStats> {
    let tok = load(tokenizer_path)?;
    let vocab = tok.get_vocab_size(true);
    let eos = match &opts.eos {
        Some(name) => Some(find_eos(&tok, tokenizer_path, Some(name))?.1),
        None => None,
    };
    prepare_output(tokenizer_path, src, output_prefix)?;
    let abandoned = remove_abandoned_outputs(output_prefix);
    let dtype = DType::optimal(vocab);
    let written = write_dataset(&tok, tokenizer_path, src, output_prefix, opts, (eos, dtype));
    if written.is_err() {
        remove_partial_outputs(output_prefix);
    }
    let (stats, sidecar) = written?;
    if let Err(e) = sidecar.write(output_prefix) {
        // The dataset without its record is not what was asked for: no output at all.
        for path in [
            crate::indexed::bin_path(output_prefix),
            crate::indexed::idx_path(output_prefix),
        ] {
            let _ = std::fs::remove_file(path);
        }
        remove_partial_outputs(output_prefix);
        return Err(e);
    }
    Ok(TokenizeStats {
        abandoned_removed: abandoned,
        ..stats
    })
}

/// How long another process's temporary output may stay untouched before it counts as a
/// killed writer's whatever host wrote it (a writer on another host of a shared file system,
/// whose process this host cannot see, appends to its file as it goes).
const ABANDONED_AFTER: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// Deletes what writers of `prefix` killed before they finished left
/// (`PREFIX.bin.tmp.<pid>.<n>` and the `.idx`'s and sidecar's likewise): the files of a process
/// that no longer runs on this host, and any untouched for [`ABANDONED_AFTER`]. A live
/// writer's are kept (two writers of one output race, but neither loses its file). Returns
/// each file removed with its bytes.
fn remove_abandoned_outputs(prefix: &Path) -> Vec<(String, u64)> {
    let finals = [
        crate::indexed::bin_path(prefix),
        crate::indexed::idx_path(prefix),
        sidecar_path(prefix),
    ];
    let mut removed = Vec::new();
    for path in finals {
        let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
            continue;
        };
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        let stem = format!("{}.tmp.", name.to_string_lossy());
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for e in entries.filter_map(std::result::Result::ok) {
            let file = e.file_name().to_string_lossy().into_owned();
            let Some(pid) = file
                .strip_prefix(&stem)
                .and_then(|rest| rest.split_once('.'))
                .and_then(|(pid, _)| pid.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(meta) = e.metadata() else {
                continue;
            };
            let idle = meta.modified().ok().and_then(|t| t.elapsed().ok());
            let gone = !Path::new("/proc").join(pid.to_string()).exists();
            let stale = idle.is_some_and(|d| d >= ABANDONED_AFTER);
            let abandoned = pid != std::process::id() && meta.is_file() && (gone || stale);
            if abandoned && std::fs::remove_file(e.path()).is_ok() {
                removed.push((e.path().display().to_string(), meta.len()));
            }
        }
    }
    removed
}

/// Deletes what this process left of an unfinished dataset at `prefix`: the temporary
/// `PREFIX.bin`/`.idx`/`.kiln.json` files it was writing (another process's are untouched).
fn remove_partial_outputs(prefix: &Path) {
    let finals = [
        crate::indexed::bin_path(prefix),
        crate::indexed::idx_path(prefix),
        sidecar_path(prefix),
    ];
    for path in finals {
        remove_own_tmp_files(&path);
    }
}

/// Deletes this process's temporary siblings of `path` (`PATH.tmp.<pid>.<n>`, see
/// [`crate::indexed::tmp_name`]).
fn remove_own_tmp_files(path: &Path) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return;
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let own = format!("{}.tmp.{}.", name.to_string_lossy(), std::process::id());
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.filter_map(std::result::Result::ok) {
        if e.file_name().to_string_lossy().starts_with(&own) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Tokenizes every document of `src` into the dataset at `output_prefix` (published under
/// its real names), and says what it wrote and the sidecar to record beside it.
fn write_dataset(
    tok: &Tokenizer,
    tokenizer_path: &Path,
    src: &DocSource,
    output_prefix: &Path,
    opts: &TokenizeOptions,
    (eos, dtype): (Option<u32>, DType),
) -> Result<(TokenizeStats, Sidecar)> {
    let vocab = tok.get_vocab_size(true);
    let sha = crate::fingerprint::full(tokenizer_path, |_| {})?;
    let mut builder = IndexedDatasetBuilder::create(output_prefix, dtype)?;
    let t0 = Instant::now();
    let total = src.total_bytes();
    let bar = crate::progress::bytes_bar(total, "tokenize");
    let mut reader = src.reader();
    let (mut docs, mut split, mut text_bytes) = (0u64, 0u64, 0u64);
    let batch = opts.batch_docs.max(1);
    let enc_err = |e: tokenizers::Error| DataError::Tokenizer {
        path: tokenizer_path.to_path_buf(),
        reason: format!("encoding failed: {e}"),
    };
    loop {
        let texts = next_batch(&mut reader, batch)?;
        if texts.is_empty() {
            break;
        }
        let encoded: Vec<Result<Vec<u32>>> = texts
            .par_iter()
            .map(|t| {
                let mut ids = encode_pieces(tok, t, PIECE_BYTES).map_err(enc_err)?;
                ids.extend(eos);
                Ok(ids)
            })
            .collect();
        split += texts.iter().filter(|t| t.len() > PIECE_BYTES).count() as u64;
        text_bytes += texts.iter().map(|t| t.len() as u64).sum::<u64>();
        for ids in encoded {
            builder.add_document(&ids?)?;
            docs += 1;
        }
        bar.set_position(reader.bytes());
        if bar.is_hidden() {
            tracing::debug!(docs, bytes = reader.bytes(), "tokenized");
        } else {
            let rate = builder.tokens() as f64 / t0.elapsed().as_secs_f64();
            bar.set_message(format!("{:.2}M tok/s", rate / 1e6));
        }
    }
    bar.finish_and_clear();
    let tokens = builder.tokens();
    builder.finish()?;
    let seconds = t0.elapsed().as_secs_f64();
    let sidecar = Sidecar {
        vocab_size: vocab,
        eos_id: eos,
        tokenizer_sha256: sha,
        documents: docs,
        tokens,
        dtype,
    };
    let stats = TokenizeStats {
        documents: docs,
        tokens,
        input_bytes: reader.bytes(),
        text_bytes,
        seconds,
        tokens_per_second: tokens as f64 / seconds.max(1e-9),
        dtype,
        split_documents: split,
        null_rows: reader.nulls(),
        abandoned_removed: Vec::new(),
    };
    Ok((stats, sidecar))
}

/// Refuses an output that would overwrite an input (a source file or the tokenizer), and
/// creates the output's directory.
fn prepare_output(tokenizer_path: &Path, src: &DocSource, output_prefix: &Path) -> Result<()> {
    let mut inputs: Vec<&Path> = src.files.iter().map(PathBuf::as_path).collect();
    inputs.push(tokenizer_path);
    let outputs = [
        crate::indexed::bin_path(output_prefix),
        crate::indexed::idx_path(output_prefix),
        sidecar_path(output_prefix),
    ];
    refuse_overwriting_inputs(&outputs, &inputs)?;
    if let Some(parent) = output_prefix.parent()
        && !parent.as_os_str().is_empty()
    {
        std::fs::create_dir_all(parent).map_err(|e| DataError::io(parent, e))?;
    }
    Ok(())
}

/// The next documents of `reader`: up to `batch` of them and about 16 MiB of text (none at
/// the end).
fn next_batch(reader: &mut DocReader<'_>, batch: usize) -> Result<Vec<String>> {
    let mut texts = Vec::with_capacity(batch);
    let mut bytes = 0usize;
    while texts.len() < batch && bytes < (16 << 20) {
        let Some(t) = reader.next_doc()? else {
            break;
        };
        bytes += t.len();
        texts.push(t);
    }
    Ok(texts)
}

impl Sidecar {
    /// Writes this sidecar beside the dataset at `prefix` (a temporary name, then a rename:
    /// a failed write leaves no half-written record).
    fn write(&self, prefix: &Path) -> Result<()> {
        let path = sidecar_path(prefix);
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| DataError::format(&path, e.to_string()))?;
        let tmp = crate::indexed::tmp_name(&path);
        let written = std::fs::write(&tmp, text + "\n").and_then(|()| std::fs::rename(&tmp, &path));
        written.map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            DataError::io(&path, e)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_vocabularies_hold_the_bytes_and_specials() {
        assert!(check_vocab_size(257, 1).is_ok());
        assert!(
            check_vocab_size(256, 1)
                .unwrap_err()
                .starts_with("256: must be in [257,")
        );
        assert!(check_vocab_size(0, 1).is_err());
        assert!(check_vocab_size(MAX_VOCAB + 1, 1).is_err());
    }

    #[test]
    fn long_documents_encode_in_pieces_to_the_same_ids() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in.txt");
        let words = [
            "ant", "bee", "cat", "dög", "eel", "  fox", "\ngnu", "hen,", "!",
        ];
        let text: String = (0..3000)
            .map(|i| words[i * 7 % words.len()])
            .collect::<Vec<_>>()
            .join(" ");
        std::fs::write(&input, &text).unwrap();
        let src = DocSource {
            files: vec![input],
            json_key: "text".into(),
            text_column: "text".into(),
            split: TextSplit::File,
        };
        let opts = TrainOptions {
            vocab_size: 400,
            min_frequency: 2,
            special_tokens: vec!["<|endoftext|>".into()],
        };
        let tok = train_bpe(&src, &opts, &dir.path().join("tok.json")).unwrap();
        let whole = tok
            .encode_fast(text.as_str(), false)
            .unwrap()
            .get_ids()
            .to_vec();
        // Every piece of 8 bytes or more holds a cut before a word (the longest is 6 bytes).
        for piece in [8, 16, 100, 1000] {
            assert_eq!(
                encode_pieces(&tok, &text, piece).unwrap(),
                whole,
                "piece {piece}"
            );
        }
        let mut start = 0;
        while start < text.len() {
            let end = piece_end(&text, start, 16);
            assert!(end > start && end - start <= 16, "{start}..{end}");
            start = end;
        }
    }

    #[test]
    fn outputs_that_are_inputs_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in.txt");
        std::fs::write(&input, "x").unwrap();
        let link = dir.path().join("out.bin");
        std::os::unix::fs::symlink(&input, &link).unwrap();
        let err = refuse_overwriting_inputs(&[link], &[&input]).unwrap_err();
        assert!(err.to_string().contains("is the input"), "{err}");
        let other = dir.path().join("other.bin");
        assert!(refuse_overwriting_inputs(&[other], &[&input]).is_ok());
    }
}
