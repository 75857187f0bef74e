//! Fuzz harness: `--set section.key=value` overrides (`kiln_train::Config::load(None, ..)`).
//!
//! The input is the overrides, one per line. A config that loads is valid and prints as
//! TOML that loads back to the same config.

use kiln_train::Config;

pub fn run(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let overrides: Vec<String> = text.lines().take(64).map(str::to_string).collect();
    match Config::load(None, &overrides) {
        Ok(c) => {
            c.validate().expect("load returns only validated configs");
            let printed = c.to_toml();
            let back = Config::from_toml(&printed, "printed").expect("printed config parses");
            assert_eq!(back.to_toml(), printed, "printing is not a fixed point");
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}
