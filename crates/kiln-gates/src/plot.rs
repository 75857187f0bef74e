//! Line plots as SVG and PNG with `plotters`: a grid of panels, each with one or more series.
//!
//! Text in the PNG needs a TrueType font, found at run time: `$KILN_FONT`, else DejaVu Sans
//! at the usual system paths (Debian/Ubuntu package `fonts-dejavu-core`). Without one (or
//! with `KILN_FONT` set empty) the plots are still drawn, without any text (a warning says so).

use crate::GatesError;
use plotters::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// One curve.
#[derive(Debug, Clone, Default)]
pub struct Series {
    /// Legend name.
    pub name: String,
    /// (x, y) points; non-finite ones are dropped.
    pub points: Vec<(f64, f64)>,
}

/// One chart of the grid.
#[derive(Debug, Clone, Default)]
pub struct Panel {
    /// Caption.
    pub title: String,
    /// X axis description.
    pub x_label: String,
    /// Logarithmic x axis (values must be positive).
    pub log_x: bool,
    /// Logarithmic y axis (values must be positive).
    pub log_y: bool,
    /// The curves.
    pub series: Vec<Series>,
    /// Vertical marker lines (x, label).
    pub markers: Vec<(f64, String)>,
}

const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
];

/// Registers a font for plot text once per process; returns whether one is available.
pub fn font_available() -> bool {
    static FONT: OnceLock<bool> = OnceLock::new();
    *FONT.get_or_init(|| {
        if std::env::var_os("KILN_FONT").is_some_and(|v| v.is_empty()) {
            return false; // KILN_FONT= (empty): plots without text
        }
        let candidates: Vec<PathBuf> = std::env::var_os("KILN_FONT")
            .map(PathBuf::from)
            .into_iter()
            .chain(FONT_PATHS.iter().map(PathBuf::from))
            .collect();
        for p in candidates {
            if let Ok(bytes) = std::fs::read(&p) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        tracing::warn!(
            "no TrueType font found (set KILN_FONT or install fonts-dejavu-core): plots have no text"
        );
        false
    })
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

fn range(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    let mut lo = f64::INFINITY;
    let mut hi = f64::NEG_INFINITY;
    for v in values.filter(|v| v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return None;
    }
    if hi - lo < 1e-12 * hi.abs().max(1e-12) {
        let pad = (hi.abs() * 0.05).max(1e-6);
        return Some((lo - pad, hi + pad));
    }
    let pad = (hi - lo) * 0.04;
    Some((lo - pad, hi + pad))
}

fn log_label(v: f64) -> String {
    let x = 10f64.powf(v);
    format!("{x:.0e}")
}

/// The chart of one panel: linear axes over the (transformed) data's ranges.
type Chart<'a, DB> = ChartContext<
    'a,
    DB,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    panels: &[Panel],
    cols: usize,
    text: bool,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let root = if text && !title.is_empty() {
        root.titled(title, ("sans-serif", 22))
            .map_err(|e| e.to_string())?
    } else {
        root
    };
    let cols = cols.max(1);
    let rows = panels.len().div_ceil(cols).max(1);
    let areas = root.split_evenly((rows, cols));
    for (panel, area) in panels.iter().zip(areas) {
        draw_panel(&area, panel, text)?;
    }
    root.present().map_err(|e| e.to_string())
}

impl Panel {
    /// `x` on the panel's axis (its log when the axis is logarithmic).
    fn tx(&self, x: f64) -> f64 {
        if self.log_x { x.log10() } else { x }
    }

    /// `y` on the panel's axis.
    fn ty(&self, y: f64) -> f64 {
        if self.log_y { y.log10() } else { y }
    }

    /// A tick label of the x axis at axis value `v`.
    fn x_tick(&self, v: f64) -> String {
        if self.log_x {
            log_label(v)
        } else if v.abs() >= 1e4 {
            format!("{v:.1e}")
        } else {
            format!("{v}")
        }
    }

    /// A tick label of the y axis at axis value `v`.
    fn y_tick(&self, v: f64) -> String {
        if self.log_y {
            log_label(v)
        } else if v.abs() >= 1e4 || (v.abs() < 1e-2 && v != 0.0) {
            format!("{v:.1e}")
        } else if v.abs() >= 100.0 {
            format!("{v:.0}")
        } else if v.abs() >= 1.0 {
            format!("{v:.2}")
        } else {
            format!("{v:.3}")
        }
    }
}

/// One panel in `area`: its series, markers and (with `text`) captions and legend.
fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    panel: &Panel,
    text: bool,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let pts: Vec<Vec<(f64, f64)>> = panel
        .series
        .iter()
        .map(|s| {
            s.points
                .iter()
                .map(|&(x, y)| (panel.tx(x), panel.ty(y)))
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .collect()
        })
        .collect();
    let xr = range(pts.iter().flatten().map(|p| p.0));
    let yr = range(pts.iter().flatten().map(|p| p.1));
    let (Some(xr), Some(yr)) = (xr, yr) else {
        if text {
            let what = format!("{}: no data", panel.title);
            area.draw(&Text::new(what, (20, 20), ("sans-serif", 14)))
                .map_err(|e| e.to_string())?;
        }
        return Ok(());
    };
    let mut builder = ChartBuilder::on(area);
    builder.margin(8);
    if text {
        builder
            .caption(&panel.title, ("sans-serif", 16))
            .x_label_area_size(32)
            .y_label_area_size(56);
    }
    let mut chart = builder
        .build_cartesian_2d(xr.0..xr.1, yr.0..yr.1)
        .map_err(|e| e.to_string())?;
    let (xf, yf) = (|v: &f64| panel.x_tick(*v), |v: &f64| panel.y_tick(*v));
    let mut mesh = chart.configure_mesh();
    mesh.x_label_formatter(&xf).y_label_formatter(&yf);
    if text {
        mesh.x_desc(panel.x_label.as_str())
            .label_style(("sans-serif", 11));
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw().map_err(|e| e.to_string())?;
    let legend = text && panel.series.len() > 1;
    for (i, (s, p)) in panel.series.iter().zip(&pts).enumerate() {
        let color = COLORS[i % COLORS.len()];
        let drawn = chart
            .draw_series(LineSeries::new(p.iter().copied(), color.stroke_width(2)))
            .map_err(|e| e.to_string())?;
        if legend {
            drawn.label(s.name.as_str()).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
            });
        }
    }
    draw_markers(&mut chart, panel, yr, text)?;
    if legend {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 11))
            .draw()
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The panel's vertical markers across the y range `yr`, labelled with `text`.
fn draw_markers<DB: DrawingBackend>(
    chart: &mut Chart<'_, DB>,
    panel: &Panel,
    yr: (f64, f64),
    text: bool,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    for (x, label) in &panel.markers {
        let x = panel.tx(*x);
        if !x.is_finite() {
            continue;
        }
        chart
            .draw_series(LineSeries::new(
                vec![(x, yr.0), (x, yr.1)],
                RED.mix(0.6).stroke_width(1),
            ))
            .map_err(|e| e.to_string())?;
        let at = (x, yr.1 - (yr.1 - yr.0) * 0.08);
        label_at(chart, text, label.clone(), at, &RED)?;
    }
    Ok(())
}

