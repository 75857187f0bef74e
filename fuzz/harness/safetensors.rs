//! Fuzz harness: safetensors bytes through `kiln_train::checkpoint::from_safetensors` (what
//! `kiln eval` and resume read from `model.safetensors` / `optimizer.safetensors`).
//!
//! Parsed tensors must hold exactly the values their shape says.

use kiln_train::checkpoint::{from_safetensors, to_safetensors};
use std::path::Path;

pub fn run(data: &[u8]) {
    let path = Path::new("fuzz/model.safetensors");
    match from_safetensors(data, path) {
        Ok(tensors) => {
            for t in &tensors {
                let n = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
                assert_eq!(
                    n,
                    Some(t.values.len()),
                    "tensor {} shape {:?}",
                    t.name,
                    t.shape
                );
            }
            // What parses writes back and parses to the same tensors (bit for bit).
            let bytes = to_safetensors(&tensors).expect("serialise parsed tensors");
            let back = from_safetensors(&bytes, path).expect("parse re-serialised tensors");
            assert_eq!(back.len(), tensors.len());
            for (a, b) in back.iter().zip(&tensors) {
                assert_eq!((&a.name, &a.shape), (&b.name, &b.shape));
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a.values), bits(&b.values));
            }
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains("model.safetensors"),
                "error does not name the file: {msg}"
            );
        }
    }
}
