//! Time-to-answer plots: one empirical CDF per series on a logarithmic time
//! axis, with p50 and p99 marked, written as SVG and PNG (plotters).
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

/// p50, p90 and p99 of `samples`, in their unit, by nearest rank: each is
/// one of the samples, so a mark drawn at (p50, 0.5) lies on the CDF.
pub fn percentiles(samples: &[f64]) -> (f64, f64, f64) {
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = |q: f64| -> f64 {
        if s.is_empty() {
            return 0.0;
        }
        let k = (q * s.len() as f64).ceil() as usize;
        s[k.clamp(1, s.len()) - 1]
    };
    (rank(0.5), rank(0.9), rank(0.99))
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

/// Writes `base.svg` and `base.png` (the extension of `base`, if any, is
/// replaced) and returns both paths.
pub fn write_cdf(
    base: &Path,
    title: &str,
    series: &[Series],
) -> Result<(PathBuf, PathBuf), Box<dyn Error>> {
    ensure_font()?;
    if let Some(dir) = base.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let svg = base.with_extension("svg");
    let png = base.with_extension("png");
    let size = (960, 600);
    draw(
        SVGBackend::new(&svg, size).into_drawing_area(),
        title,
        series,
    )?;
    draw(
        BitMapBackend::new(&png, size).into_drawing_area(),
        title,
        series,
    )?;
    Ok((svg, png))
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

fn draw<DB>(
    root: DrawingArea<DB, Shift>,
    title: &str,
    series: &[Series],
) -> Result<(), Box<dyn Error>>
where
    DB: DrawingBackend,
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let all = series.iter().flat_map(|s| s.samples_ms.iter().copied());
    let (lo, hi) = all
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let (lo, hi) = if lo <= hi {
        (lo / 1.5, hi * 1.5)
    } else {
        (0.01, 10.0) // no samples: an empty, labelled frame
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d((lo..hi).log_scale(), 0f64..1.0)?;
    chart
        .configure_mesh()
        .x_desc("time to answer (ms, log scale)")
        .y_desc("fraction of requests answered")
        .x_label_formatter(&|v| format_ms(*v))
        .y_label_formatter(&|v| format!("{v:.1}"))
        .axis_desc_style(("sans-serif", 16))
        .label_style(("sans-serif", 13))
        .draw()?;

    for (i, s) in series.iter().enumerate() {
        let mut samples: Vec<f64> = s
            .samples_ms
            .iter()
            .copied()
            .filter(|v| v.is_finite() && *v > 0.0)
            .collect();
        if samples.is_empty() {
            continue;
        }
        samples.sort_by(f64::total_cmp);
        let n = samples.len() as f64;
        // The first series (all requests) is drawn in black and thicker.
        let color = if i == 0 {
            BLACK
        } else {
            COLORS[(i - 1) % COLORS.len()]
        };
        let width = if i == 0 { 3 } else { 2 };
        let (p50, _, p99) = percentiles(&samples);
        // Where each mark sits on the curve: the share of samples at or below it.
        let at = |p: f64| samples.partition_point(|&v| v <= p) as f64 / n;
        let points = samples
            .iter()
            .enumerate()
            .map(|(k, &v)| (v, (k + 1) as f64 / n));
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(width)))?
            .label(format!(
                "{} (n = {}): p50 {}, p99 {}",
                s.name,
                samples.len(),
                format_ms(p50),
                format_ms(p99)
            ))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(width))
            });
        // p50 and p99 marks: a dot on the curve, with its value; p50 labels
        // to the right, p99 labels to the left, staggered per series so
        // that curves ending together do not print over each other.
        let stagger = 15 * i as i32;
        let marks = [
            (p50, "p50", (8, -6 - stagger), HPos::Left),
            (p99, "p99", (-8, 10 + stagger), HPos::Right),
        ];
        chart.draw_series(marks.into_iter().map(|(x, name, offset, side)| {
            EmptyElement::at((x, at(x)))
                + Circle::new((0, 0), 5, color.filled())
                + Text::new(
                    format!("{name} {}", format_ms(x)),
                    offset,
                    ("sans-serif", 12)
                        .into_font()
                        .color(&color)
                        .pos(Pos::new(side, VPos::Center)),
                )
        }))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
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
            "time to answer (ms, log scale)",
            "fraction of requests",
            "p50",
            "p99",
            "disk (n = 100)",
        ] {
            assert!(text.contains(needle), "{needle} missing from the SVG");
        }
        let bytes = std::fs::read(&png).expect("png");
        assert_eq!(&bytes[1..4], b"PNG");
    }
}
