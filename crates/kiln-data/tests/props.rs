//! Property tests of the data layer: round trips, packing, blend proportions, thread-count
//! independence, weight-stable resumption, and clear errors (never panics) on bad input.

use kiln_data::blend::{Blend, BlendSchedule, megatron_blend};
use kiln_data::corpus::{CorpusList, normalize};
use kiln_data::indexed::{DType, IndexedDataset, IndexedDatasetBuilder, bin_path, idx_path};
use kiln_data::{BlendedLoader, LoaderConfig, Resume, Verify};
use proptest::prelude::*;
use std::path::{Path, PathBuf};

/// Token `k` of document `d`: unique per (d, k), so a sample's tokens say where they came from.
fn tok(d: usize, k: usize) -> u32 {
    (d * 1000 + k) as u32
}

fn write_docs(prefix: &Path, lens: &[usize], dtype: DType) {
    let mut b = IndexedDatasetBuilder::create(prefix, dtype).unwrap();
    for (d, &l) in lens.iter().enumerate() {
        let doc: Vec<u32> = (0..l).map(|k| tok(d, k)).collect();
        b.add_document(&doc).unwrap();
    }
    b.finish().unwrap();
}

fn write_list(dir: &Path, name: &str, lines: &[(f64, &str)]) -> PathBuf {
    let text: String = lines.iter().map(|(w, p)| format!("{w} {p}\n")).collect();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn cfg(dir: &Path, seq_len: usize, samples: u64) -> LoaderConfig {
    let mut c = LoaderConfig::new(seq_len, 7, samples, dir.join("cache"));
    c.verify = Verify::Off;
    c
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn indexed_round_trip(lens in prop::collection::vec(0usize..300, 0..40), wide in any::<bool>()) {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("ds");
        let dtype = if wide { DType::I32 } else { DType::U16 };
        write_docs(&prefix, &lens, dtype);
        let ds = IndexedDataset::open(&prefix).unwrap();
        prop_assert_eq!(ds.len(), lens.len());
        prop_assert_eq!(ds.index().documents(), lens.len());
        prop_assert_eq!(ds.dtype(), dtype);
        prop_assert_eq!(ds.index().check_all().unwrap(), lens.iter().sum::<usize>() as u64);
        for (d, &l) in lens.iter().enumerate() {
            let want: Vec<u32> = (0..l).map(|k| tok(d, k)).collect();
            prop_assert_eq!(ds.sequence(d).unwrap(), want);
        }
    }

    /// Every sample has seq_len + 1 tokens; unshuffled samples overlap by one token and,
    /// laid end to end, visit every document exactly once per epoch, whole and in order.
    #[test]
    fn packing_covers_each_epoch_exactly(
        lens in prop::collection::vec(0usize..200, 1..30),
        seq_len in 1usize..64,
        samples in 1u64..200,
    ) {
        prop_assume!(lens.iter().sum::<usize>() > 0);
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("ds");
        write_docs(&prefix, &lens, DType::U16);
        let list = write_list(dir.path(), "list.txt", &[(1.0, "ds")]);
        let loader = BlendedLoader::open(&list, &cfg(dir.path(), seq_len, samples)).unwrap();
        for i in 0..samples {
            prop_assert_eq!(loader.sample(i).unwrap().len(), seq_len + 1);
        }
        let idx = loader.datasets()[0].index();
        let total: usize = lens.iter().sum();
        // Rebuild the stream from unshuffled samples: u covers [u*seq_len, u*seq_len+seq_len].
        let mut stream: Vec<u32> = Vec::new();
        let mut prev_last = None;
        let mut u = 0u64;
        while stream.len() < 2 * total && (u as u128 * seq_len as u128) < (idx.epochs() as u128 * total as u128) {
            let mut s = Vec::new();
            idx.packed_into(u, u, &mut s).unwrap();
            prop_assert_eq!(s.len(), seq_len + 1);
            if let Some(p) = prev_last { prop_assert_eq!(s[0], p); }
            prev_last = s.last().copied();
            stream.extend_from_slice(&s[..seq_len]);
            u += 1;
        }
        // Check each full epoch present in the stream.
        for epoch in stream.chunks_exact(total) {
            let mut k = 0;
            let mut seen = vec![false; lens.len()];
            while k < epoch.len() {
                let d = (epoch[k] / 1000) as usize;
                prop_assert!(!seen[d], "document {} twice in an epoch", d);
                seen[d] = true;
                for off in 0..lens[d] {
                    prop_assert_eq!(epoch[k + off], tok(d, off));
                }
                k += lens[d];
            }
            for (d, &l) in lens.iter().enumerate() {
                prop_assert!(seen[d] || l == 0, "document {} missing from an epoch", d);
            }
        }
    }

    /// The blend follows the weights: after any prefix of m samples each dataset's count is
    /// within 1 of its target w*max(m-1, 1) (Megatron's rule aims at w*i when choosing sample
    /// i, one behind the count), so proportions are within (1 + w)/m of the weights.
    #[test]
    fn blend_proportions_match_weights(
        raw in prop::collection::vec(0.0f64..10.0, 1..12),
        n in 1u64..5000,
    ) {
        prop_assume!(raw.iter().any(|&w| w > 0.01));
        let w = normalize(&raw);
        let (ids, _) = megatron_blend(&w, n);
        let mut counts = vec![0u64; w.len()];
        for (i, &d) in ids.iter().enumerate() {
            counts[d as usize] += 1;
            let m = (i as f64).max(1.0);
            for (c, wd) in counts.iter().zip(&w) {
                prop_assert!((*c as f64 - wd * m).abs() <= 1.0 + 1e-9,
                    "after {} samples: count {} vs expected {}", m, c, wd * m);
            }
        }
    }

    /// The per-dataset bounds used to size the dataset indices before the blend exists are
    /// never below what the blend actually draws, whatever the weight history.
    #[test]
    fn sample_bounds_cover_the_blend(
        first in prop::collection::vec(0.0f64..10.0, 1..10),
        second in prop::collection::vec(0.0f64..10.0, 1..10),
        switch in 0u64..3000,
        n in 1u64..3000,
    ) {
        prop_assume!(first.iter().any(|&w| w > 0.01) && second.iter().any(|&w| w > 0.01));
        let dir = tempfile::tempdir().unwrap();
        let d = first.len().max(second.len());
        let table: Vec<String> = (0..d).map(|i| format!("d{i}")).collect();
        let mut sched = BlendSchedule::single(
            first.iter().enumerate().map(|(i, &w)| (table[i].clone(), w)).collect(),
        );
        if switch > 0 {
            sched = sched.continued(
                second.iter().enumerate().map(|(i, &w)| (table[i].clone(), w)).collect(),
                switch,
            );
        }
        let blend = Blend::build(&sched, &table, n, dir.path()).unwrap();
        let bounds = kiln_data::blend::sample_bounds(&sched, &table, n).unwrap();
        for (k, (b, t)) in bounds.iter().zip(blend.totals()).enumerate() {
            prop_assert!(*b >= t, "dataset {}: bound {} < drawn {}", k, b, t);
        }
    }

    /// Same loader output and byte-identical cache files for 1 and 4 threads.
    #[test]
    fn thread_count_does_not_matter(
        a in prop::collection::vec(1usize..150, 1..40),
        b in prop::collection::vec(1usize..150, 1..40),
        seq_len in 1usize..40,
    ) {
        let dir = tempfile::tempdir().unwrap();
        write_docs(&dir.path().join("a"), &a, DType::U16);
        write_docs(&dir.path().join("b"), &b, DType::I32);
        let list = write_list(dir.path(), "list.txt", &[(0.3, "a"), (0.7, "b")]);
        let samples = 300;
        let run = |threads: usize, cache: &str| {
            let mut c = cfg(dir.path(), seq_len, samples);
            c.cache_dir = dir.path().join(cache);
            kiln_data::with_threads(Some(threads), || {
                let l = BlendedLoader::open(&list, &c).unwrap();
                (0..samples).map(|i| l.sample(i).unwrap()).collect::<Vec<_>>()
            }).unwrap()
        };
        prop_assert_eq!(run(1, "c1"), run(4, "c4"));
        let files = |d: &str| {
            let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir.path().join(d)).unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| !p.to_string_lossy().ends_with(".lock"))
                .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap()))
                .collect();
            v.sort();
            v
        };
        prop_assert_eq!(files("c1"), files("c4"));
    }

    /// Truncated or corrupted .idx/.bin files give errors naming the file, never a panic.
    #[test]
    fn corrupt_files_error_cleanly(
        lens in prop::collection::vec(1usize..100, 1..20),
        which_idx in any::<bool>(),
        cut in any::<prop::sample::Index>(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        truncate in any::<bool>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("ds");
        write_docs(&prefix, &lens, DType::U16);
        let target = if which_idx { idx_path(&prefix) } else { bin_path(&prefix) };
        let mut bytes = std::fs::read(&target).unwrap();
        if truncate {
            let at = cut.index(bytes.len());
            bytes.truncate(at);
        } else {
            for (i, v) in &flips {
                let at = i.index(bytes.len());
                bytes[at] ^= v | 1;
            }
        }
        std::fs::write(&target, &bytes).unwrap();
        let list = write_list(dir.path(), "list.txt", &[(1.0, "ds")]);
        let name = target.file_name().unwrap().to_string_lossy().into_owned();
        let result = std::panic::catch_unwind(|| {
            let l = BlendedLoader::open(&list, &cfg(dir.path(), 16, 50))?;
            for i in 0..50 { l.sample(i)?; }
            let ds = IndexedDataset::open(&prefix)?;
            for s in 0..ds.len() { ds.sequence(s)?; }
            Ok::<(), kiln_data::DataError>(())
        });
        match result {
            Err(_) => prop_assert!(false, "panicked"),
            Ok(Err(e)) => {
                let msg = e.to_string();
                prop_assert!(msg.contains(&name) || msg.contains("ds"), "error does not name the file: {}", msg);
            }
            // A flipped byte inside token data is still a valid file; a truncated file never is.
            Ok(Ok(())) => prop_assert!(!truncate, "truncated {} was accepted", name),
        }
    }

    /// Garbage list lines are refused with the file and line, never a panic.
    #[test]
    fn bad_list_lines_name_file_and_line(junk in "[ -~]{0,40}", line in 0usize..4) {
        let mut lines = vec!["1.0 a".to_string(), "2.0 b corpus".to_string(), "# c".to_string(), "".to_string()];
        lines.insert(line, junk.clone());
        let text = lines.join("\n");
        let r = std::panic::catch_unwind(|| CorpusList::parse(&text, Path::new("x/list.txt"), Path::new("x")));
        prop_assert!(r.is_ok(), "panicked on {:?}", junk);
        if let Ok(Err(e)) = r {
            let msg = e.to_string();
            prop_assert!(msg.starts_with(&format!("x/list.txt:{}:", line + 1)), "{}", msg);
        }
    }
}

