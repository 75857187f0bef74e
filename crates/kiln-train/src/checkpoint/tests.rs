use super::manifest::read_manifest;
use super::*;
use kiln_run::layout;
use std::path::{Path, PathBuf};

pub(crate) fn ckpt(step: u64, run_id: &str) -> Checkpoint {
    Checkpoint {
        step,
        model: vec![HostTensor::f32("w".into(), vec![2], vec![1.0, step as f32])],
        optimizer: vec![HostTensor::f32(
            "w.exp_avg".into(),
            vec![2],
            vec![0.5, 0.25],
        )],
        state: serde_json::json!({"step": step, "run_id": run_id}),
        shards: Vec::new(),
    }
}

/// A checkpoint of step 9 under `root` whose weights `w` and moments `w.exp_avg` (values
/// `w`, `m`) are in one shard per `(first element, elements)` of `cuts`, each written by
/// its rank; the path it is published at.
pub(crate) fn sharded_ckpt(root: &Path, w: &[f32], m: &[f32], cuts: &[(usize, usize)]) -> PathBuf {
    let piece = |name: &str, v: &[f32], at: usize, n: usize| {
        HostTensor::f32(format!("{name}@{at}"), vec![n], v[at..at + n].to_vec())
    };
    let ranks = cuts.len();
    let shards: Vec<ShardFile> = (cuts.iter().enumerate())
        .flat_map(|(r, &(at, n))| {
            let (wp, mp) = (piece("w", w, at, n), piece("w.exp_avg", m, at, n));
            [
                write_shard(root, 9, layout::checkpoint_model_shard(r, ranks), &[wp]).unwrap(),
                write_shard(root, 9, layout::checkpoint_optimizer_shard(r, ranks), &[mp]).unwrap(),
            ]
        })
        .collect();
    let ck = Checkpoint {
        model: Vec::new(),
        optimizer: Vec::new(),
        shards,
        ..ckpt(9, "a")
    };
    save(root, &ck.contents()).unwrap()
}

fn flip_last_byte(f: &Path) {
    let mut bytes = std::fs::read(f).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(f, bytes).unwrap();
}

/// The temporary directories (`.tmp-...`) under `root`.
fn leftovers(root: &Path) -> Vec<String> {
    std::fs::read_dir(root)
        .unwrap()
        .filter_map(|e| Some(e.ok()?.file_name().to_str()?.to_string()))
        .filter(|n| n.starts_with(".tmp-"))
        .collect()
}

/// Issue 46: a write that failed (on a full disk) left `.tmp-step-<N>-<pid>` behind, so
/// the retry on the same disk failed at once. Here the failure comes after the weights
/// and moments were written: a staged shard file is gone.
#[test]
fn a_failed_save_removes_its_temporary_directory() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    save(root, &ckpt(4, "a").contents()).unwrap();
    let gone = ShardFile {
        name: "extra.safetensors".into(),
        path: root.join("staged-elsewhere/extra.safetensors"),
        entry: ManifestEntry {
            sum: Checksum::Sha256(String::new()),
            bytes: 0,
        },
    };
    let ck = Checkpoint {
        shards: vec![gone],
        ..ckpt(8, "a")
    };
    let err = save(root, &ck.contents()).unwrap_err().to_string();
    assert!(err.contains("staged-elsewhere"), "{err}");
    assert_eq!(leftovers(root), Vec::<String>::new());
    assert_eq!(list_steps(root), vec![4], "the published one stays");
    // The same step saves once the cause is gone.
    save(root, &ckpt(8, "a").contents()).unwrap();
    assert_eq!(list_steps(root), vec![8, 4]);
}

