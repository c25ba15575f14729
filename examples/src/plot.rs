//! Time-to-answer plots: one empirical CDF per series on a logarithmic time
//! axis, p50 and p99 marked on each curve, and a legend table under the
//! chart with each series' count and percentiles, as SVG and PNG (plotters).
//!
//! Text needs a TrueType font: the PNG is rasterised here, and the SVG's
//! layout is measured with the same font. [`FONT_PATHS`] lists where one is
//! looked for (Debian's `fonts-dejavu-core`, which `scripts/test.sh`
//! installs where it is missing); `KVTIER_PLOT_FONT` names another.

use std::error::Error;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::{FontStyle, register_font};

use crate::percentile_of_sorted;

/// Where a sans-serif TrueType font is looked for, in order.
pub const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
];

/// One curve: a name and its samples in milliseconds.
#[derive(Debug, Clone)]
pub struct Series {
    /// Shown in the legend, with the sample count and percentiles.
    pub name: String,
    /// Time to answer, in milliseconds.
    pub samples_ms: Vec<f64>,
}

/// Finds and registers the font the plot's text needs (once per process),
/// so that a missing font is known before any work is done.
///
/// # Errors
/// Where a font was looked for, and how to provide one.
pub fn check_font() -> Result<(), String> {
    ensure_font()
}

/// Registers the first font found as "sans-serif" (once per process).
fn ensure_font() -> Result<(), String> {
    static FONT: OnceLock<Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let candidates: Vec<PathBuf> = std::env::var_os("KVTIER_PLOT_FONT")
            .map(PathBuf::from)
            .into_iter()
            .chain(FONT_PATHS.iter().map(PathBuf::from))
            .collect();
        for path in &candidates {
            let Ok(bytes) = std::fs::read(path) else {
                continue;
            };
            // plotters keeps the font for the whole process.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            return register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| format!("{} is not a TrueType font", path.display()));
        }
        Err(format!(
            "no TrueType font for the plot's text: looked in {} (install Debian's \
             fonts-dejavu-core, or set KVTIER_PLOT_FONT to a .ttf file)",
            candidates
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })
    .clone()
}

/// The two files [`write_cdf`] writes for `base`: `base.svg` and `base.png`
/// (an extension of `base`, if any, is replaced).
pub fn output_paths(base: &Path) -> (PathBuf, PathBuf) {
    (base.with_extension("svg"), base.with_extension("png"))
}

/// Checks, before any work is done, that [`write_cdf`] can write its files
/// for `base`: the directory exists or can be made, and both files can be
/// opened for writing (a file made by this check is removed again).
///
/// # Errors
/// Which file or directory is the problem, and why.
pub fn check_output(base: &Path) -> Result<(), String> {
    if let Some(dir) = base.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create the directory {}: {e}", dir.display()))?;
    }
    let (svg, png) = output_paths(base);
    for path in [svg, png] {
        let existed = path.exists();
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        if !existed {
            let _ = std::fs::remove_file(&path);
        }
    }
    Ok(())
}

/// Writes the plot as `base.svg` and `base.png` (see [`output_paths`]) and
/// returns both paths.
///
/// # Errors
/// No font found, or a file or directory that cannot be written.
pub fn write_cdf(
    base: &Path,
    title: &str,
    series: &[Series],
) -> Result<(PathBuf, PathBuf), Box<dyn Error>> {
    ensure_font()?;
    if let Some(dir) = base.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let (svg, png) = output_paths(base);
    let curves = Curve::all(series);
    let size = (WIDTH, CHART_HEIGHT + legend_height(curves.len()));
    draw(
        SVGBackend::new(&svg, size).into_drawing_area(),
        title,
        &curves,
    )?;
    draw(
        BitMapBackend::new(&png, size).into_drawing_area(),
        title,
        &curves,
    )?;
    Ok((svg, png))
}

const WIDTH: u32 = 960;
const CHART_HEIGHT: u32 = 560;
const LEGEND_ROW: u32 = 22;

