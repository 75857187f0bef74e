//! Which elements of a tensor a checkpoint piece holds, or a reader wants ([`Region`]), and
//! how a tensor is put together from pieces written by any layout ([`Assembly`]).
//!
//! A piece is named `<name>@<where>`:
//! - `@<start>`: elements `start..start + len` of the whole tensor read flat (row-major): what
//!   the data-parallel ranks of a sharded state write;
//! - `@<box>`: the box `a:b,c:d` of the whole tensor (one range a dim), row-major: a tensor-
//!   parallel rank's share of a matrix;
//! - `@<box>@<start>`: elements `start..start + len` of that box read flat: a
//!   data-parallel rank's range of a tensor-parallel rank's box.
//!
//! Any set of pieces that tiles a tensor can be read into any other region of it, so a
//! checkpoint resumes on any layout; a gap or an overlap rejects the checkpoint.

use std::ops::Range;

/// Where a piece's (or a reader's) elements lie in the whole tensor (see the module
/// documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Region {
    /// The box, per dim a range of the whole tensor (`None`: the whole tensor, read flat).
    pub boxed: Option<Vec<Range<usize>>>,
    /// The elements of the box (row-major) it holds.
    pub within: Range<usize>,
}

impl Region {
    /// Elements `range` of the whole tensor read flat.
    pub fn flat(range: Range<usize>) -> Self {
        Self {
            boxed: None,
            within: range,
        }
    }

    /// Elements `within` of `boxed` (row-major).
    pub fn boxed(boxed: Vec<Range<usize>>, within: Range<usize>) -> Self {
        Self {
            boxed: Some(boxed),
            within,
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.within.len()
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.within.is_empty()
    }

    /// The piece name of `base`'s elements in this region.
    pub fn name(&self, base: &str) -> String {
        match &self.boxed {
            None => format!("{base}@{}", self.within.start),
            Some(b) if self.within.start == 0 && self.within.len() == volume(b) => {
                format!("{base}@{}", box_text(b))
            }
            Some(b) => format!("{base}@{}@{}", box_text(b), self.within.start),
        }
    }

    /// `<base>@<where>` of a piece of `len` elements read back (`None`: not a piece name).
    pub fn parse(name: &str, len: usize) -> Option<(&str, Region)> {
        let (base, at) = name.split_once('@')?;
        let (boxed, start) = match at.split_once('@') {
            Some((b, s)) => (Some(parse_box(b)?), s.parse::<usize>().ok()?),
            None if at.contains(':') => (Some(parse_box(at)?), 0),
            None => (None, at.parse::<usize>().ok()?),
        };
        let within = start..start.checked_add(len)?;
        if let Some(b) = &boxed
            && within.end > volume(b)
        {
            return None;
        }
        Some((base, Region { boxed, within }))
    }

    /// The box in the whole tensor of shape `shape` (the whole tensor when flat).
    fn box_in(&self, shape: &[usize]) -> Vec<Range<usize>> {
        match &self.boxed {
            Some(b) => b.clone(),
            None => shape.iter().map(|&n| 0..n).collect(),
        }
    }
}

/// The whole shape of a tensor written as pieces of `regions`: the ends of their boxes, or
/// when it was written flat, the end of its last piece.
pub fn whole_shape(regions: &[&Region]) -> Vec<usize> {
    let boxes: Vec<&Vec<Range<usize>>> = regions.iter().filter_map(|r| r.boxed.as_ref()).collect();
    match boxes.iter().map(|b| b.len()).max() {
        Some(n) => (0..n)
            .map(|d| {
                boxes
                    .iter()
                    .map(|b| b.get(d).map_or(0, |r| r.end))
                    .max()
                    .unwrap_or(0)
            })
            .collect(),
        None => vec![regions.iter().map(|r| r.within.end).max().unwrap_or(0)],
    }
}

/// Elements of a box.
fn volume(b: &[Range<usize>]) -> usize {
    b.iter().map(Range::len).product()
}

/// A box as `a:b,c:d`.
pub fn box_text(b: &[Range<usize>]) -> String {
    b.iter()
        .map(|r| format!("{}:{}", r.start, r.end))
        .collect::<Vec<_>>()
        .join(",")
}

fn parse_box(text: &str) -> Option<Vec<Range<usize>>> {
    text.split(',')
        .map(|r| {
            let (a, b) = r.split_once(':')?;
            let (a, b) = (a.parse().ok()?, b.parse().ok()?);
            (a <= b).then_some(a..b)
        })
        .collect()
}

/// Calls `f(first, len)` for each run of `boxed` in the row-major layout of a tensor of
/// `shape`: one run per index of every dim but the last, in order.
pub fn for_each_row(shape: &[usize], boxed: &[Range<usize>], mut f: impl FnMut(usize, usize)) {
    rows(boxed, |index, last| {
        let row = index.iter().zip(shape).fold(0, |acc, (&i, &n)| acc * n + i);
        f(
            row * shape.last().copied().unwrap_or(1) + last.start,
            last.len(),
        );
    });
}

/// Calls `f(index, last)` for each row of `boxed`: the index of every dim but the last, and
/// the range of the last.
fn rows(boxed: &[Range<usize>], mut f: impl FnMut(&[usize], &Range<usize>)) {
    let Some((last, outer)) = boxed.split_last() else {
        f(&[], &(0..1));
        return;
    };
    if boxed.iter().any(|r| r.is_empty()) {
        return;
    }
    let mut index: Vec<usize> = outer.iter().map(|r| r.start).collect();
    loop {
        f(&index, last);
        // The next index, the last outer dim fastest.
        let mut d = outer.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < outer[d].end {
                break;
            }
            index[d] = outer[d].start;
        }
    }
}