#[test]
fn weight_change_keeps_every_earlier_sample() {
    let dir = tempfile::tempdir().unwrap();
    write_docs(&dir.path().join("a"), &[50; 40], DType::U16);
    write_docs(&dir.path().join("b"), &[70; 30], DType::U16);
    write_docs(&dir.path().join("c"), &[20; 90], DType::I32);
    let list = write_list(dir.path(), "list.txt", &[(0.5, "a"), (0.5, "b")]);
    let (steps, gb) = (100u64, 8u64);
    let before = BlendedLoader::open(&list, &cfg(dir.path(), 32, steps * gb)).unwrap();
    let schedule = before.schedule().clone();
    // At step 40: reweight, and add a corpus.
    let resume_step = 40;
    let list2 = write_list(
        dir.path(),
        "list2.txt",
        &[(0.1, "a"), (0.6, "b"), (0.3, "c")],
    );
    let mut c = cfg(dir.path(), 32, steps * gb);
    c.resume = Some(Resume {
        schedule,
        at_sample: resume_step * gb,
    });
    let after = BlendedLoader::open(&list2, &c).unwrap();
    assert_eq!(after.schedule().segments.len(), 2);
    for step in 0..steps {
        for rank in 0..2 {
            let x = before.batch(step, rank, 2, 4).unwrap();
            let y = after.batch(step, rank, 2, 4).unwrap();
            if step < resume_step {
                assert_eq!(x, y, "step {step} changed");
            }
            assert!(y.iter().all(|r| r.len() == 33));
        }
    }
    let from_c = (resume_step * gb..steps * gb)
        .filter(|&i| after.source(i).unwrap().0 == 2)
        .count() as f64;
    let tail = ((steps - resume_step) * gb) as f64;
    assert!((from_c / tail - 0.3).abs() < 0.01, "{from_c}/{tail}");
    // Reopening with the same weights and history changes nothing.
    let mut c2 = c.clone();
    c2.resume = Some(Resume {
        schedule: after.schedule().clone(),
        at_sample: 70 * gb,
    });
    let again = BlendedLoader::open(&list2, &c2).unwrap();
    assert_eq!(again.schedule(), after.schedule());
}

