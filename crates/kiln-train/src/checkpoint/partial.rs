//! Reading a checkpoint without holding all of it, for the ranks of a sharded run: one rank
//! verifies every file in bounded chunks ([`verify`]), and each rank then reads only its own
//! elements of each tensor ([`load_kept`]): a file's safetensors header, then the byte
//! ranges of the pieces it keeps. A rank's memory while resuming is its own share of the
//! state, not the whole state, and its reads are its share of the files.
//!
//! The header is parsed with the `safetensors` crate's own `Metadata` (which checks that the
//! tensors' byte ranges follow each other and match their shapes and dtypes); the crate has
//! no reader for part of a file, so the ranges are read here with `pread`.

use super::checksum::{Hasher, ManifestEntry};
use super::error::{CheckpointError, invalid};
use super::format::{HostTensor, StoredDtype, decode, stored_dtype};
use super::manifest::{
    Checkpoint, MODEL_FILE, Manifest, OPTIMIZER_FILE, STATE_FILE, open_regular, parse_state,
    read_manifest, read_verified,
};
use super::region::{Assembly, Region};
use kiln_run::layout;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Which tensors of a checkpoint a name belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The weights (`model.safetensors` or its shards).
    Weights,
    /// The optimizer state (`optimizer.safetensors` or its shards).
    Optimizer,
}

/// What a loader keeps of the tensor `name` of `part`: `None` all of it (with its shape),
/// `Some(want)` the elements of `want.region` (a tensor of shape `[want.region.len()]`).
pub type Keep<'a> = &'a dyn Fn(Part, &str) -> Option<Want>;

/// The elements of a tensor a loader keeps: a region of the whole tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Want {
    /// The whole tensor's shape, which a box of it needs when the checkpoint wrote the
    /// tensor flat (pieces written as boxes say it themselves).
    pub shape: Vec<usize>,
    /// The elements kept.
    pub region: Region,
}

/// Reads a shard file's name: its rank and the rank count.
type ParseShard = fn(&str) -> Option<(usize, usize)>;

/// Largest safetensors header read (the format's own limit).
const MAX_HEADER: u64 = 100_000_000;

/// Bytes hashed per read while verifying.
const CHUNK: usize = 8 << 20;

/// Verifies `dir` against its manifest without holding its tensors: every file's size and
/// SHA-256, read in chunks of [`CHUNK`] bytes, and each tensor file's header. The checkpoint
/// comes back with its step and state and no tensors (a sharded run then reads its own
/// elements with [`load_kept`]).
pub fn verify(dir: &Path) -> Result<Checkpoint, CheckpointError> {
    let manifest = read_manifest(dir)?;
    let (step, state) = parse_state(dir, &read_verified(dir, &manifest, STATE_FILE)?)?;
    for (name, entry) in &manifest.files {
        if name == STATE_FILE {
            continue;
        }
        let path = dir.join(name);
        let (mut file, size) = open_listed(&path, entry)?;
        let mut hash = Hasher::new(entry.sum.kind());
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = file
                .read(&mut buf)
                .map_err(|e| invalid(&path, format!("unreadable: {e}")))?;
            if n == 0 {
                break;
            }
            hash.update(&buf[..n]);
        }
        if let Some(why) = entry.sum.mismatch(&hash.finish()) {
            return Err(invalid(&path, why));
        }
        header(&file, size, &path)?;
    }
    Ok(Checkpoint {
        step,
        model: Vec::new(),
        optimizer: Vec::new(),
        state,
        shards: Vec::new(),
    })
}

/// Loads from `dir` only the elements of each tensor that `keep` asks for, reading only
/// those bytes of its files (whole files or shards alike). The manifest and state are read
/// and verified; the tensor files are checked against the manifest's sizes and their
/// headers, not hashed ([`verify`] does that, on one rank). Pieces of a sharded tensor must
/// tile it, as when the whole is loaded.
pub fn load_kept(dir: &Path, keep: Keep) -> Result<Checkpoint, CheckpointError> {
    let manifest = read_manifest(dir)?;
    let (step, state) = parse_state(dir, &read_verified(dir, &manifest, STATE_FILE)?)?;
    let model = read_part(dir, &manifest, Part::Weights, keep)?;
    let optimizer = read_part(dir, &manifest, Part::Optimizer, keep)?;
    Ok(Checkpoint {
        step,
        model,
        optimizer,
        state,
        shards: Vec::new(),
    })
}

/// Opens the checkpoint file `path`, which must be the size its manifest `entry` says.
fn open_listed(path: &Path, entry: &ManifestEntry) -> Result<(File, u64), CheckpointError> {
    let (file, size) = open_regular(path)?;
    if size != entry.bytes {
        return Err(invalid(
            path,
            format!("size {size} != {} in manifest (torn write?)", entry.bytes),
        ));
    }
    Ok((file, size))
}