/// The row-major offset in `boxed` of the element at `index` (outer dims) and `col` (last).
fn offset_in(boxed: &[Range<usize>], index: &[usize], col: usize) -> usize {
    let (last, outer) = boxed.split_last().unwrap_or((&(0..1), &[]));
    let row = (index.iter().zip(outer)).fold(0, |acc, (&i, r)| acc * r.len() + (i - r.start));
    row * last.len() + (col - last.start)
}

/// A region of one tensor being filled from pieces: what a reader wants and which of its
/// elements the pieces have given (a gap or an overlap is the checkpoint's fault).
pub struct Assembly {
    /// The whole tensor's shape.
    shape: Vec<usize>,
    want: Region,
    values: Vec<f32>,
    seen: Vec<bool>,
}

impl Assembly {
    /// `want` of a tensor of `shape`.
    pub fn new(shape: Vec<usize>, want: Region) -> Self {
        let n = want.len();
        Self {
            shape,
            want,
            values: vec![0.0; n],
            seen: vec![false; n],
        }
    }

    /// The elements of the piece `from` that the wanted region holds, as a range of the
    /// piece's elements (the smallest one covering them; `None`: none).
    pub fn needs(&self, from: &Region) -> Option<Range<usize>> {
        if let (None, None) = (&from.boxed, &self.want.boxed) {
            let (lo, hi) = (
                from.within.start.max(self.want.within.start),
                from.within.end.min(self.want.within.end),
            );
            return (lo < hi).then(|| lo - from.within.start..hi - from.within.start);
        }
        let (a, b) = (from.box_in(&self.shape), self.want.box_in(&self.shape));
        let meets = a
            .iter()
            .zip(&b)
            .all(|(x, y)| x.start.max(y.start) < x.end.min(y.end));
        (meets && a.len() == b.len() && !from.is_empty()).then(|| 0..from.len())
    }

    /// Copies the elements `values` of `from` (its elements `part`, as [`Assembly::needs`]
    /// said) into the wanted region; `Err` names the first element given twice.
    pub fn put(&mut self, from: &Region, part: Range<usize>, values: &[f32]) -> Result<(), String> {
        let (a, b) = (from.box_in(&self.shape), self.want.box_in(&self.shape));
        if a.len() != b.len() || a.iter().zip(&self.shape).any(|(r, &n)| r.end > n) {
            return Err(format!(
                "a piece's box {} does not fit the tensor's shape {:?}",
                box_text(&a),
                self.shape
            ));
        }
        let common: Vec<Range<usize>> = (a.iter().zip(&b))
            .map(|(x, y)| x.start.max(y.start)..x.end.min(y.end))
            .collect();
        // Its elements `part` are those of `from.within` shifted by `part.start`.
        let have = from.within.start + part.start..from.within.start + part.end;
        let mut twice = None;
        let want = self.want.within.clone();
        rows(&common, |index, last| {
            let (src, dst) = (
                offset_in(&a, index, last.start),
                offset_in(&b, index, last.start),
            );
            // The run's elements k with src + k in `have` and dst + k in `want`.
            let lo = (have.start.saturating_sub(src)).max(want.start.saturating_sub(dst));
            let hi = (have.end.saturating_sub(src))
                .min(want.end.saturating_sub(dst))
                .min(last.len());
            if lo >= hi {
                return;
            }
            let (s, d) = (src + lo - have.start, dst + lo - want.start);
            let n = hi - lo;
            if let Some(k) = self.seen[d..d + n].iter().position(|&x| x) {
                twice.get_or_insert(d + k);
            }
            self.seen[d..d + n].fill(true);
            self.values[d..d + n].copy_from_slice(&values[s..s + n]);
        });
        match twice {
            Some(at) => Err(format!("element {at} of the region read is in two pieces")),
            None => Ok(()),
        }
    }