/// Issue 60: a writer SIGKILLed mid-save left `.tmp-step-<N>-<pid>` (and a replace its
/// `.old-...`) for ever, since only the current process's were removed. The next owner
/// of the directory removes every one, whoever wrote it, and says how much.
#[test]
fn opening_removes_the_temporary_folders_of_killed_writers() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    save(root, &ckpt(4, "a").contents()).unwrap();
    for name in [".tmp-step-8-4242", ".tmp-step-12-77", ".old-step-4-4242"] {
        std::fs::create_dir_all(root.join(name)).unwrap();
        std::fs::write(root.join(name).join("model.safetensors"), [0u8; 100]).unwrap();
    }
    let opened = CheckpointStore::open(root, 3, true, "b").unwrap();
    assert_eq!(leftovers(root), Vec::<String>::new());
    assert!(!root.join(".old-step-4-4242").exists());
    let names: Vec<String> = (opened.reclaimed.iter())
        .map(|(p, _)| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [".old-step-4-4242", ".tmp-step-12-77", ".tmp-step-8-4242"]
    );
    assert!(opened.reclaimed.iter().all(|(_, b)| *b == 100));
    assert_eq!(
        opened.resume.map(|(_, c)| c.step),
        Some(4),
        "the checkpoint stays"
    );
}

#[test]
fn save_load_round_trip_and_corruption_falls_back() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    save(root, &ckpt(10, "a").contents()).unwrap();
    save(root, &ckpt(20, "a").contents()).unwrap();
    let (_, c) = load_latest_valid(root, |_, _| panic!("no rejection expected")).unwrap();
    assert_eq!(c.step, 20);
    assert_eq!(c.model, ckpt(20, "a").model);
    flip_last_byte(&root.join("step-20/model.safetensors"));
    let mut rejected = Vec::new();
    let (_, c) =
        load_latest_valid(root, |p, r| rejected.push((p.to_path_buf(), r.to_string()))).unwrap();
    assert_eq!(c.step, 10);
    assert_eq!(rejected.len(), 1);
    assert!(rejected[0].1.contains("SHA-256"), "{}", rejected[0].1);
}

/// A parameter-sharded checkpoint: both ranks' weight and optimizer pieces, assembled
/// on load; a lost weights shard, or the whole weights listed beside their shards, is
/// refused naming the file set.
#[test]
fn weight_shards_assemble_and_an_incomplete_set_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let saved = sharded_ckpt(root, &[1.0, 2.0], &[0.5, 0.5], &[(0, 1), (1, 1)]);
    assert!(!saved.join(MODEL_FILE).exists());
    let back = load(&saved).unwrap();
    assert_eq!(
        back.model,
        vec![HostTensor::f32("w".into(), vec![2], vec![1.0, 2.0])]
    );
    assert_eq!(back.optimizer[0].values, vec![0.5, 0.5]);
    // The whole weights beside their shards.
    let manifest_path = saved.join(MANIFEST_FILE);
    let mut manifest = read_manifest(&saved).unwrap();
    let entry = manifest.files[&layout::checkpoint_model_shard(0, 2)].clone();
    manifest.files.insert(MODEL_FILE.into(), entry);
    std::fs::write(&manifest_path, serde_json::to_vec(&manifest).unwrap()).unwrap();
    let err = load(&saved).unwrap_err().to_string();
    assert!(
        err.contains("lists both model.safetensors and shards"),
        "{err}"
    );
    // A lost weights shard.
    manifest.files.remove(MODEL_FILE);
    manifest.files.remove(&layout::checkpoint_model_shard(1, 2));
    std::fs::write(&manifest_path, serde_json::to_vec(&manifest).unwrap()).unwrap();
    let err = load(&saved).unwrap_err().to_string();
    assert!(
        err.contains("1 of the 2 shards of model.safetensors (missing ranks [1]"),
        "{err}"
    );
}