/// Draws `panels` in a grid of `cols` columns to `stem.svg` and `stem.png`; returns both paths.
pub fn write_plots(
    stem: &Path,
    title: &str,
    panels: &[Panel],
    cols: usize,
) -> Result<(PathBuf, PathBuf), GatesError> {
    let rows = panels.len().div_ceil(cols.max(1)).max(1) as u32;
    let size = (480 * cols.max(1) as u32, 320 * rows + 40);
    let svg = stem.with_extension("svg");
    let png = stem.with_extension("png");
    if let Some(parent) = stem.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(crate::io_err(parent))?;
    }
    let text = font_available();
    draw(
        SVGBackend::new(&svg, size).into_drawing_area(),
        title,
        panels,
        cols,
        text,
    )
    .map_err(|message| GatesError::Plot {
        path: svg.clone(),
        message,
    })?;
    draw(
        BitMapBackend::new(&png, size).into_drawing_area(),
        title,
        panels,
        cols,
        text,
    )
    .map_err(|message| GatesError::Plot {
        path: png.clone(),
        message,
    })?;
    Ok((svg, png))
}

/// Colors of the ledger buckets, in [`kiln_run::ledger::Buckets::rows`] order.
const BUCKET_COLORS: [(&str, RGBColor); 8] = [
    (kiln_run::ledger::bucket::PRODUCTIVE, RGBColor(44, 160, 44)),
    (kiln_run::ledger::bucket::STARTUP, RGBColor(31, 119, 180)),
    (
        kiln_run::ledger::bucket::CHECKPOINT_STALL,
        RGBColor(148, 103, 189),
    ),
    (kiln_run::ledger::bucket::LOST_WORK, RGBColor(214, 39, 40)),
    (kiln_run::ledger::bucket::DETECTION, RGBColor(255, 127, 14)),
    (kiln_run::ledger::bucket::BACKOFF, RGBColor(188, 189, 34)),
    (kiln_run::ledger::bucket::QUEUE, RGBColor(127, 127, 127)),
    (kiln_run::ledger::bucket::OTHER, RGBColor(200, 200, 200)),
];

