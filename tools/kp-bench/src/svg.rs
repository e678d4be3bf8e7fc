//! A tiny SVG line plot for the benchmark report: axes with ticks, linear or log scales, one
//! polyline with markers per series and a legend. Pure (returns the document as text), so
//! it is tested on its output; no plotting crate for four charts.

use std::fmt::Write as _;

/// Canvas size and margins, in SVG user units (pixels).
const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 400.0;
const LEFT: f64 = 72.0;
/// The legend sits right of the plot area, so it never hides a line.
const RIGHT: f64 = 150.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 56.0;

/// Series colours, in order (colour-blind-friendly Okabe–Ito hues).
const COLOURS: [&str; 8] = [
    "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442", "#000000",
];

/// How an axis maps values to positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scale {
    /// Evenly spaced values; ticks at 1, 2 or 5 × 10^k steps.
    Linear,
    /// Decades evenly spaced; ticks at powers of ten. Values ≤ 0 are not drawn.
    Log,
}

/// One line of the plot.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// (x, y) points, drawn in the given order.
    pub points: Vec<(f64, f64)>,
    /// Dashed instead of solid (e.g. p99 next to a solid p50 of the same mode).
    pub dashed: bool,
}

impl Series {
    /// A solid series.
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self {
            name: name.into(),
            points,
            dashed: false,
        }
    }

    /// The same, dashed.
    #[must_use]
    pub fn dashed(mut self) -> Self {
        self.dashed = true;
        self
    }
}

/// A line plot.
#[derive(Clone, Debug, PartialEq)]
pub struct Plot {
    /// Title above the plot area.
    pub title: String,
    /// X axis label.
    pub x_label: String,
    /// Y axis label.
    pub y_label: String,
    /// X axis scale.
    pub x_scale: Scale,
    /// Y axis scale.
    pub y_scale: Scale,
    /// The lines.
    pub series: Vec<Series>,
}

/// Maps data values on one axis to pixel positions.
#[derive(Clone, Copy, Debug)]
struct Axis {
    scale: Scale,
    /// Domain, already transformed (log10 for log axes).
    low: f64,
    high: f64,
    /// Pixel range; `from` is where `low` lands.
    from: f64,
    to: f64,
}

impl Axis {
    /// An axis over `values` (non-finite values, and non-positive ones on a log axis, are
    /// ignored); a degenerate or empty domain is widened so that every position is finite.
    fn new(scale: Scale, values: impl Iterator<Item = f64>, from: f64, to: f64) -> Self {
        let usable: Vec<f64> = values
            .filter_map(|v| transform(scale, v))
            .filter(|v| v.is_finite())
            .collect();
        let (mut low, mut high) = usable
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
                (lo.min(*v), hi.max(*v))
            });
        if usable.is_empty() {
            (low, high) = (0.0, 1.0);
        }
        match scale {
            // Whole decades, so the ends are labelled.
            Scale::Log => {
                low = low.floor();
                high = high.ceil();
                if high <= low {
                    high = low + 1.0;
                }
            }
            // Linear plots of latencies and sizes start at zero for honest proportions.
            Scale::Linear => {
                low = low.min(0.0);
                if high <= low {
                    high = low + 1.0;
                }
                let step = nice_step(high - low);
                high = (high / step).ceil() * step;
            }
        }
        Self {
            scale,
            low,
            high,
            from,
            to,
        }
    }

    /// The pixel position of `value`, or `None` when it cannot be drawn on this axis.
    fn position(&self, value: f64) -> Option<f64> {
        let t = transform(self.scale, value)?;
        Some(self.from + (t - self.low) / (self.high - self.low) * (self.to - self.from))
    }

    /// Tick values (untransformed).
    fn ticks(&self) -> Vec<f64> {
        match self.scale {
            Scale::Log => {
                let mut ticks = Vec::new();
                let mut exponent = self.low;
                while exponent <= self.high + 1e-9 {
                    ticks.push(10_f64.powf(exponent));
                    exponent += 1.0;
                }
                ticks
            }
            Scale::Linear => {
                let step = nice_step(self.high - self.low);
                let mut ticks = Vec::new();
                let mut value = (self.low / step).ceil() * step;
                while value <= self.high + step * 1e-9 {
                    ticks.push(value);
                    value += step;
                }
                ticks
            }
        }
    }
}

