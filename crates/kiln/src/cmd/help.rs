//! Help text made from the tables in the libraries (kiln-run's files of a run directory and
//! exit codes, kiln-launch's endings of a launch), so that `--help` says what the code does
//! and the same as the README.

use kiln_launch::{Classification, ENDINGS};
use kiln_run::{exit, layout};

/// Width of the text the listings are wrapped to.
const WIDTH: usize = 92;

/// The files of a run directory ([`layout::entries`]), one per row: name, who writes it and
/// what it holds.
pub fn run_dir_listing() -> String {
    let rows: Vec<[String; 2]> = layout::entries()
        .into_iter()
        .map(|e| [e.name, format!("{}: {}", e.by, e.what)])
        .collect();
    listing(&rows)
}

/// The exit codes `codes` with their names and meanings ([`exit::CODES`]); a code that is
/// not in the table is left out.
pub fn exit_listing(codes: &[i32]) -> String {
    let rows: Vec<[String; 2]> = codes
        .iter()
        .filter_map(|&c| exit::code(c))
        .map(|c| [c.code.to_string(), format!("{}: {}", c.name, c.meaning)])
        .collect();
    listing(&rows)
}

/// What `kiln launch` exits with ([`kiln_launch::ENDINGS`]): code, class and meaning, one
/// row per way it ends; then which classes are retried ([`Classification::retryable`]).
pub fn launch_exit_listing() -> String {
    let rows: Vec<[String; 3]> = ENDINGS
        .iter()
        .map(|e| [e.exit.to_string(), e.name(), e.meaning().to_string()])
        .collect();
    let (retried, never): (Vec<_>, Vec<_>) =
        Classification::ALL.into_iter().partition(|c| c.retryable());
    let names = |v: Vec<Classification>| v.iter().map(|c| c.name()).collect::<Vec<_>>().join(", ");
    let retry = format!(
        "Retried (with --retries/--auto-retry): {}. Never retried: {}. A launcher that keeps \
         running after every rank left its exit record is classified by the ranks' exits, not \
         as a hang.",
        names(retried),
        names(never)
    );
    let mut out = listing(&rows);
    for line in wrap(&retry, WIDTH - 2) {
        out.push_str(&format!("\n  {line}"));
    }
    out
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

/// `N` columns, indented by two spaces, each as wide as its longest cell and two more; the
/// last is wrapped to [`WIDTH`].
fn listing<const N: usize>(rows: &[[String; N]]) -> String {
    let widths: Vec<usize> = (0..N.saturating_sub(1))
        .map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0) + 2)
        .collect();
    let width = WIDTH
        .saturating_sub(2 + widths.iter().sum::<usize>())
        .max(20);
    let mut out = String::new();
    for row in rows {
        let Some((text, cells)) = row.split_last() else {
            continue;
        };
        for (i, line) in wrap(text, width).iter().enumerate() {
            out.push_str("  ");
            for (cell, w) in cells.iter().zip(&widths) {
                let cell = if i == 0 { cell.as_str() } else { "" };
                out.push_str(&format!("{cell:<w$}"));
            }
            out.push_str(line);
            out.push('\n');
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
        let launch = launch_exit_listing();
        for e in ENDINGS {
            let (code, name) = (format!("  {} ", e.exit), format!(" {} ", e.name()));
            assert!(
                launch
                    .lines()
                    .any(|l| l.starts_with(&code) && l.contains(&name)),
                "{code}{name} in\n{launch}"
            );
        }
        let words = launch.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(words.contains("Never retried: success,"), "{launch}");
        for line in dir.lines().chain(codes.lines()).chain(launch.lines()) {
            assert!(line.len() <= WIDTH, "{line:?}");
        }
        assert_eq!(never_retried(&[0, 65, 73, 78]), "65, 73 and 78");
        assert_eq!(never_retried(&[2]), "2");
    }
}
