//! The peak memory of tokenizing a large parquet file (1 GB by default): it must stay bounded
//! by a row group and the tokenizer's batch, not grow with the file. Not in the default suite
//! (it writes and reads a gigabyte); run it with
//!
//! ```sh
//! KILN_PARQUET_GB=1 cargo test --release -p kiln-data --test parquet_memory -- --ignored --nocapture
//! ```
//!
//! The file is written by the Rust writer (the `parquet` crate's), uncompressed so that its size is the
//! text's, in row groups of 64 MiB; the tokenization runs in a child process (this test
//! binary again) whose peak RSS (VmHWM) is what is measured.

use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;
use std::path::Path;
use std::sync::Arc;

const CHILD_ENV: &str = "KILN_PARQUET_CHILD";

fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let l = s.lines().find(|l| l.starts_with("VmHWM:"))?;
            l.split_whitespace().nth(1)?.parse::<f64>().ok()
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// Pseudo-random words (a fixed generator), `n` documents of about 2 KB.
fn documents(seed: u64, n: usize) -> Vec<String> {
    let mut x = seed | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..n)
        .map(|_| {
            let words = 250 + (next() % 200) as usize;
            (0..words)
                .map(|_| {
                    let len = 2 + (next() % 7) as usize;
                    (0..len)
                        .map(|_| (b'a' + (next() % 26) as u8) as char)
                        .collect::<String>()
                })
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

/// A file of about `bytes` of text in row groups of about 64 MiB; its size.
fn write_file(path: &Path, bytes: u64) -> u64 {
    let props = WriterProperties::builder()
        .set_compression(Compression::UNCOMPRESSED)
        .build();
    let schema = parse_message_type("message m { optional binary text (STRING); }").unwrap();
    let file = std::fs::File::create(path).unwrap();
    let mut w = SerializedFileWriter::new(file, Arc::new(schema), Arc::new(props)).unwrap();
    let (mut seed, mut written) = (1u64, 0u64);
    while written <= bytes {
        let mut rg = w.next_row_group().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let mut group = 0u64;
        while group < 64 << 20 && written + group <= bytes {
            let docs: Vec<ByteArray> = documents(seed, 4096)
                .into_iter()
                .map(|d| ByteArray::from(d.into_bytes()))
                .collect();
            seed += 1;
            group += docs.iter().map(|d| d.len() as u64).sum::<u64>();
            let defs = vec![1i16; docs.len()];
            (col.typed::<ByteArrayType>())
                .write_batch(&docs, Some(&defs), None)
                .unwrap();
        }
        col.close().unwrap();
        rg.close().unwrap();
        written += group;
    }
    w.close().unwrap();
    std::fs::metadata(path).unwrap().len()
}

#[test]
#[ignore = "writes and tokenizes a gigabyte; see the module documentation"]
fn a_large_parquet_file_tokenizes_in_bounded_memory() {
    if let Ok(dir) = std::env::var(CHILD_ENV) {
        return child(Path::new(&dir));
    }
    let gb: f64 = std::env::var("KILN_PARQUET_GB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1.0);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let t0 = std::time::Instant::now();
    let size = write_file(&dir.join("big.parquet"), (gb * 1e9) as u64);
    println!(
        "wrote {:.2} GB of parquet in {:.0} s",
        size as f64 / 1e9,
        t0.elapsed().as_secs_f64()
    );
    // A small tokenizer, trained on a sample.
    std::fs::write(dir.join("sample.txt"), documents(99, 200).join("\n\n")).unwrap();
    let sample = kiln_data::tokenize::DocSource {
        files: vec![dir.join("sample.txt")],
        json_key: "text".into(),
        text_column: "text".into(),
        split: kiln_data::tokenize::TextSplit::Paragraph,
    };
    let opts = kiln_data::tokenize::TrainOptions {
        vocab_size: 400,
        min_frequency: 2,
        special_tokens: vec!["<|endoftext|>".into()],
    };
    kiln_data::tokenize::train_bpe(&sample, &opts, &dir.join("tok.json")).unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "a_large_parquet_file_tokenizes_in_bounded_memory",
            "--nocapture",
        ])
        .env(CHILD_ENV, dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = text
        .lines()
        .find(|l| l.starts_with("child:"))
        .expect("the child's report");
    println!("{line}");
    let peak: f64 = line
        .split("peak_rss_mib=")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    // Bounded by a row group (~64 MiB) and the batch of texts (16 MiB) with their encodings,
    // not by the file (1 GB): a file read whole would need more than its size.
    assert!(
        peak < 0.5 * size as f64 / 1048576.0 + 256.0,
        "peak {peak} MiB for a {size} B file"
    );
}

fn child(dir: &Path) {
    let before = peak_rss_mib();
    let src = kiln_data::tokenize::DocSource {
        files: vec![dir.join("big.parquet")],
        json_key: "text".into(),
        text_column: "text".into(),
        split: kiln_data::tokenize::TextSplit::Paragraph,
    };
    let opts = kiln_data::tokenize::TokenizeOptions {
        eos: Some("<|endoftext|>".into()),
        batch_docs: 4096,
    };
    let stats = kiln_data::tokenize::tokenize(&dir.join("tok.json"), &src, &dir.join("out"), &opts)
        .unwrap();
    println!(
        "child: documents={} tokens={} input_bytes={} seconds={:.1} MB/s={:.1} peak_rss_mib={:.0} (before tokenizing {:.0})",
        stats.documents,
        stats.tokens,
        stats.input_bytes,
        stats.seconds,
        stats.input_bytes as f64 / stats.seconds / 1e6,
        peak_rss_mib(),
        before
    );
}