/// The value on the axis's internal (linear) scale.
fn transform(scale: Scale, value: f64) -> Option<f64> {
    match scale {
        Scale::Linear => value.is_finite().then_some(value),
        Scale::Log => (value > 0.0 && value.is_finite()).then(|| value.log10()),
    }
}

/// A 1, 2 or 5 × 10^k step giving about five ticks over `span`.
fn nice_step(span: f64) -> f64 {
    let rough = span / 5.0;
    let magnitude = 10_f64.powf(rough.log10().floor());
    let fraction = rough / magnitude;
    let nice = if fraction <= 1.0 {
        1.0
    } else if fraction <= 2.0 {
        2.0
    } else if fraction <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * magnitude
}

/// A tick label: `1k`, `300`, `0.5`, `2M`.
pub fn tick_label(value: f64) -> String {
    let abs = value.abs();
    let (scaled, suffix) = if abs >= 1e6 {
        (value / 1e6, "M")
    } else if abs >= 1e3 {
        (value / 1e3, "k")
    } else {
        (value, "")
    };
    let text = if scaled.fract().abs() < 1e-9 || scaled.abs() >= 10.0 {
        format!("{scaled:.0}")
    } else {
        // Two significant digits: 0.5, 0.25, 0.0001.
        let decimals = (1.0 - scaled.abs().log10().floor()).max(0.0);
        let t = format!("{scaled:.*}", decimals as usize);
        t.trim_end_matches('0').trim_end_matches('.').to_owned()
    };
    format!("{text}{suffix}")
}

/// Escapes text for SVG content and attribute values.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

impl Plot {
    /// The plot as a standalone SVG document.
    pub fn render(&self) -> String {
        let points = || self.series.iter().flat_map(|s| s.points.iter());
        let x = Axis::new(self.x_scale, points().map(|p| p.0), LEFT, WIDTH - RIGHT);
        let y = Axis::new(self.y_scale, points().map(|p| p.1), HEIGHT - BOTTOM, TOP);
        let mut svg = String::new();
        let _ = writeln!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(
            svg,
            r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
        );
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="22" text-anchor="middle" font-size="15" font-weight="bold">{}</text>"#,
            WIDTH / 2.0,
            escape(&self.title)
        );
        self.grid(&mut svg, &x, &y);
        for (index, series) in self.series.iter().enumerate() {
            series_svg(&mut svg, series, COLOURS[index % COLOURS.len()], &x, &y);
        }
        self.legend(&mut svg);
        svg.push_str("</svg>\n");
        svg
    }

    /// Axes, grid lines, tick labels and axis labels.
    fn grid(&self, svg: &mut String, x: &Axis, y: &Axis) {
        let (bottom, top) = (HEIGHT - BOTTOM, TOP);
        let (left, right) = (LEFT, WIDTH - RIGHT);
        for tick in x.ticks() {
            let Some(px) = x.position(tick) else { continue };
            let _ = writeln!(
                svg,
                r##"<line class="grid" x1="{px:.1}" y1="{top}" x2="{px:.1}" y2="{bottom}" stroke="#ddd"/><text x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
                bottom + 16.0,
                tick_label(tick)
            );
        }
        for tick in y.ticks() {
            let Some(py) = y.position(tick) else { continue };
            let _ = writeln!(
                svg,
                r##"<line class="grid" x1="{left}" y1="{py:.1}" x2="{right}" y2="{py:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                left - 6.0,
                py + 4.0,
                tick_label(tick)
            );
        }
        let _ = writeln!(
            svg,
            r##"<path class="axes" d="M{left},{top} V{bottom} H{right}" fill="none" stroke="#333"/>"##
        );
        let scale_note = |scale: Scale| match scale {
            Scale::Log => " (log scale)",
            Scale::Linear => "",
        };
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}{}</text>"#,
            (left + right) / 2.0,
            HEIGHT - 14.0,
            escape(&self.x_label),
            scale_note(self.x_scale)
        );
        let _ = writeln!(
            svg,
            r#"<text transform="translate(16,{:.1}) rotate(-90)" text-anchor="middle">{}{}</text>"#,
            (top + bottom) / 2.0,
            escape(&self.y_label),
            scale_note(self.y_scale)
        );
    }

    /// One row per series, right of the plot area.
    fn legend(&self, svg: &mut String) {
        let x = WIDTH - RIGHT + 12.0;
        for (index, series) in self.series.iter().enumerate() {
            let colour = COLOURS[index % COLOURS.len()];
            let y = TOP + 14.0 + 16.0 * index as f64;
            let dash = if series.dashed {
                r#" stroke-dasharray="6 3""#
            } else {
                ""
            };
            let _ = writeln!(
                svg,
                r#"<g class="legend"><line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{colour}" stroke-width="2"{dash}/><text x="{:.1}" y="{:.1}">{}</text></g>"#,
                x,
                y - 4.0,
                x + 24.0,
                y - 4.0,
                x + 30.0,
                y,
                escape(&series.name)
            );
        }
    }
}

