// Empty: a build script makes cargo resolve this crate's [build-dependencies], so that the
// host side (build scripts, proc macros) is unified as well. See `Cargo.toml`.
fn main() {}
