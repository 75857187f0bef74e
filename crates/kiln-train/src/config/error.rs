//! What goes wrong loading a config: a file that cannot be read, TOML that does not parse or
//! names an unknown key, a malformed `--set`, values out of their domain (every one named),
//! a run too big for the machine. Every one exits 78.

/// Errors loading or overriding a config.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("config {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The TOML is malformed, has an unknown key or a value of the wrong type.
    #[error("config {origin}: {message}")]
    Invalid {
        /// The file, or `--set` for overrides.
        origin: String,
        /// What is wrong (toml's message names the key and line).
        message: String,
    },
    /// A `--set` override is not `section.key=value`.
    #[error("--set {0:?}: expected section.key=value (for example training.steps=100)")]
    BadOverride(String),
    /// Values out of their domain (range, sign, finiteness), or keys that contradict each
    /// other; every offending key is listed with its value and what is allowed.
    #[error("config: {}", join_domains(.0))]
    OutOfDomain(Vec<OutOfDomain>),
    /// The run cannot fit in this machine's memory (see [`crate::budget`]).
    #[error("config: {0}")]
    TooBig(String),
}

impl kiln_run::exit::ExitCoded for ConfigError {
    /// A config that cannot be read or is wrong is invalid input: 78, never retried.
    fn exit_code(&self) -> i32 {
        kiln_run::exit::CONFIG
    }
}

fn join_domains(v: &[OutOfDomain]) -> String {
    v.iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

/// One key whose value is outside its domain.
#[derive(Debug, Clone, PartialEq)]
pub struct OutOfDomain {
    /// `section.key`, or empty for a rule between keys.
    pub key: String,
    /// The value as given.
    pub value: String,
    /// What is allowed (or, for a rule, what is wrong).
    pub allowed: String,
}

impl std::fmt::Display for OutOfDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.key.is_empty() {
            write!(f, "{}", self.allowed)
        } else {
            write!(f, "{} = {}: must be {}", self.key, self.value, self.allowed)
        }
    }
}