#[test]
fn batch_addressing_and_bounds() {
    let dir = tempfile::tempdir().unwrap();
    write_docs(&dir.path().join("a"), &[33; 20], DType::U16);
    let list = write_list(dir.path(), "list.txt", &[(1.0, "a")]);
    let l = BlendedLoader::open(&list, &cfg(dir.path(), 16, 64)).unwrap();
    // step 3, rank 1 of 2, batch 4: global samples 3*8 + 4 + r.
    let rows = l.batch(3, 1, 2, 4).unwrap();
    for (r, row) in rows.iter().enumerate() {
        assert_eq!(row, &l.sample(28 + r as u64).unwrap());
    }
    assert!(
        l.batch(8, 0, 2, 4)
            .unwrap_err()
            .to_string()
            .contains("past the end")
    );
    assert!(l.batch(0, 2, 2, 4).is_err());
    assert!(l.batch(0, 0, 0, 4).is_err());
    // Different seeds give different orders.
    let mut c = cfg(dir.path(), 16, 64);
    c.seed = 8;
    let l2 = BlendedLoader::open(&list, &c).unwrap();
    assert_ne!(
        (0..64).map(|i| l.sample(i).unwrap()).collect::<Vec<_>>(),
        (0..64).map(|i| l2.sample(i).unwrap()).collect::<Vec<_>>()
    );
}

