//! Help text made from kiln-run's tables (the files of a run directory, the exit codes), so
//! that `--help` says what the code does and the same as the README.

use kiln_run::{exit, layout};

/// Width of the text the listings are wrapped to.
const WIDTH: usize = 92;

/// The files of a run directory ([`layout::entries`]), one per row: name, who writes it and
/// what it holds.
pub fn run_dir_listing() -> String {
    let rows: Vec<(String, String)> = layout::entries()
        .into_iter()
        .map(|e| (e.name, format!("{}: {}", e.by, e.what)))
        .collect();
    listing(&rows)
}

/// The exit codes `codes` with their names and meanings ([`exit::CODES`]); a code that is
/// not in the table is left out.
pub fn exit_listing(codes: &[i32]) -> String {
    let rows: Vec<(String, String)> = codes
        .iter()
        .filter_map(|&c| exit::code(c))
        .map(|c| (c.code.to_string(), format!("{}: {}", c.name, c.meaning)))
        .collect();
    listing(&rows)
}

/// Those of `codes` that `kiln launch` never retries, as `65, 73 and 78`.
pub fn never_retried(codes: &[i32]) -> String {
    let names: Vec<String> = codes
        .iter()
        .filter(|&&c| exit::is_deterministic(c))
        .map(i32::to_string)
        .collect();
    match names.split_last() {
        None => String::new(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
    }
}

/// Two columns, indented by two spaces; the second is wrapped to [`WIDTH`].
fn listing(rows: &[(String, String)]) -> String {
    let first = rows.iter().map(|r| r.0.len()).max().unwrap_or(0) + 2;
    let width = WIDTH.saturating_sub(2 + first).max(20);
    let mut out = String::new();
    for (name, text) in rows {
        for (i, line) in wrap(text, width).iter().enumerate() {
            let name = if i == 0 { name.as_str() } else { "" };
            out.push_str(&format!("  {name:<first$}{line}\n"));
        }
    }
    out.truncate(out.trim_end().len());
    out
}

/// `text` in lines of at most `width` characters, broken at spaces (a longer word stands
/// alone on its line).
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.len() + 1 + word.len() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    lines.push(line);
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listings_hold_every_row_within_the_width() {
        let dir = run_dir_listing();
        for e in layout::entries() {
            assert!(dir.contains(&format!("  {} ", e.name)), "{}", e.name);
        }
        let codes = exit_listing(&[exit::SUCCESS, exit::CONFIG]);
        assert!(
            codes.starts_with("  0 ") && codes.contains("\n  78 "),
            "{codes}"
        );
        for line in dir.lines().chain(codes.lines()) {
            assert!(line.len() <= WIDTH, "{line:?}");
        }
        assert_eq!(never_retried(&[0, 65, 73, 78]), "65, 73 and 78");
        assert_eq!(never_retried(&[2]), "2");
    }
}
