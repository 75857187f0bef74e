//! Slurm hostlist expansion: `nid[001-003,007],x1000c0s[1-2]b0n0` -> one name per host.
//!
//! Grammar (what `scontrol show hostnames` accepts): items separated by commas outside brackets;
//! an item is literal text mixed with bracket groups `[a-b,c,...]`; several groups in one item
//! expand as a cartesian product with the leftmost group varying slowest. A range keeps the
//! width of its lower bound (`[08-10]` -> `08 09 10`), as Slurm does.

/// The most hosts one expression may expand to: a typo such as `[0-999999999]` must be an
/// error, not an attempt to allocate gigabytes.
pub const MAX_HOSTS: usize = 1 << 20;

/// Why a hostlist expression could not be expanded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("hostlist {expr:?}: {message} (at byte {offset})")]
pub struct HostlistError {
    /// The whole expression.
    pub expr: String,
    /// 0-based byte offset of the problem.
    pub offset: usize,
    /// What is wrong.
    pub message: String,
}

/// One piece of an item: literal text or the expanded values of a bracket group.
enum Piece {
    Text(String),
    Group(Vec<String>),
}

/// Expands a Slurm hostlist expression into host names, in order (duplicates are kept).
pub fn expand_hostlist(expr: &str) -> Result<Vec<String>, HostlistError> {
    let err = |offset: usize, message: String| HostlistError {
        expr: expr.to_string(),
        offset,
        message,
    };
    let mut hosts = Vec::new();
    let bytes = expr.as_bytes();
    let mut start = 0;
    let mut depth = 0usize;
    // Split on commas at depth 0.
    let mut items = Vec::new();
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b'[' if depth > 0 => return Err(err(i, "nested '[' is not allowed".into())),
            b'[' => depth += 1,
            b']' if depth == 0 => return Err(err(i, "']' without a matching '['".into())),
            b']' => depth -= 1,
            b',' if depth == 0 => {
                items.push((start, &expr[start..i]));
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(err(expr.len(), "'[' is never closed".into()));
    }
    items.push((start, &expr[start..]));
    for (offset, item) in items {
        let item_trimmed = item.trim();
        if item_trimmed.is_empty() {
            if expr.trim().is_empty() {
                return Err(err(0, "empty hostlist".into()));
            }
            return Err(err(offset, "empty host name between commas".into()));
        }
        let pieces = parse_item(item, offset).map_err(|(o, m)| err(o, m))?;
        let mut names = vec![String::new()];
        for piece in pieces {
            names = match piece {
                Piece::Text(t) => names.into_iter().map(|n| n + &t).collect(),
                Piece::Group(values) => {
                    let total = names.len().saturating_mul(values.len());
                    if total.saturating_add(hosts.len()) > MAX_HOSTS {
                        return Err(err(
                            offset,
                            format!("expands to more than {MAX_HOSTS} hosts"),
                        ));
                    }
                    names
                        .iter()
                        .flat_map(|n| values.iter().map(move |v| format!("{n}{v}")))
                        .collect()
                }
            };
        }
        if hosts.len() + names.len() > MAX_HOSTS {
            return Err(err(
                offset,
                format!("expands to more than {MAX_HOSTS} hosts"),
            ));
        }
        hosts.extend(names);
    }
    Ok(hosts)
}

/// Parses one comma-free (at depth 0) item into literal text and bracket groups.
fn parse_item(item: &str, base: usize) -> Result<Vec<Piece>, (usize, String)> {
    let mut pieces = Vec::new();
    let mut rest = item;
    let mut pos = base;
    while !rest.is_empty() {
        match rest.find('[') {
            None => {
                check_text(rest.trim(), pos)?;
                pieces.push(Piece::Text(rest.trim().to_string()));
                break;
            }
            Some(open) => {
                let text = &rest[..open];
                // Leading whitespace before the first piece is tolerated (", nid[1-2]").
                let text = if pieces.is_empty() {
                    text.trim_start()
                } else {
                    text
                };
                check_text(text, pos)?;
                if !text.is_empty() {
                    pieces.push(Piece::Text(text.to_string()));
                }
                // `find` cannot fail: the caller checked that every '[' is closed.
                let close = rest[open..]
                    .find(']')
                    .map(|c| c + open)
                    .ok_or((pos + open, "unclosed '['".to_string()))?;
                let body = &rest[open + 1..close];
                pieces.push(Piece::Group(expand_group(body, pos + open + 1)?));
                pos += close + 1;
                rest = &rest[close + 1..];
            }
        }
    }
    Ok(pieces)
}

