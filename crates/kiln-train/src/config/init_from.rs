//! `model.init_from`: the model keys a Hugging Face directory gives, resolved into the config
//! before it is read (and what stands in for them when the directory is gone).

use super::error::ConfigError;
use super::hf_config::HfShape;
use std::path::Path;

/// With `model.init_from` set, takes the model keys from the Hugging Face directory's
/// `config.json` ([`crate::config::hf_config::HfShape`]) into `table`: a key the file (`origin`) or
/// an override already sets to another value is an error naming both; `data.tokenizer`
/// defaults to the directory's `tokenizer.json`.
pub(super) fn resolve_init_from(
    table: &mut toml::Table,
    origin: &str,
    overrides: &[String],
    run_dir: Option<&Path>,
) -> Result<(), ConfigError> {
    use crate::config::hf_config as hf;
    let Some(dir) = table
        .get("model")
        .and_then(|m| m.get("init_from"))
        .and_then(toml::Value::as_str)
        .filter(|d| !d.is_empty())
        .map(str::to_string)
    else {
        return Ok(());
    };
    let invalid = |message: String| ConfigError::Invalid {
        origin: format!("model.init_from = {dir:?}"),
        message,
    };
    if !Path::new(&dir).is_dir() {
        return shape_without_init_from(table, &dir, run_dir).map_err(invalid);
    }
    let shape = hf::HfShape::read(Path::new(&dir)).map_err(|e| invalid(e.to_string()))?;
    let json = Path::new(&dir).join(hf::CONFIG_JSON);
    let model = table
        .entry("model")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
        .as_table_mut()
        .ok_or_else(|| invalid("[model] is not a table".into()))?;
    let given = Given { origin, overrides };
    let conflicts = given.merge(model, &shape, &json);
    if !conflicts.is_empty() {
        return Err(invalid(conflicts.join("; ")));
    }
    default_tokenizer(table, &Path::new(&dir).join(hf::TOKENIZER_JSON));
    Ok(())
}

/// Where the config's own model keys came from: the file `origin`, or a `--set`.
struct Given<'a> {
    origin: &'a str,
    overrides: &'a [String],
}

impl Given<'_> {
    /// Writes the model keys of `shape` (from `json`) into `model`; the keys the config set to
    /// other values, each named with where it was set.
    fn merge(&self, model: &mut toml::Table, shape: &HfShape, json: &Path) -> Vec<String> {
        let mut conflicts = Vec::new();
        for (key, value, hf_key) in shape.keys() {
            match model.get(key) {
                Some(given) if !crate::config::hf_config::same_value(given, &value) => {
                    conflicts.push(format!(
                        "{} conflicts with {hf_key} = {value} in {} (the model's shape comes from model.init_from; drop the setting or make it match)",
                        self.setter(key, given),
                        json.display()
                    ));
                }
                _ => {
                    model.insert(key.to_string(), value);
                }
            }
        }
        conflicts
    }

    /// What set `model.<key>` to `given`: its last override, else the file.
    fn setter(&self, key: &str, given: &toml::Value) -> String {
        let set = self.overrides.iter().rev().find(|o| {
            o.split_once('=')
                .is_some_and(|(k, _)| k.trim() == format!("model.{key}"))
        });
        match set {
            Some(o) => format!("--set {o}"),
            None => format!("model.{key} = {given} in {}", self.origin),
        }
    }
}

/// `data.tokenizer` defaults to the Hugging Face directory's `tokenizer.json`, when it has one.
fn default_tokenizer(table: &mut toml::Table, tokenizer: &Path) {
    let data = table
        .entry("data")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
        .as_table_mut();
    if let Some(data) = data
        && !data.contains_key("tokenizer")
        && tokenizer.is_file()
    {
        data.insert(
            "tokenizer".into(),
            toml::Value::String(tokenizer.display().to_string()),
        );
    }
}

/// The model's shape when `model.init_from`'s directory `dir` is gone (only a fresh start
/// reads its weights; a run resuming from its checkpoint needs only the shape): the keys of
/// a config that recorded them (`table` itself: a run's `config.toml`), else those the run in
/// `run_dir` recorded when it started from `dir`. An error saying so when neither has them.
fn shape_without_init_from(
    table: &mut toml::Table,
    dir: &str,
    run_dir: Option<&Path>,
) -> Result<(), String> {
    use crate::config::hf_config::HfShape;
    let model = |t: &toml::Table| t.get("model").and_then(toml::Value::as_table).cloned();
    let has_shape = |m: &toml::Table| HfShape::KEYS.iter().all(|k| m.contains_key(*k));
    if model(table).is_some_and(|m| has_shape(&m)) {
        return Ok(());
    }
    let recorded_path = run_dir.map(|d| d.join(kiln_run::layout::CONFIG));
    let recorded = (recorded_path.as_ref())
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|text| toml::from_str::<toml::Table>(&text).ok())
        .and_then(|t| model(&t))
        .filter(|m| m.get("init_from").and_then(toml::Value::as_str) == Some(dir))
        .filter(has_shape);
    let Some(recorded) = recorded else {
        return Err(format!(
            "{dir} is not a directory: a fresh start reads its weights and config.json; a run that started from it resumes without it (its run directory's config.toml recorded the model's shape: the same command with that --run-dir, or `kiln train RUN_DIR/config.toml`)"
        ));
    };
    let given = model(table).unwrap_or_default();
    let mut merged = given.clone();
    for key in HfShape::KEYS {
        match (given.get(key), recorded.get(key)) {
            (Some(g), Some(r)) if g != r => {
                return Err(format!(
                    "model.{key} = {g} differs from {r}, which the run recorded from {dir} in {} (the folder is gone; drop the setting or make it match)",
                    recorded_path.map_or_else(String::new, |p| p.display().to_string())
                ));
            }
            (None, Some(r)) => {
                merged.insert(key.to_string(), r.clone());
            }
            _ => {}
        }
    }
    table.insert("model".into(), toml::Value::Table(merged));
    Ok(())
}