/// One piece of a tensor in a file: where its bytes are and which elements it holds.
struct Piece {
    file: usize,
    /// Offset of its first byte in the file.
    offset: u64,
    dtype: StoredDtype,
    /// Its shape in the file.
    shape: Vec<usize>,
    region: Region,
}

/// The tensors of `part`, each cut to what `keep` asks.
fn read_part(
    dir: &Path,
    manifest: &Manifest,
    part: Part,
    keep: Keep,
) -> Result<Vec<HostTensor>, CheckpointError> {
    let (whole, parse): (&str, ParseShard) = match part {
        Part::Weights => (MODEL_FILE, layout::parse_model_shard),
        Part::Optimizer => (OPTIMIZER_FILE, layout::parse_optimizer_shard),
    };
    let sharded = !manifest.files.contains_key(whole);
    let mut files = Vec::new();
    let mut tensors: BTreeMap<String, Vec<Piece>> = BTreeMap::new();
    let listed = manifest.files.iter().filter(|(n, _)| match sharded {
        true => parse(n).is_some(),
        false => n.as_str() == whole,
    });
    for (name, entry) in listed {
        let path = dir.join(name);
        let (file, size) = open_listed(&path, entry)?;
        let (start, meta) = header(&file, size, &path)?;
        for (tname, info) in meta.tensors() {
            let numel: usize = info.shape.iter().product();
            let (base, region) = match sharded {
                true => Region::parse(&tname, numel)
                    .map(|(b, r)| (b.to_string(), r))
                    .ok_or_else(|| {
                        invalid(
                            &path,
                            format!("tensor {tname} is not a shard piece (<name>@<where>)"),
                        )
                    })?,
                false => (tname.clone(), Region::flat(0..numel)),
            };
            tensors.entry(base).or_default().push(Piece {
                file: files.len(),
                offset: start + info.data_offsets.0 as u64,
                dtype: stored_dtype(info.dtype, &tname, &path)?,
                shape: info.shape.clone(),
                region,
            });
        }
        files.push((file, path));
    }
    tensors
        .into_iter()
        .map(|(name, pieces)| {
            let want = keep(part, &name);
            assemble(dir, &files, name, pieces, want)
        })
        .collect()
}

/// The tensor `name` (or what `want` keeps of it) from its pieces, reading only the bytes
/// of each piece that it needs: they must tile what is kept.
fn assemble(
    dir: &Path,
    files: &[(File, std::path::PathBuf)],
    name: String,
    pieces: Vec<Piece>,
    want: Option<Want>,
) -> Result<HostTensor, CheckpointError> {
    let dtype = pieces.first().map_or(StoredDtype::F32, |p| p.dtype);
    let regions: Vec<&Region> = pieces.iter().map(|p| &p.region).collect();
    let whole = super::region::whole_shape(&regions);
    let written_flat = pieces.iter().all(|p| p.region.boxed.is_none());
    let numel: usize = whole.iter().product();
    let (shape, region, out_shape) = match want {
        Some(w) => {
            let n = w.region.len();
            // A box of a tensor written flat needs the loader's shape of it.
            let shape = match written_flat && w.region.boxed.is_some() {
                true => w.shape,
                false => whole.clone(),
            };
            (shape, w.region, vec![n])
        }
        None => {
            let out = match pieces.as_slice() {
                [one] if one.region.boxed.is_none() => one.shape.clone(),
                _ => whole.clone(),
            };
            (whole.clone(), Region::flat(0..numel), out)
        }
    };
    let fault = |why: String| invalid(dir, format!("tensor {name}: {why}"));
    let fits = match &region.boxed {
        None => region.within.end <= numel,
        Some(b) => b.len() == shape.len() && b.iter().zip(&shape).all(|(r, &n)| r.end <= n),
    };
    if !fits || shape.iter().product::<usize>() != numel {
        let wanted = match &region.boxed {
            None => format!("elements {}..{}", region.within.start, region.within.end),
            Some(b) => format!("the box {}", super::region::box_text(b)),
        };
        return Err(fault(format!(
            "has {numel} elements; this run needs {wanted} of it (its shape is {whole:?})"
        )));
    }
    let mut a = Assembly::new(shape, region);
    for p in &pieces {
        let Some(part) = a.needs(&p.region) else {
            continue;
        };
        let width = p.dtype.width();
        let (file, path) = &files[p.file];
        let mut bytes = vec![0u8; part.len() * width];
        let at = p.offset + (part.start * width) as u64;
        file.read_exact_at(&mut bytes, at)
            .map_err(|e| invalid(path, format!("unreadable: {e}")))?;
        a.put(&p.region, part, &decode(&bytes, p.dtype))
            .map_err(&fault)?;
    }
    let values = a.finish().map_err(fault)?;
    Ok(HostTensor {
        name,
        shape: out_shape,
        dtype,
        values,
    })
}