#[test]
fn missing_and_empty_datasets_name_the_list_line() {
    let dir = tempfile::tempdir().unwrap();
    write_docs(&dir.path().join("a"), &[10; 5], DType::U16);
    write_docs(&dir.path().join("empty"), &[], DType::U16);
    let list = write_list(dir.path(), "list.txt", &[(1.0, "a"), (1.0, "nope")]);
    let err = BlendedLoader::open(&list, &cfg(dir.path(), 4, 10))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("list.txt:2") && err.contains("nope.idx"),
        "{err}"
    );
    let list = write_list(dir.path(), "list2.txt", &[(1.0, "a"), (1.0, "empty")]);
    let err = BlendedLoader::open(&list, &cfg(dir.path(), 4, 10))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("list2.txt:2") && err.contains("no tokens"),
        "{err}"
    );
    // Weight 0 for the empty one is fine.
    let list = write_list(dir.path(), "list3.txt", &[(1.0, "a"), (0.0, "empty")]);
    BlendedLoader::open(&list, &cfg(dir.path(), 4, 10)).unwrap();
}

/// Regression (found while fuzzing the blend bounds): a weight-0 dataset listed first wins
/// Megatron's tie at sample 1, but its index was built for 0 samples, so step 0 failed with
/// "needs epoch 0 but the index covers 0".
#[test]
fn weight_zero_dataset_listed_first_serves_its_tie_sample() {
    let dir = tempfile::tempdir().unwrap();
    write_docs(&dir.path().join("old"), &[10; 5], DType::U16);
    write_docs(&dir.path().join("new"), &[10; 5], DType::U16);
    let list = write_list(dir.path(), "list.txt", &[(0.0, "old"), (1.0, "new")]);
    let loader = BlendedLoader::open(&list, &cfg(dir.path(), 4, 16)).unwrap();
    let rows = loader.batch(0, 0, 1, 16).unwrap();
    assert_eq!(loader.source(1).unwrap(), (0, 0), "megatron's tie rule");
    assert!(rows.iter().all(|r| r.len() == 5));
}

#[test]
fn manifest_is_enforced_by_the_loader() {
    let dir = tempfile::tempdir().unwrap();
    write_docs(&dir.path().join("a"), &[10; 5], DType::U16);
    let list = write_list(dir.path(), "list.txt", &[(1.0, "a")]);
    let mpath = kiln_data::manifest::default_path(&list);
    let mut c = cfg(dir.path(), 4, 10);
    c.verify = Verify::Fast;
    c.require_manifest = true;
    assert!(BlendedLoader::open(&list, &c).is_err());
    let m = kiln_data::Manifest::create(&[dir.path().join("a")], &mpath).unwrap();
    m.write(&mpath).unwrap();
    BlendedLoader::open(&list, &c).unwrap();
    write_docs(&dir.path().join("a"), &[10; 6], DType::U16);
    let err = BlendedLoader::open(&list, &c).unwrap_err().to_string();
    assert!(err.contains("a.idx") && err.contains("changed"), "{err}");
}