/// The legend table: a header row, a row per series, and a margin.
fn legend_height(rows: usize) -> u32 {
    LEGEND_ROW * (u32::try_from(rows).unwrap_or(u32::MAX / 64) + 1) + 16
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// One series ready to draw: its finite, positive samples sorted, its
/// colour and its marks.
struct Curve<'a> {
    name: &'a str,
    sorted: Vec<f64>,
    color: RGBColor,
    width: u32,
    p50: f64,
    p99: f64,
}

impl<'a> Curve<'a> {
    fn all(series: &'a [Series]) -> Vec<Self> {
        series
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let mut sorted: Vec<f64> = s
                    .samples_ms
                    .iter()
                    .copied()
                    .filter(|v| v.is_finite() && *v > 0.0)
                    .collect();
                sorted.sort_by(f64::total_cmp);
                // The first series (all requests) is drawn in black and thicker.
                let (color, width) = match i.checked_sub(1) {
                    None => (BLACK, 3),
                    Some(k) => (COLORS[k % COLORS.len()], 2),
                };
                Curve {
                    name: &s.name,
                    p50: percentile_of_sorted(&sorted, 0.5),
                    p99: percentile_of_sorted(&sorted, 0.99),
                    sorted,
                    color,
                    width,
                }
            })
            .collect()
    }

    /// The share of samples at or below `v`: where a mark at `v` sits on
    /// the curve.
    fn at(&self, v: f64) -> f64 {
        self.sorted.partition_point(|&s| s <= v) as f64 / self.sorted.len().max(1) as f64
    }
}