    /// The wanted elements; `Err` names the first that no piece gave.
    pub fn finish(self) -> Result<Vec<f32>, String> {
        match self.seen.iter().position(|s| !s) {
            Some(at) => Err(format!(
                "element {at} of the region read is in no piece (its pieces do not tile it)"
            )),
            None => Ok(self.values),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_a_three_dim_box_are_in_row_major_order() {
        let mut runs = Vec::new();
        for_each_row(&[2, 3, 4], &[1..2, 0..2, 1..3], |at, n| runs.push((at, n)));
        assert_eq!(runs, vec![(13, 2), (17, 2)]);
        let mut none = 0;
        for_each_row(&[2, 3], &[0..0, 0..3], |_, _| none += 1);
        assert_eq!(none, 0);
    }

    #[test]
    fn names_are_read_back() {
        for (region, len) in [
            (Region::flat(17..20), 3),
            (Region::boxed(vec![0..4, 2..4], 0..8), 8),
            (Region::boxed(vec![0..4, 2..4], 3..6), 3),
        ] {
            let name = region.name("w");
            assert_eq!(
                Region::parse(&name, len),
                Some(("w", region.clone())),
                "{name}"
            );
        }
        assert_eq!(Region::boxed(vec![0..4, 2..4], 0..8).name("w"), "w@0:4,2:4");
        assert_eq!(Region::parse("w", 3), None);
        assert_eq!(Region::parse("w@x", 3), None);
        assert_eq!(Region::parse("w@0:2,0:2@3", 2), None, "past the box");
        assert_eq!(Region::parse("w@3:1", 2), None, "a backward range");
    }

    /// A [4, 6] tensor written as column boxes of 2 ranks, each cut flat over 3 more: read
    /// back whole, as row boxes, and as a flat range, every element comes from its piece.
    #[test]
    fn pieces_of_any_layout_fill_any_region() {
        let shape = vec![4, 6];
        let whole: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let mut pieces = Vec::new();
        for c in 0..2 {
            let boxed = vec![0..4, 3 * c..3 * c + 3];
            let mut vals = Vec::new();
            for_each_row(&shape, &boxed, |at, n| {
                vals.extend_from_slice(&whole[at..at + n])
            });
            for (lo, hi) in [(0, 5), (5, 10), (10, 12)] {
                let r = Region::boxed(boxed.clone(), lo..hi);
                pieces.push((r, vals[lo..hi].to_vec()));
            }
        }
        let read = |pieces: &[(Region, Vec<f32>)], want: Region| {
            let mut a = Assembly::new(shape.clone(), want);
            for (r, v) in pieces {
                if let Some(part) = a.needs(r) {
                    a.put(r, part.clone(), &v[part]).unwrap();
                }
            }
            a.finish()
        };
        assert_eq!(read(&pieces, Region::flat(0..24)).unwrap(), whole);
        assert_eq!(read(&pieces, Region::flat(7..9)).unwrap(), whole[7..9]);
        let rows = read(&pieces, Region::boxed(vec![2..4, 0..6], 0..12)).unwrap();
        assert_eq!(rows, whole[12..24]);
        let inner = read(&pieces, Region::boxed(vec![1..3, 2..5], 1..4)).unwrap();
        assert_eq!(inner, vec![9.0, 10.0, 14.0]);
        // Without the last piece, the region it held is a gap.
        pieces.pop();
        let err = read(&pieces, Region::flat(0..24)).unwrap_err();
        assert!(err.contains("in no piece"), "{err}");
        // A piece given twice is an overlap.
        let mut a = Assembly::new(shape.clone(), Region::flat(0..24));
        let (r, v) = &pieces[0];
        a.put(r, 0..5, v).unwrap();
        assert!(a.put(r, 0..5, v).unwrap_err().contains("two pieces"));
    }
}