#[test]
fn cached_blend_of_many_segments_matches_reference() {
    // The greedy restarted per segment, with dataset counters carried over.
    let dir = tempfile::tempdir().unwrap();
    let table: Vec<String> = (0..4).map(|i| format!("d{i}")).collect();
    let mut sched = BlendSchedule::single(table.iter().map(|k| (k.clone(), 1.0)).collect());
    sched = sched.continued(vec![("d3".into(), 2.0), ("d0".into(), 1.0)], 1000);
    sched = sched.continued(vec![("d1".into(), 1.0), ("d2".into(), 5.0)], 5000);
    let blend = Blend::build(&sched, &table, 9001, dir.path()).unwrap();
    let mut counts = [0u64; 4];
    let mut expect = Vec::new();
    for (seg, (start, end)) in
        sched
            .segments
            .iter()
            .zip([(0u64, 1000u64), (1000, 5000), (5000, 9001)])
    {
        let ids: Vec<usize> = seg
            .weights
            .iter()
            .map(|(k, _)| table.iter().position(|t| t == k).unwrap())
            .collect();
        let w = normalize(&seg.weights.iter().map(|x| x.1).collect::<Vec<_>>());
        let (local, _) = megatron_blend(&w, end - start);
        for l in local {
            let d = ids[l as usize];
            expect.push((d, counts[d]));
            counts[d] += 1;
        }
    }
    for (i, e) in expect.iter().enumerate() {
        assert_eq!(blend.get(i as u64).unwrap(), *e, "sample {i}");
    }
    assert_eq!(blend.totals(), counts.to_vec());
}

#[test]
fn max_token_ids_are_scanned_once_and_checked_against_a_vocabulary() {
    let dir = tempfile::tempdir().unwrap();
    // tok(d, k) = d * 1000 + k: 5 documents of 10 tokens, largest id 4009.
    write_docs(&dir.path().join("a"), &[10; 5], DType::I32);
    let ds = IndexedDataset::open(&dir.path().join("a")).unwrap();
    assert_eq!(ds.scan_max_token().unwrap(), Some(4009));
    assert_eq!(ds.dtype_max_token(), i32::MAX as u64);
    let list = write_list(dir.path(), "list.txt", &[(1.0, "a")]);
    let cache = dir.path().join("cache");
    let l = BlendedLoader::open(&list, &cfg(dir.path(), 4, 10)).unwrap();
    l.check_vocab(4010, &cache).unwrap();
    let err = l.check_vocab(4009, &cache).unwrap_err().to_string();
    assert!(
        err.contains("list.txt:1")
            && err.contains("token id 4009")
            && err.contains("at least 4010"),
        "{err}"
    );
    // The scan is cached by the .bin's fingerprint.
    let cached: Vec<_> = std::fs::read_dir(&cache)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".maxtoken"))
        .collect();
    assert_eq!(cached.len(), 1);
    // A u16 dataset never needs a scan for a vocabulary of 65536 or more.
    write_docs(&dir.path().join("b"), &[3; 2], DType::U16);
    let list = write_list(dir.path(), "list2.txt", &[(1.0, "b")]);
    let l = BlendedLoader::open(&list, &cfg(dir.path(), 2, 4)).unwrap();
    l.check_vocab(65536, &dir.path().join("cache2")).unwrap();
    assert!(!dir.path().join("cache2").exists());
    // A negative id in an int32 shard is an error naming its byte.
    let mut bin = std::fs::read(bin_path(&dir.path().join("a"))).unwrap();
    bin[8..12].copy_from_slice(&(-5i32).to_le_bytes());
    std::fs::write(bin_path(&dir.path().join("a")), bin).unwrap();
    let ds = IndexedDataset::open(&dir.path().join("a")).unwrap();
    let err = ds.scan_max_token().unwrap_err().to_string();
    assert!(err.contains("byte 8 holds token -5"), "{err}");
}

