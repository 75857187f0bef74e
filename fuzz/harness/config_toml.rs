//! Fuzz harness: a config file (`kiln_train::Config::from_toml`, and `Config::load` of the
//! file as `kiln train CONFIG` reads it).
//!
//! A config that parses prints as TOML that parses back to the same config; `load` (which
//! validates) accepts only what `from_toml` accepts and `validate` passes.

use kiln_train::Config;

pub fn run(data: &[u8]) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("fuzz.toml");
    std::fs::write(&path, data).expect("write the input");
    let loaded = Config::load(Some(&path), &[]);
    let Ok(text) = std::str::from_utf8(data) else {
        let e = loaded.expect_err("a file that is not UTF-8 is refused");
        assert!(e.to_string().contains("fuzz.toml"), "{e}");
        return;
    };
    let parsed = Config::from_toml(text, "fuzz.toml");
    match (&parsed, &loaded) {
        (Ok(p), Ok(l)) => {
            assert_eq!(p.to_toml(), l.to_toml(), "from_toml and load disagree");
        }
        (Ok(p), Err(e)) => {
            assert!(p.validate().is_err(), "load refused a valid config: {e}");
        }
        (Err(_), Ok(_)) => panic!("load accepted what from_toml refuses"),
        (Err(e), Err(_)) => assert!(e.to_string().contains("fuzz.toml"), "{e}"),
    }
    if let Ok(c) = parsed {
        let printed = c.to_toml();
        let back = Config::from_toml(&printed, "printed").expect("printed config parses");
        assert_eq!(back.to_toml(), printed, "printing is not a fixed point");
        let _ = c.validate();
    }
}