fn bucket_color(kind: &str) -> RGBColor {
    BUCKET_COLORS
        .iter()
        .find(|(k, _)| *k == kind)
        .map_or(RGBColor(200, 200, 200), |(_, c)| *c)
}

fn draw_timeline<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    l: &kiln_run::ledger::Ledger,
    text: bool,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let root = if text {
        root.titled(
            &format!("{title}: ETTR {:.1} %", l.ettr() * 100.0),
            ("sans-serif", 20),
        )
        .map_err(e)?
    } else {
        root
    };
    let (top, bottom) = root.split_vertically(root.dim_in_pixel().1 * 2 / 3);
    draw_attempts(&top, l, text)?;
    draw_band(&bottom, l, text)?;
    root.present().map_err(e)
}

/// The timeline's upper chart: the steps each attempt reached over wall time, its failures
/// (red) and the node swaps (blue).
fn draw_attempts<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    l: &kiln_run::ledger::Ledger,
    text: bool,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    let total = l.total.max(1e-3);
    let top = l.attempts.iter().filter_map(|a| a.steps.1).max();
    let max_step = top.unwrap_or(1).max(1) as f64;
    let mut b = ChartBuilder::on(area);
    b.margin(10);
    if text {
        b.caption(
            "steps reached per attempt; failures (red) and node swaps",
            ("sans-serif", 15),
        )
        .x_label_area_size(30)
        .y_label_area_size(56);
    }
    let mut chart = b
        .build_cartesian_2d(0.0..total, 0.0..max_step * 1.1)
        .map_err(e)?;
    let mut mesh = chart.configure_mesh();
    if text {
        mesh.x_desc("wall time (s)")
            .y_desc("step")
            .label_style(("sans-serif", 11));
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw().map_err(e)?;
    for (i, a) in l.attempts.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        if let (Some((from, to)), (start, Some(last))) = (a.work, a.steps) {
            let s0 = start.unwrap_or(last) as f64;
            let path = vec![(a.from, s0), (from, s0), (to, last as f64)];
            chart
                .draw_series(LineSeries::new(path, color.stroke_width(2)))
                .map_err(e)?;
        }
        if a.classification == "success" {
            continue;
        }
        let line = vec![(a.to, 0.0), (a.to, max_step * 1.05)];
        chart
            .draw_series(LineSeries::new(line, RED.mix(0.7).stroke_width(1)))
            .map_err(e)?;
        let label = match a.culprits.is_empty() {
            true => a.classification.clone(),
            false => format!("{} ({})", a.classification, a.culprits.join(",")),
        };
        let at = (a.to, max_step * (1.05 - 0.07 * (i % 3) as f64));
        label_at(&mut chart, text, label, at, &RED)?;
    }
    for s in &l.swaps {
        chart
            .draw_series(std::iter::once(Circle::new((s.at, 0.0), 5, BLUE.filled())))
            .map_err(e)?;
        let label = format!(
            "{} -> {}{}",
            s.host,
            s.replacement.as_deref().unwrap_or("dropped"),
            if s.blind { " (blind)" } else { "" }
        );
        label_at(&mut chart, text, label, (s.at, max_step * 0.06), &BLUE)?;
    }
    Ok(())
}