#[test]
fn one_rule_picks_the_cache_dir_and_absurd_requests_are_refused() {
    use kiln_data::cache::cache_dir;
    assert_eq!(
        cache_dir(Some(Path::new("/x/c")), Path::new("/d/list.txt")),
        PathBuf::from("/x/c")
    );
    // (Without $KILN_DATA_CACHE, which the end-to-end test sets on the child.)
    if std::env::var_os("KILN_DATA_CACHE").is_none() {
        assert_eq!(
            cache_dir(Some(Path::new("")), Path::new("/d/list.txt")),
            PathBuf::from("/d/.kiln-cache")
        );
        assert_eq!(
            cache_dir(None, Path::new("list.txt")),
            PathBuf::from("./.kiln-cache")
        );
    }
    let dir = tempfile::tempdir().unwrap();
    write_docs(&dir.path().join("a"), &[10; 5], DType::U16);
    let list = write_list(dir.path(), "list.txt", &[(1.0, "a")]);
    for (seq, samples, want) in [
        (0, 10, "seq_len 0 is out of range"),
        (1 << 30, 10, "is out of range"),
        (4, 0, "0 samples is out of range"),
        (4, u64::MAX, "samples is out of range"),
        (4, 1 << 50, "needs about"),
    ] {
        let err = BlendedLoader::open(&list, &cfg(dir.path(), seq, samples))
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{seq} {samples}: {err}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// `kiln data inspect`'s numbers: counts, total tokens and nearest-rank percentiles of the
    /// sequence lengths, against a direct count; a document dump is its sequences in order.
    #[test]
    fn summary_and_documents_match_a_direct_count(
        docs in prop::collection::vec(prop::collection::vec(0usize..50, 1..4), 1..30),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("ds");
        let mut b = IndexedDatasetBuilder::create(&prefix, DType::U16).unwrap();
        let mut k = 0u32;
        let mut want_docs: Vec<Vec<u32>> = Vec::new();
        for seqs in &docs {
            let mut doc = Vec::new();
            for &len in seqs {
                let seq: Vec<u32> = (0..len).map(|_| { k = (k + 1) % 60_000; k }).collect();
                b.add_item(&seq).unwrap();
                doc.extend(&seq);
            }
            b.end_document();
            want_docs.push(doc);
        }
        b.finish().unwrap();
        let ds = IndexedDataset::open(&prefix).unwrap();
        for check in [false, true] {
            let s = kiln_data::summary::summary(&ds, check).unwrap();
            let mut lens: Vec<u32> = docs.iter().flatten().map(|&l| l as u32).collect();
            lens.sort_unstable();
            let total: u64 = lens.iter().map(|&l| u64::from(l)).sum();
            let rank = |p: f64| lens[((lens.len() - 1) as f64 * p).round() as usize];
            prop_assert_eq!(s.documents, docs.len());
            prop_assert_eq!(s.sequences, lens.len());
            prop_assert_eq!(s.tokens, total);
            prop_assert_eq!(s.checked, check);
            prop_assert_eq!((s.length.min, s.length.max), (lens[0], lens[lens.len() - 1]));
            prop_assert_eq!((s.length.p50, s.length.p90, s.length.p99), (rank(0.5), rank(0.9), rank(0.99)));
            prop_assert!((s.length.mean - total as f64 / lens.len() as f64).abs() < 1e-9);
        }
        for (d, want) in want_docs.iter().enumerate() {
            prop_assert_eq!(&ds.document(d).unwrap(), want);
        }
    }
}

/// A document index that runs backwards inside (its ends are checked when the index opens)
/// is an error naming the index file when that document is read, not a panic; so is a
/// document past the last.
#[test]
fn a_document_index_that_runs_backwards_is_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("ds");
    write_docs(&prefix, &[2, 2, 2, 2], DType::U16);
    kiln_data::indexed::write_index(&idx_path(&prefix), DType::U16, &[2; 4], &[0, 3, 1, 4])
        .unwrap();
    let ds = IndexedDataset::open(&prefix).unwrap();
    assert_eq!(ds.document(0).unwrap().len(), 6);
    let err = ds.document(1).unwrap_err().to_string();
    assert!(
        err.contains("ds.idx") && err.contains("document 1"),
        "{err}"
    );
    let err = ds.document(3).unwrap_err().to_string();
    assert!(
        err.contains("ds.idx") && err.contains("no document 3"),
        "{err}"
    );
}

/// Each dataset's part of a blend: weights normalised over the list, shares of the samples
/// drawn, and epochs as samples x seq_len over the tokens of one epoch.
#[test]
fn shares_of_a_blend_add_up_and_count_epochs() {
    let dir = tempfile::tempdir().unwrap();
    write_docs(&dir.path().join("a"), &[40; 10], DType::U16);
    write_docs(&dir.path().join("b"), &[25; 8], DType::U16);
    let list = write_list(dir.path(), "list.txt", &[(3.0, "a"), (1.0, "b")]);
    let loader = BlendedLoader::open(&list, &cfg(dir.path(), 8, 1000)).unwrap();
    let shares = loader.shares();
    assert_eq!(shares.len(), 2);
    assert_eq!((shares[0].weight, shares[1].weight), (0.75, 0.25));
    assert_eq!(shares[0].samples + shares[1].samples, 1000);
    assert!((shares[0].share + shares[1].share - 1.0).abs() < 1e-12);
    assert!((shares[0].share - 0.75).abs() < 0.01, "{:?}", shares[0]);
    for (s, tokens) in shares.iter().zip([400u64, 200]) {
        assert_eq!(s.tokens_per_epoch, tokens);
        assert!((s.epochs - s.samples as f64 * 8.0 / tokens as f64).abs() < 1e-12);
    }
}

