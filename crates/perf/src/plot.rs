//! Charts of a sweep as SVG: bandwidth and latency against message size (`--plot FILE`).
//!
//! Drawn with `plotters`' SVG backend without its `ttf` feature: text goes into the SVG as
//! `<text>` elements that the viewer renders, so drawing needs no font files and no fontconfig.

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;

use crate::error::{Error, Result};
use crate::stats::Row;

/// Width of the image, and height of each chart in it.
const WIDTH: u32 = 960;
const PANEL_HEIGHT: u32 = 440;

/// A size as the axis labels write it: `64`, `4K`, `1M`.
fn size_label(bytes: f64) -> String {
    let b = bytes.round() as u64;
    match b {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => b.to_string(),
    }
}

/// A value as the value axis writes it: three significant digits or so, no trailing noise.
fn value_label(v: f64) -> String {
    match v.abs() {
        a if a >= 100.0 || a == 0.0 => format!("{v:.0}"),
        a if a >= 10.0 => format!("{v:.1}"),
        a if a >= 1.0 => format!("{v:.2}"),
        _ => format!("{v:.3}"),
    }
}

fn err(e: impl std::fmt::Display) -> Error {
    Error::msg(format!("drawing the chart: {e}"))
}

/// One line of a chart: its name, colour and (size, value) points.
struct Series {
    name: &'static str,
    color: RGBColor,
    points: Vec<(f64, f64)>,
}

/// Draws one chart of `series` on `area`, with the value axis `y` described by `y_desc`.
/// The size axis is logarithmic, with a tick at each of `sizes` (every other one when there
/// are many, so that the labels do not run into each other).
fn chart<DB, Y>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    caption: &str,
    y_desc: &str,
    sizes: &[f64],
    y: Y,
    series: &[Series],
) -> Result<()>
where
    DB: DrawingBackend,
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let (lo, hi) = (sizes[0], sizes[sizes.len() - 1]);
    let step = sizes.len().div_ceil(12);
    let keys: Vec<f64> = sizes.iter().copied().step_by(step).collect();
    let x_range = (lo / 1.5..hi * 1.5).log_scale().with_key_points(keys);
    let mut c = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(x_range, y)
        .map_err(err)?;
    c.configure_mesh()
        .x_desc("message size [bytes]")
        .y_desc(y_desc)
        .x_label_formatter(&|v| size_label(*v))
        .y_label_formatter(&|v| value_label(*v))
        .draw()
        .map_err(err)?;
    for s in series {
        let color = s.color;
        c.draw_series(LineSeries::new(s.points.iter().copied(), color.stroke_width(2)))
            .map_err(err)?
            .label(s.name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        c.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(err)?;
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}

/// The SVG document of `rows`: a bandwidth chart (average and peak Gbit/s) if there are
/// bandwidth rows, a latency chart (median and 99th percentile, microseconds, logarithmic) if
/// there are latency rows, one above the other, under the title `title`.
pub fn sweep_svg(rows: &[Row], title: &str) -> Result<String> {
    let bw: Vec<_> = rows
        .iter()
        .filter_map(|r| match r {
            Row::Bw(b) => Some(*b),
            _ => None,
        })
        .collect();
    let lat: Vec<_> = rows
        .iter()
        .filter_map(|r| match r {
            Row::Lat(l) => Some(*l),
            _ => None,
        })
        .collect();
    let panels = usize::from(!bw.is_empty()) + usize::from(!lat.is_empty());
    if panels == 0 {
        return Err(Error::msg(
            "there is nothing to plot: no bandwidth or latency results",
        ));
    }
    let mut sizes: Vec<usize> = bw
        .iter()
        .map(|b| b.bytes)
        .chain(lat.iter().map(|l| l.bytes))
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    let x: Vec<f64> = sizes.iter().map(|&s| (s as f64).max(1.0)).collect();

    let mut svg = String::new();
    {
        let height = PANEL_HEIGHT * panels as u32 + 40;
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let root = root.titled(title, ("sans-serif", 18)).map_err(err)?;
        let areas = root.split_evenly((panels, 1));
        let mut areas = areas.iter();
        if !bw.is_empty() {
            let top = bw
                .iter()
                .map(|b| b.bw_peak_gbps.max(b.bw_avg_gbps))
                .fold(0.0, f64::max);
            let series = [
                Series {
                    name: "BW average",
                    color: BLUE,
                    points: bw.iter().map(|b| (b.bytes as f64, b.bw_avg_gbps)).collect(),
                },
                Series {
                    name: "BW peak",
                    color: RGBColor(0, 150, 70),
                    points: bw.iter().map(|b| (b.bytes as f64, b.bw_peak_gbps)).collect(),
                },
            ];
            let area = areas.next().expect("a panel per chart");
            chart(
                area,
                "Bandwidth",
                "Gbit/s",
                &x,
                0.0..(top * 1.15).max(1e-3),
                &series,
            )?;
        }
        if !lat.is_empty() {
            let values = lat.iter().flat_map(|l| [l.t_typical, l.p99]).filter(|v| *v > 0.0);
            let (lo, hi) = values.fold((f64::MAX, 0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
            let (lo, hi) = if hi > 0.0 {
                (lo / 1.5, hi * 1.5)
            } else {
                (0.01, 1.0)
            };
            let series = [
                Series {
                    name: "median",
                    color: RED,
                    points: lat.iter().map(|l| (l.bytes as f64, l.t_typical)).collect(),
                },
                Series {
                    name: "99th percentile",
                    color: RGBColor(200, 120, 0),
                    points: lat.iter().map(|l| (l.bytes as f64, l.p99)).collect(),
                },
            ];
            let area = areas.next().expect("a panel per chart");
            chart(area, "Latency", "microseconds", &x, (lo..hi).log_scale(), &series)?;
        }
        root.present().map_err(err)?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::{BwRow, LatRow};

    #[test]
    fn sizes_are_labelled_in_binary_units() {
        assert_eq!(size_label(2.0), "2");
        assert_eq!(size_label(1000.0), "1000");
        assert_eq!(size_label(4096.0), "4K");
        assert_eq!(size_label(8.0 * 1048576.0), "8M");
        assert_eq!(size_label(1536.0), "1536");
        assert_eq!(value_label(1234.6), "1235");
        assert_eq!(value_label(12.34), "12.3");
        assert_eq!(value_label(0.0), "0");
        assert_eq!(value_label(0.01234), "0.012");
    }

    #[test]
    fn charts_have_a_panel_per_metric_and_refuse_nothing_to_plot() {
        let bw = Row::Bw(BwRow {
            bytes: 4096,
            iterations: 10,
            bw_peak_gbps: 2.0,
            bw_avg_gbps: 1.5,
            msg_rate_mpps: 0.04,
            retransmits: 0,
            timeouts: 0,
            tail_probes: 0,
        });
        let lat = Row::Lat(LatRow {
            bytes: 2,
            iterations: 10,
            t_min: 1.0,
            t_max: 9.0,
            t_typical: 2.0,
            t_avg: 2.5,
            t_stdev: 0.5,
            p99: 6.0,
            p999: 8.0,
        });
        let one = sweep_svg(&[bw], "t").unwrap();
        assert!(one.contains("Bandwidth") && !one.contains("Latency"));
        let both = sweep_svg(&[bw, lat], "t").unwrap();
        assert!(both.contains("Bandwidth") && both.contains("Latency") && both.contains("99th percentile"));
        assert!(sweep_svg(&[], "t").is_err());
    }
}