/// Writes `label` at `at` in `color` when there is `text`.
fn label_at<DB: DrawingBackend>(
    chart: &mut Chart<'_, DB>,
    text: bool,
    label: String,
    at: (f64, f64),
    color: &RGBColor,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    if !text {
        return Ok(());
    }
    let font = ("sans-serif", 11).into_font().color(color);
    chart
        .draw_series(std::iter::once(Text::new(label, at, font)))
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// The timeline's lower band: where the wall time went (the ledger's spans), with a legend
/// of each bucket's share.
fn draw_band<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    l: &kiln_run::ledger::Ledger,
    text: bool,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    let total = l.total.max(1e-3);
    let mut b = ChartBuilder::on(area);
    b.margin(10);
    if text {
        b.caption("where the wall time went", ("sans-serif", 15))
            .x_label_area_size(30)
            .y_label_area_size(56);
    }
    let mut band = b.build_cartesian_2d(0.0..total, 0.0..3.0).map_err(e)?;
    let mut mesh = band.configure_mesh();
    mesh.disable_y_mesh().y_labels(0);
    if text {
        mesh.x_desc("wall time (s)").label_style(("sans-serif", 11));
    } else {
        mesh.x_labels(0);
    }
    mesh.draw().map_err(e)?;
    let rect = |from: f64, to: f64, kind: &str| {
        Rectangle::new([(from, 1.8), (to, 2.8)], bucket_color(kind).filled())
    };
    let other = rect(0.0, total, kiln_run::ledger::bucket::OTHER);
    let spans = l.spans.iter().map(|s| rect(s.from, s.to, s.kind));
    band.draw_series(std::iter::once(other).chain(spans))
        .map_err(e)?;
    if !text {
        return Ok(());
    }
    // The legend: two rows of four, each a swatch and "name share".
    for (i, (name, secs)) in l.buckets.rows().into_iter().enumerate() {
        let x = total * (i % 4) as f64 / 4.0;
        let y = if i < 4 { 1.0 } else { 0.2 };
        band.draw_series(std::iter::once(Rectangle::new(
            [(x, y), (x + total * 0.015, y + 0.5)],
            bucket_color(name).filled(),
        )))
        .map_err(e)?;
        band.draw_series(std::iter::once(Text::new(
            format!("{name} {:.1}% ({secs:.1} s)", 100.0 * secs / total),
            (x + total * 0.02, y + 0.55),
            ("sans-serif", 12),
        )))
        .map_err(e)?;
    }
    Ok(())
}

/// Draws a run's timeline (steps per attempt over wall time, failures, swaps, and the goodput
/// ledger as a band) to `stem.svg` and `stem.png`.
pub fn write_timeline(
    stem: &Path,
    title: &str,
    ledger: &kiln_run::ledger::Ledger,
) -> Result<(PathBuf, PathBuf), GatesError> {
    let size = (1200, 720);
    let svg = stem.with_extension("svg");
    let png = stem.with_extension("png");
    if let Some(parent) = stem.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(crate::io_err(parent))?;
    }
    let text = font_available();
    draw_timeline(
        SVGBackend::new(&svg, size).into_drawing_area(),
        title,
        ledger,
        text,
    )
    .map_err(|message| GatesError::Plot {
        path: svg.clone(),
        message,
    })?;
    draw_timeline(
        BitMapBackend::new(&png, size).into_drawing_area(),
        title,
        ledger,
        text,
    )
    .map_err(|message| GatesError::Plot {
        path: png.clone(),
        message,
    })?;
    Ok((svg, png))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_svg_and_png() {
        let dir = tempfile::tempdir().unwrap();
        let panels = vec![
            Panel {
                title: "loss".into(),
                x_label: "step".into(),
                series: vec![
                    Series {
                        name: "train".into(),
                        points: (1..50).map(|i| (i as f64, 3.0 / i as f64)).collect(),
                    },
                    Series {
                        name: "eval".into(),
                        points: vec![(10.0, 0.5), (40.0, 0.1)],
                    },
                ],
                ..Default::default()
            },
            Panel {
                title: "lr".into(),
                x_label: "lr".into(),
                log_x: true,
                series: vec![Series {
                    name: "x".into(),
                    points: vec![(1e-5, 1.0), (1e-3, 2.0), (1e-1, 0.5)],
                }],
                markers: vec![(1e-3, "here".into())],
                ..Default::default()
            },
            Panel {
                title: "empty".into(),
                ..Default::default()
            },
        ];
        let (svg, png) = write_plots(&dir.path().join("p"), "test", &panels, 2).unwrap();
        assert!(std::fs::read_to_string(svg).unwrap().contains("<svg"));
        let bytes = std::fs::read(png).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
    }

    #[test]
    fn writes_a_timeline() {
        let dir = tempfile::tempdir().unwrap();
        let events: Vec<kiln_run::Event> = [
            r#"{"time":0.0,"source":"launch","event":"attempt_end","start_time":0.0,"end_time":10.0,"first_advance_time":1.0,"last_advance_time":9.0,"classification":"hung-stalled","start_step":0,"last_progress":90,"culprit_hosts":["n2"]}"#,
            r#"{"time":10.0,"source":"launch","event":"node_swap","host":"n2","replacement":"n4","cause":"hang"}"#,
            r#"{"time":20.0,"source":"launch","event":"attempt_end","start_time":10.5,"end_time":20.0,"first_advance_time":11.0,"last_advance_time":20.0,"classification":"success","start_step":50,"last_progress":150}"#,
        ]
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
        let l = kiln_run::ledger::ledger(&events);
        let (svg, png) = write_timeline(&dir.path().join("t"), "run", &l).unwrap();
        assert!(std::fs::read_to_string(svg).unwrap().contains("<svg"));
        assert_eq!(&std::fs::read(png).unwrap()[1..4], b"PNG");
    }
}