/// The header of the safetensors file `file` (`size` bytes): where its data starts and what
/// it holds; an error unless the tensors' bytes end exactly at the end of the file.
fn header(
    file: &File,
    size: u64,
    path: &Path,
) -> Result<(u64, safetensors::tensor::Metadata), CheckpointError> {
    let mut len = [0u8; 8];
    file.read_exact_at(&mut len, 0)
        .map_err(|_| invalid(path, "shorter than a safetensors header"))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER || 8 + n > size {
        return Err(invalid(
            path,
            format!("safetensors header of {n} bytes in a {size}-byte file"),
        ));
    }
    let mut text = vec![0u8; n as usize];
    file.read_exact_at(&mut text, 8)
        .map_err(|e| invalid(path, format!("unreadable: {e}")))?;
    let meta: safetensors::tensor::Metadata = serde_json::from_slice(&text)
        .map_err(|e| invalid(path, format!("bad safetensors header: {e}")))?;
    let end = meta
        .tensors()
        .values()
        .map(|i| i.data_offsets.1 as u64)
        .max()
        .unwrap_or(0);
    if 8 + n + end != size {
        return Err(invalid(
            path,
            format!(
                "its tensors end at byte {}, the file has {size}",
                8 + n + end
            ),
        ));
    }
    Ok((8 + n, meta))
}

#[cfg(test)]
mod tests {
    use super::super::tests::{ckpt, sharded_ckpt};
    use super::super::{load, save};
    use super::*;

    /// A checkpoint of step 9 with weights `w` (10 elements) and their moments, in 3 shards
    /// of 4, 4 and 2 elements (or whole, in `[2, 5]`), under `root`.
    fn saved(root: &Path, sharded: bool) -> std::path::PathBuf {
        let w: Vec<f32> = (0..10).map(|i| i as f32 * 0.5).collect();
        let m: Vec<f32> = (0..10).map(|i| -(i as f32)).collect();
        if !sharded {
            let ck = Checkpoint {
                model: vec![HostTensor::f32("w".into(), vec![2, 5], w)],
                optimizer: vec![HostTensor::f32("w.exp_avg".into(), vec![10], m)],
                ..ckpt(9, "a")
            };
            return save(root, &ck.contents()).unwrap();
        }
        sharded_ckpt(root, &w, &m, &[(0, 4), (4, 4), (8, 2)])
    }

    #[test]
    fn a_rank_reads_only_its_elements_of_shards_and_whole_files_alike() {
        for sharded in [true, false] {
            let tmp = tempfile::tempdir().unwrap();
            let dir = saved(tmp.path(), sharded);
            let all = load(&dir).unwrap();
            assert_eq!(verify(&dir).unwrap().step, 9);
            // Across the shards' borders, none, and all.
            for want in [3..9, 0..0, 0..10, 9..10] {
                let keep = |_: Part, _: &str| {
                    Some(Want {
                        shape: vec![10],
                        region: Region::flat(want.clone()),
                    })
                };
                let got = load_kept(&dir, &keep).unwrap();
                assert_eq!(got.step, 9);
                for (g, a) in [
                    (&got.model[0], &all.model[0]),
                    (&got.optimizer[0], &all.optimizer[0]),
                ] {
                    assert_eq!(g.name, a.name);
                    assert_eq!(g.shape, vec![want.len()]);
                    assert_eq!(
                        g.values,
                        a.values[want.clone()],
                        "{want:?} sharded {sharded}"
                    );
                }
            }
            let whole = |_: Part, _: &str| None;
            let got = load_kept(&dir, &whole).unwrap();
            assert_eq!((got.model, got.optimizer), (all.model, all.optimizer));
            let beyond = |_: Part, _: &str| {
                Some(Want {
                    shape: vec![10],
                    region: Region::flat(5..11),
                })
            };
            let err = load_kept(&dir, &beyond).unwrap_err().to_string();
            assert!(
                err.contains("has 10 elements; this run needs elements 5..11"),
                "{err}"
            );
        }
    }

    #[test]
    fn verification_reads_every_byte_and_a_flipped_one_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = saved(tmp.path(), true);
        let shard = dir.join(layout::checkpoint_optimizer_shard(2, 3));
        let mut bytes = std::fs::read(&shard).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&shard, &bytes).unwrap();
        let err = verify(&dir).unwrap_err().to_string();
        assert!(
            err.contains("SHA-256") && err.contains("optimizer-00002-of-00003"),
            "{err}"
        );
        // A file cut short is refused by its size before any tensor is read.
        std::fs::write(&shard, &bytes[..last]).unwrap();
        let keep = |_: Part, _: &str| None;
        let err = load_kept(&dir, &keep).unwrap_err().to_string();
        assert!(err.contains("in manifest"), "{err}");
    }
}