/// An index of `lens` (one document per sequence) with a `.bin` of the size it describes
/// (sparse: the streamed passes never read tokens).
fn write_index_only(prefix: &Path, lens: &[i32]) {
    let docs: Vec<i64> = (0..=lens.len() as i64).collect();
    kiln_data::indexed::write_index(&idx_path(prefix), DType::U16, lens, &docs).unwrap();
    let tokens: i64 = lens.iter().map(|&l| l as i64).sum();
    let bin = std::fs::File::create(bin_path(prefix)).unwrap();
    bin.set_len(2 * tokens as u64).unwrap();
}

/// Overwrites the little-endian bytes of `v` at `at` in `path`.
fn patch(path: &Path, at: usize, v: &[u8]) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[at..at + v.len()].copy_from_slice(v);
    std::fs::write(path, bytes).unwrap();
}

/// The check as a sequential walk states it (the pre-streaming `check_all`), through the
/// index's own accessors: what the streamed, parallel check must report.
fn walk_check(idx: &kiln_data::indexed::IndexFile) -> Result<u64, String> {
    let path = idx.path().display();
    let mut expected = 0i64;
    let mut total = 0u64;
    for i in 0..idx.sequences() {
        let l = idx.raw_length(i);
        if l < 0 {
            return Err(format!(
                "{path}: corrupt index: sequence {i} has length {l}"
            ));
        }
        let ptr = idx.pointer(i);
        if ptr != expected {
            return Err(format!(
                "{path}: corrupt index: sequence {i} points at byte {ptr}, expected {expected}"
            ));
        }
        expected += l as i64 * 2;
        total += l as u64;
    }
    let mut prev = 0;
    for i in 0..idx.documents() + 1 {
        let d = idx.document_index(i);
        if d < prev {
            return Err(format!(
                "{path}: corrupt index: document index {i} ({d}) goes backwards from {prev}"
            ));
        }
        prev = d;
    }
    Ok(total)
}

/// The streamed check (parts in parallel, runs of 64 Ki entries) reports what the sequential
/// walk reports, whatever the thread count: the lowest-numbered bad sequence, with the
/// pointer it expected, else the first backwards document-index entry; damage placed at
/// run and part boundaries, and two damages at once (the lower is named).
#[test]
fn streamed_check_reports_what_a_sequential_walk_reports() {
    use kiln_data::indexed::{IndexFile, RUN};
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("ds");
    let n = 3 * RUN + 1234;
    let lens: Vec<i32> = (0..n).map(|i| 1 + (i * 7919 % 97) as i32).collect();
    write_index_only(&prefix, &lens);
    let idx = idx_path(&prefix);
    let pristine = std::fs::read(&idx).unwrap();
    let (lengths_at, pointers_at) = (34, 34 + 4 * n);
    let docs_at = pointers_at + 8 * n;
    let mut sites = vec![
        0,
        1,
        2,
        RUN - 1,
        RUN,
        RUN + 1,
        2 * RUN,
        n / 2,
        n / 2 + 1,
        n - 2,
    ];
    sites.extend([n / 4, n / 4 + 1, 3 * n / 4, n - 1]);
    type Damage = Box<dyn Fn(usize) -> (usize, Vec<u8>)>;
    let damages: Vec<(&str, Damage)> = vec![
        (
            "length",
            Box::new(move |i| (lengths_at + 4 * i, (-3i32).to_le_bytes().to_vec())),
        ),
        (
            "pointer",
            Box::new(move |i| (pointers_at + 8 * i, (1i64 << 40).to_le_bytes().to_vec())),
        ),
        (
            "pointer by one",
            Box::new(move |i| {
                (
                    pointers_at + 8 * i,
                    (2 * i as i64 + 1).to_le_bytes().to_vec(),
                )
            }),
        ),
        (
            "doc",
            Box::new(move |i| (docs_at + 8 * (i + 1), 0i64.to_le_bytes().to_vec())),
        ),
    ];
    let check = |threads: usize| {
        let file = IndexFile::open(&idx).map_err(|e| e.to_string())?;
        let walked = walk_check(&file);
        let streamed = kiln_data::with_threads(Some(threads), || file.check_all())
            .unwrap()
            .map_err(|e| e.to_string());
        Ok::<_, String>((walked, streamed))
    };
    for threads in [1, 2, 4] {
        let (walked, streamed) = check(threads).unwrap();
        assert_eq!(walked, streamed);
        assert_eq!(streamed, Ok(lens.iter().map(|&l| l as u64).sum()));
    }
    let mut compared = 0;
    for (what, damage) in &damages {
        for &site in &sites {
            std::fs::write(&idx, &pristine).unwrap();
            let (at, bytes) = damage(site);
            patch(&idx, at, &bytes);
            // A second damage further on: the lower one is reported.
            let (at2, bytes2) = damage((site + RUN + 17).min(n - 1));
            if at2 != at {
                patch(&idx, at2, &bytes2);
            }
            // The header's own checks (the last document entry, the last sequence's end) come
            // first for some sites; the walk and the stream must agree wherever it opens.
            let Ok((walked, streamed)) = check(2) else {
                continue;
            };
            assert!(walked.is_err(), "{what} at {site}: damage not seen");
            for threads in [1, 3, 4] {
                let (_, s) = check(threads).unwrap();
                assert_eq!(s, streamed, "{what} at {site}, {threads} threads");
            }
            assert_eq!(walked, streamed, "{what} at {site}");
            compared += 1;
        }
    }
    assert!(compared >= 48, "only {compared} damaged indices opened");
}