/// A series' polyline and a marker per point (points an axis cannot show are left out).
fn series_svg(svg: &mut String, series: &Series, colour: &str, x: &Axis, y: &Axis) {
    let placed: Vec<(f64, f64)> = series
        .points
        .iter()
        .filter_map(|(vx, vy)| Some((x.position(*vx)?, y.position(*vy)?)))
        .collect();
    let dash = if series.dashed {
        r#" stroke-dasharray="6 3""#
    } else {
        ""
    };
    let coordinates: Vec<String> = placed
        .iter()
        .map(|(px, py)| format!("{px:.1},{py:.1}"))
        .collect();
    let _ = writeln!(
        svg,
        r#"<polyline class="series" fill="none" stroke="{colour}" stroke-width="2"{dash} points="{}"><title>{}</title></polyline>"#,
        coordinates.join(" "),
        escape(&series.name)
    );
    for (px, py) in placed {
        let _ = writeln!(
            svg,
            r#"<circle class="point" cx="{px:.1}" cy="{py:.1}" r="3" fill="{colour}"/>"#
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plot(x_scale: Scale, y_scale: Scale, series: Vec<Series>) -> Plot {
        Plot {
            title: "t".to_owned(),
            x_label: "services".to_owned(),
            y_label: "seconds".to_owned(),
            x_scale,
            y_scale,
            series,
        }
    }

    fn polylines(svg: &str) -> Vec<Vec<(f64, f64)>> {
        svg.lines()
            .filter(|l| l.starts_with("<polyline"))
            .map(|l| {
                let start = l.find("points=\"").expect("points") + 8;
                let end = start + l[start..].find('"').expect("end quote");
                l[start..end]
                    .split_whitespace()
                    .map(|pair| {
                        let (a, b) = pair.split_once(',').expect("x,y");
                        (a.parse().expect("x"), b.parse().expect("y"))
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn log_axis_puts_each_decade_the_same_distance_apart() {
        let svg = plot(
            Scale::Log,
            Scale::Log,
            vec![Series::new(
                "a",
                vec![(1.0, 1.0), (10.0, 10.0), (100.0, 100.0)],
            )],
        )
        .render();
        let lines = polylines(&svg);
        assert_eq!(lines.len(), 1);
        let p = &lines[0];
        assert_eq!(p.len(), 3);
        // Equal steps in x (right) and y (up: smaller pixel values).
        assert!(((p[1].0 - p[0].0) - (p[2].0 - p[1].0)).abs() < 0.2, "{p:?}");
        assert!(((p[0].1 - p[1].1) - (p[1].1 - p[2].1)).abs() < 0.2, "{p:?}");
        assert!(p[2].1 < p[0].1, "larger values are drawn higher");
        // The ends of the data are the ends of the axes (whole decades).
        assert!((p[0].0 - LEFT).abs() < 0.2 && (p[2].0 - (WIDTH - RIGHT)).abs() < 0.2);
        for label in [">1<", ">10<", ">100<"] {
            assert!(svg.contains(label), "tick {label} missing:\n{svg}");
        }
        assert!(svg.contains("services (log scale)"));
    }

    #[test]
    fn linear_axis_starts_at_zero_with_round_ticks() {
        let svg = plot(
            Scale::Linear,
            Scale::Linear,
            vec![Series::new("a", vec![(100.0, 3.0), (1000.0, 7.5)])],
        )
        .render();
        // y: 0..8 in steps of 2 (five ticks); x: 0..1000 in steps of 200.
        for label in [">0<", ">2<", ">8<", ">200<", ">1k<"] {
            assert!(svg.contains(label), "tick {label} missing:\n{svg}");
        }
        let p = &polylines(&svg)[0];
        // x=100 is a tenth of the way along.
        let expected = LEFT + 0.1 * (WIDTH - RIGHT - LEFT);
        assert!((p[0].0 - expected).abs() < 0.2, "{p:?}");
    }

    #[test]
    fn every_series_gets_a_line_markers_and_a_legend_entry() {
        let svg = plot(
            Scale::Log,
            Scale::Linear,
            vec![
                Series::new("iptables <p50>", vec![(1.0, 1.0), (1000.0, 2.0)]),
                Series::new("iptables p99", vec![(1.0, 3.0), (1000.0, 4.0)]).dashed(),
                Series::new("empty", Vec::new()),
            ],
        )
        .render();
        assert_eq!(polylines(&svg).len(), 3);
        assert_eq!(svg.matches("<circle").count(), 4);
        assert_eq!(svg.matches("class=\"legend\"").count(), 3);
        assert!(svg.contains("iptables &lt;p50&gt;"), "names are escaped");
        assert!(svg.contains("stroke-dasharray"));
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    }

    #[test]
    fn points_a_log_axis_cannot_show_are_left_out_and_nothing_is_nan() {
        let svg = plot(
            Scale::Log,
            Scale::Log,
            vec![Series::new(
                "a",
                vec![(0.0, 1.0), (10.0, f64::NAN), (100.0, 5.0)],
            )],
        )
        .render();
        assert_eq!(polylines(&svg)[0].len(), 1);
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
        // A single point or no data still gives finite axes.
        let single = plot(
            Scale::Linear,
            Scale::Log,
            vec![Series::new("a", vec![(5.0, 5.0)])],
        )
        .render();
        assert!(
            !single.contains("NaN") && !single.contains("inf"),
            "{single}"
        );
        let empty = plot(Scale::Linear, Scale::Linear, Vec::new()).render();
        assert!(!empty.contains("NaN"), "{empty}");
    }

    #[test]
    fn tick_labels_are_short() {
        assert_eq!(tick_label(1000.0), "1k");
        assert_eq!(tick_label(3000.0), "3k");
        assert_eq!(tick_label(0.5), "0.5");
        assert_eq!(tick_label(0.01), "0.01");
        assert_eq!(tick_label(300.0), "300");
        assert_eq!(tick_label(2_000_000.0), "2M");
        assert_eq!(tick_label(1500.0), "1.5k");
        assert_eq!(tick_label(0.0001), "0.0001");
        assert_eq!(tick_label(0.25), "0.25");
        assert_eq!(tick_label(10_f64.powf(-3.0)), "0.001");
    }
}