#[test]
fn bf16_tensors_keep_their_dtype_and_other_dtypes_are_named() {
    let w = HostTensor {
        name: "w".into(),
        shape: vec![3],
        dtype: StoredDtype::Bf16,
        values: vec![1.0, -0.00390625, 3.140625],
    };
    let m = HostTensor::f32("m".into(), vec![1], vec![0.1]);
    let bytes = to_safetensors(&[w.clone(), m.clone()]).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("w").unwrap().dtype(), safetensors::Dtype::BF16);
    assert_eq!(st.tensor("w").unwrap().data().len(), 6);
    let back = from_safetensors(&bytes, Path::new("x")).unwrap();
    assert_eq!(back, vec![m, w]);
    // An f16 tensor is refused by name, not misread.
    let f16 =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F16, vec![1], &[0, 60]).unwrap();
    let bytes = safetensors::serialize([("h", f16)], &None).unwrap();
    let err = from_safetensors(&bytes, Path::new("x.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tensor h has dtype F16") && err.contains("x.safetensors"),
        "{err}"
    );
}

#[test]
fn manifest_may_name_only_the_formats_files_and_never_special_ones() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let ck = save(root, &ckpt(1, "a").contents()).unwrap();
    let manifest_path = ck.join(MANIFEST_FILE);
    let good = std::fs::read_to_string(&manifest_path).unwrap();
    for evil in ["../../../../etc/hostname", "/dev/zero", "sub/x", ".."] {
        let m = good.replace("\"state.json\"", &format!("{evil:?}"));
        std::fs::write(&manifest_path, m).unwrap();
        let err = load(&ck).unwrap_err().to_string();
        assert!(
            err.contains("not a file of a kiln checkpoint"),
            "{evil}: {err}"
        );
    }
    std::fs::write(&manifest_path, &good).unwrap();
    // A listed file replaced by a link to a device or by a FIFO is refused, not read.
    let state = ck.join(STATE_FILE);
    std::fs::remove_file(&state).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &state).unwrap();
    let err = load(&ck).unwrap_err().to_string();
    assert!(err.contains("symbolic link"), "{err}");
    std::fs::remove_file(&state).unwrap();
    nix::unistd::mkfifo(&state, nix::sys::stat::Mode::S_IRWXU).unwrap();
    let err = load(&ck).unwrap_err().to_string();
    assert!(err.contains("not a regular file"), "{err}");
}

#[test]
fn retention_keeps_k_of_its_lineage_and_moves_foreign_and_corrupt_aside() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    // Another run's checkpoints at higher steps, one of them corrupt.
    for s in [40, 50, 60] {
        save(root, &ckpt(s, "other").contents()).unwrap();
    }
    flip_last_byte(&root.join("step-60/model.safetensors"));
    let opened = CheckpointStore::open(root, 2, false, "mine").unwrap();
    assert!(opened.resume.is_none());
    assert_eq!(opened.rejected.len(), 3, "{:?}", opened.rejected);
    let mut m = opened.manager;
    for s in [10, 20, 30] {
        let report = m.save(&ckpt(s, "mine").contents()).unwrap();
        assert!(
            report.pruned.iter().all(|p| !p.ends_with(dir_name(s))),
            "pruned what it just saved: {report:?}"
        );
    }
    assert_eq!(list_steps(root), vec![30, 20]);
    let aside: Vec<_> = std::fs::read_dir(root.join("rejected"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(aside.len(), 3, "{aside:?}");
}

#[test]
fn resume_adopts_the_lineage_and_a_rollback_supersedes_newer_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    for s in [10, 20, 30] {
        save(root, &ckpt(s, "r1").contents()).unwrap();
    }
    flip_last_byte(&root.join("step-30/optimizer.safetensors"));
    let opened = CheckpointStore::open(root, 3, true, "new").unwrap();
    assert_eq!(opened.resume.as_ref().unwrap().1.step, 20);
    assert_eq!(opened.manager.run_id(), "r1");
    assert_eq!(opened.rejected.len(), 1);
    let mut m = opened.manager;
    // Saving step 15 (after an in-memory rollback) moves step 20 aside, keeps 10.
    let report = m.save(&ckpt(15, "r1").contents()).unwrap();
    assert_eq!(report.superseded.len(), 1);
    assert_eq!(list_steps(root), vec![15, 10]);
}