/// The check runs once per index (cached by its fingerprint), in the same pass that builds the
/// sample index, before any sample is served: a damaged pointer is an error naming the list
/// line, the `.idx` and the sequence; a sound index is read once (every sequence exactly once,
/// check and prefix tables together), and a reopen reads no sequence at all, nor does another
/// seed's build repeat the check.
#[test]
fn index_is_checked_once_in_the_pass_that_builds_it_and_never_on_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("ds");
    let n = 200_000;
    let lens: Vec<i32> = (0..n).map(|i| 1 + (i * 31 % 50) as i32).collect();
    write_index_only(&prefix, &lens);
    let idx = idx_path(&prefix);
    let pristine = std::fs::read(&idx).unwrap();
    let list = write_list(dir.path(), "list.txt", &[(1.0, "ds")]);
    let streamed = |l: &BlendedLoader| l.datasets()[0].index().dataset().index().streamed();

    patch(&idx, 34 + 4 * n + 8 * 5, &(1i64 << 40).to_le_bytes());
    let err = BlendedLoader::open(&list, &cfg(dir.path(), 64, 1000))
        .unwrap_err()
        .to_string();
    for want in [
        "list.txt:1",
        "ds.idx",
        "sequence 5 points at byte 1099511627776",
    ] {
        assert!(err.contains(want), "{want:?} not in {err}");
    }

    std::fs::write(&idx, &pristine).unwrap();
    let first = BlendedLoader::open(&list, &cfg(dir.path(), 64, 1000)).unwrap();
    assert_eq!(
        streamed(&first),
        n as u64,
        "one pass: checked and indexed together"
    );
    let again = BlendedLoader::open(&list, &cfg(dir.path(), 64, 1000)).unwrap();
    assert_eq!(streamed(&again), 0, "a reopen reads no sequence");
    assert_eq!(first.sample(17).unwrap(), again.sample(17).unwrap());
    // More epochs (another seed, more samples): the tables are built, the check is not
    // repeated, and the samples are those of a cold build.
    let mut more = cfg(dir.path(), 64, 40_000);
    more.seed = 9;
    let warm = BlendedLoader::open(&list, &more).unwrap();
    assert_eq!(streamed(&warm), n as u64);
    let cold_dir = tempfile::tempdir().unwrap();
    let mut cold_cfg = more.clone();
    cold_cfg.cache_dir = cold_dir.path().join("cache");
    let cold = BlendedLoader::open(&list, &cold_cfg).unwrap();
    for i in [0, 1, 999, 20_000, 39_999] {
        assert_eq!(warm.sample(i).unwrap(), cold.sample(i).unwrap());
    }
    // The verdict gone (an older cache, say), the next open checks again, and only checks.
    for f in std::fs::read_dir(dir.path().join("cache")).unwrap() {
        let p = f.unwrap().path();
        if p.extension().is_some_and(|e| e == "idxcheck") {
            std::fs::remove_file(p).unwrap();
        }
    }
    patch(&idx, 34 + 4 * (n - 3), &(-1i32).to_le_bytes());
    let err = BlendedLoader::open(&list, &cfg(dir.path(), 64, 1000))
        .unwrap_err()
        .to_string();
    let want = format!("sequence {} has length -1", n - 3);
    assert!(err.contains("list.txt:1") && err.contains(&want), "{err}");
    std::fs::write(&idx, &pristine).unwrap();
    let rechecked = BlendedLoader::open(&list, &cfg(dir.path(), 64, 1000)).unwrap();
    assert_eq!(streamed(&rechecked), n as u64);
}