/// Host-name characters are letters, digits, '-', '.', '_' (RFC 1123 plus '_', which some
/// sites use); anything else is almost surely a typo worth reporting.
fn check_text(text: &str, pos: usize) -> Result<(), (usize, String)> {
    match text
        .char_indices()
        .find(|(_, c)| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_')))
    {
        Some((i, c)) => Err((
            pos + i,
            format!("unexpected character {c:?} in a host name"),
        )),
        None => Ok(()),
    }
}

/// Expands the inside of one bracket group: `001-003,007`.
fn expand_group(body: &str, base: usize) -> Result<Vec<String>, (usize, String)> {
    let mut values = Vec::new();
    let mut offset = base;
    for part in body.split(',') {
        let at = offset;
        offset += part.len() + 1;
        let part_t = part.trim();
        if part_t.is_empty() {
            return Err((at, "empty range in brackets".into()));
        }
        let (lo, hi) = match part_t.split_once('-') {
            Some((lo, hi)) => (lo.trim(), hi.trim()),
            None => (part_t, part_t),
        };
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(lo) || !digits(hi) {
            return Err((
                at,
                format!("range {part_t:?} is not N or N-M with decimal digits"),
            ));
        }
        let too_big = || (at, format!("range {part_t:?} has a number too large"));
        let lo_n: u64 = lo.parse().map_err(|_| too_big())?;
        let hi_n: u64 = hi.parse().map_err(|_| too_big())?;
        if lo_n > hi_n {
            return Err((at, format!("range {part_t:?} runs backwards")));
        }
        let count = (hi_n - lo_n).saturating_add(1);
        if count > MAX_HOSTS as u64 || values.len() as u64 + count > MAX_HOSTS as u64 {
            return Err((
                at,
                format!("range {part_t:?} expands to more than {MAX_HOSTS} hosts"),
            ));
        }
        let width = lo.len();
        values.extend((lo_n..=hi_n).map(|n| format!("{n:0width$}")));
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn expands_the_issue_example() {
        let hosts = expand_hostlist("nid[001-003,007],x1000c0s[1-2]b0n0").unwrap();
        assert_eq!(
            hosts,
            [
                "nid001",
                "nid002",
                "nid003",
                "nid007",
                "x1000c0s1b0n0",
                "x1000c0s2b0n0"
            ]
        );
    }

    #[test]
    fn several_groups_are_a_cartesian_product_leftmost_slowest() {
        let hosts = expand_hostlist("r[1-2]n[08-10]").unwrap();
        assert_eq!(
            hosts,
            ["r1n08", "r1n09", "r1n10", "r2n08", "r2n09", "r2n10"]
        );
    }

    #[test]
    fn plain_names_and_single_values() {
        assert_eq!(expand_hostlist("a,b.c,d-e").unwrap(), ["a", "b.c", "d-e"]);
        assert_eq!(expand_hostlist("n[5]").unwrap(), ["n5"]);
        assert_eq!(expand_hostlist("n[9-11]").unwrap(), ["n9", "n10", "n11"]);
    }

    #[test]
    fn malformed_expressions_say_where() {
        for (expr, needle) in [
            ("", "empty hostlist"),
            ("a,,b", "empty host name"),
            ("n[1-3", "never closed"),
            ("n1-3]", "without a matching"),
            ("n[[1]]", "nested"),
            ("n[3-1]", "backwards"),
            ("n[a-b]", "decimal digits"),
            ("n[1,]", "empty range"),
            ("n[0-99999999999]", "more than"),
            ("bad host", "unexpected character"),
        ] {
            let e = expand_hostlist(expr).unwrap_err().to_string();
            assert!(e.contains(needle), "{expr:?}: {e}");
        }
    }

    /// A bracket group as (lo, count, width): rendered `[lo-hi]` zero-padded to width.
    fn group() -> impl Strategy<Value = (u64, u64, usize)> {
        (0u64..200, 1u64..5, 1usize..4)
    }

    proptest! {
        #[test]
        fn expansion_matches_a_naive_model(
            items in prop::collection::vec(
                ("[a-z]{1,4}", prop::collection::vec((group(), "[a-z]{0,2}"), 0..3)),
                1..4,
            )
        ) {
            let mut expr_items = Vec::new();
            let mut expected = Vec::new();
            for (prefix, groups) in &items {
                let mut text = prefix.clone();
                let mut names = vec![prefix.clone()];
                for ((lo, count, width), suffix) in groups {
                    let hi = lo + count - 1;
                    let w = *width;
                    text += &format!("[{lo:0w$}-{hi:0w$}]{suffix}");
                    let lo_width = format!("{lo:0w$}").len();
                    names = names
                        .iter()
                        .flat_map(|n| (*lo..=hi).map(move |v| format!("{n}{v:0lo_width$}{suffix}")))
                        .collect();
                }
                expr_items.push(text);
                expected.extend(names);
            }
            let expr = expr_items.join(",");
            prop_assert_eq!(expand_hostlist(&expr).unwrap(), expected);
        }

        #[test]
        fn never_panics_on_arbitrary_input(s in ".{0,40}") {
            let _ = expand_hostlist(&s);
        }

        #[test]
        fn bracket_soup_never_panics(s in "[a-c0-9\\[\\],\\- ]{0,30}") {
            let _ = expand_hostlist(&s);
        }
    }
}