fn draw<DB>(
    root: DrawingArea<DB, Shift>,
    title: &str,
    curves: &[Curve<'_>],
) -> Result<(), Box<dyn Error>>
where
    DB: DrawingBackend,
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let (upper, lower) = root.split_vertically(CHART_HEIGHT);
    let (lo, hi) = curves
        .iter()
        .flat_map(|c| c.sorted.first().into_iter().chain(c.sorted.last()))
        .fold((f64::MAX, f64::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let (lo, hi) = if lo <= hi {
        (lo / 1.5, hi * 1.5)
    } else {
        (0.01, 10.0) // no samples: an empty, labelled frame
    };
    let mut chart = ChartBuilder::on(&upper)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        // A little room above 1 keeps the marks at the top inside the frame.
        .build_cartesian_2d((lo..hi).log_scale(), 0f64..1.04)?;
    // Each tick carries its own unit (µs, ms or s), so the title names none.
    chart
        .configure_mesh()
        .x_desc("time to answer (log scale)")
        .y_desc("fraction of requests answered")
        .x_label_formatter(&|v| format_ms(*v))
        .y_labels(6)
        .y_label_formatter(&|v| format!("{v:.1}"))
        .axis_desc_style(("sans-serif", 16))
        .label_style(("sans-serif", 13))
        .draw()?;
    // The two levels the marks sit on, named once at the left edge.
    let guide = RGBColor(150, 150, 150);
    for (level, name) in [(0.5, "p50"), (0.99, "p99")] {
        chart.draw_series(LineSeries::new(
            [(lo, level), (hi, level)],
            guide.stroke_width(1),
        ))?;
        chart.draw_series(std::iter::once(Text::new(
            name,
            (lo, level),
            ("sans-serif", 12)
                .into_font()
                .color(&guide)
                .pos(Pos::new(HPos::Left, VPos::Bottom)),
        )))?;
    }
    for c in curves.iter().filter(|c| !c.sorted.is_empty()) {
        // The empirical CDF is a step function: at each sample it rises by
        // 1/n, and it stays flat in between.
        let n = c.sorted.len() as f64;
        let points = c
            .sorted
            .iter()
            .enumerate()
            .flat_map(|(k, &v)| [(v, k as f64 / n), (v, (k + 1) as f64 / n)]);
        chart.draw_series(LineSeries::new(points, c.color.stroke_width(c.width)))?;
        // p50: a dot; p99: a square. Their values are in the legend table,
        // not printed beside the curves, where curves ending together would
        // print them over each other.
        chart.draw_series(std::iter::once(Circle::new(
            (c.p50, c.at(c.p50)),
            5,
            c.color.filled(),
        )))?;
        chart.draw_series(std::iter::once(
            EmptyElement::at((c.p99, c.at(c.p99)))
                + Rectangle::new([(-5, -5), (5, 5)], c.color.filled()),
        ))?;
    }
    draw_legend(&lower, curves)?;
    root.present()?;
    Ok(())
}

/// The legend, under the chart so it never covers a curve: per series its
/// line, name, sample count, p50 and p99, in aligned columns.
fn draw_legend<DB>(
    area: &DrawingArea<DB, Shift>,
    curves: &[Curve<'_>],
) -> Result<(), Box<dyn Error>>
where
    DB: DrawingBackend,
    DB::ErrorType: 'static,
{
    let row = i32::try_from(LEGEND_ROW).unwrap_or(22);
    let (x_line, x_name, x_n, x_p50, x_p99) = (96, 136, 620, 740, 860);
    let text = |size| ("sans-serif", size).into_font().color(&BLACK);
    let right = |size| text(size).pos(Pos::new(HPos::Right, VPos::Center));
    let left = |size| text(size).pos(Pos::new(HPos::Left, VPos::Center));
    let y0 = row / 2 + 4;
    area.draw(&Text::new("series", (x_name, y0), left(15)))?;
    area.draw(&Text::new("requests", (x_n, y0), right(15)))?;
    area.draw(&Text::new("● p50", (x_p50, y0), right(15)))?;
    area.draw(&Text::new("■ p99", (x_p99, y0), right(15)))?;
    for (i, c) in curves.iter().enumerate() {
        let y = y0 + row * (i32::try_from(i).unwrap_or(0) + 1);
        area.draw(&PathElement::new(
            vec![(x_line, y), (x_line + 28, y)],
            c.color.stroke_width(c.width),
        ))?;
        area.draw(&Text::new(c.name.to_owned(), (x_name, y), left(15)))?;
        area.draw(&Text::new(c.sorted.len().to_string(), (x_n, y), right(15)))?;
        let (p50, p99) = if c.sorted.is_empty() {
            ("-".to_owned(), "-".to_owned())
        } else {
            (format_ms(c.p50), format_ms(c.p99))
        };
        area.draw(&Text::new(p50, (x_p50, y), right(15)))?;
        area.draw(&Text::new(p99, (x_p99, y), right(15)))?;
    }
    Ok(())
}

/// A duration in milliseconds, as a short label ("250 µs", "1.5 ms", "2 s").
pub fn format_ms(ms: f64) -> String {
    if ms >= 1000.0 {
        format!("{} s", trim(ms / 1000.0))
    } else if ms >= 1.0 {
        format!("{} ms", trim(ms))
    } else {
        format!("{} µs", trim(ms * 1000.0))
    }
}

fn trim(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}").trim_end_matches(".0").to_owned()
    } else {
        let s = format!("{v:.2}");
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_in_their_unit() {
        assert_eq!(format_ms(0.25), "250 µs");
        assert_eq!(format_ms(1.5), "1.5 ms");
        assert_eq!(format_ms(12.0), "12 ms");
        assert_eq!(format_ms(2500.0), "2.5 s");
    }

    #[test]
    fn writes_an_svg_and_a_png_with_titles_and_marks() {
        let dir = tempfile::tempdir().expect("temp dir");
        let series = [
            Series {
                name: "all requests".into(),
                samples_ms: (1..=200).map(|i| f64::from(i) * 0.1).collect(),
            },
            Series {
                name: "disk".into(),
                samples_ms: (1..=100).map(|i| f64::from(i) * 0.05).collect(),
            },
        ];
        let (svg, png) =
            write_cdf(&dir.path().join("out/tta"), "time to answer", &series).expect("plot");
        let text = std::fs::read_to_string(&svg).expect("svg");
        for needle in [
            "time to answer (log scale)",
            "fraction of requests",
            "p50",
            "p99",
            "disk",
            "requests",
        ] {
            assert!(text.contains(needle), "{needle} missing from the SVG");
        }
        let bytes = std::fs::read(&png).expect("png");
        assert_eq!(&bytes[1..4], b"PNG");
    }
}
