//! `softverbs-perf --sweep --plot FILE`: the SVG parses as XML and holds a bandwidth and a
//! latency chart, each with its axes, their labels and one line per series, and a point for
//! every size of the sweep.

use std::process::Command;
use std::time::Duration;

mod common;

/// Sizes of the sweeps: small, so that the run is short.
const SIZES: &[&str] = &["64", "1024", "16384"];

fn texts(doc: &roxmltree::Document<'_>) -> Vec<String> {
    doc.descendants()
        .filter(|n| n.has_tag_name("text"))
        .map(|n| n.text().unwrap_or_default().trim().to_string())
        .collect()
}

/// Runs a loopback sweep with `extra` options and returns the SVG it wrote.
fn sweep_plot(tag: &str, extra: &[&str]) -> String {
    let file = std::env::temp_dir().join(format!("softverbs-plot-{tag}-{}.svg", std::process::id()));
    let _ = std::fs::remove_file(&file);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_softverbs-perf"));
    cmd.args(["--loopback", "--sweep", &SIZES.join(","), "-n", "200", "--plot"])
        .arg(&file)
        .args(extra)
        .env("SOFTVERBS_INTERFACES", "lo");
    let (status, out, err) = common::run_bounded(cmd, Duration::from_secs(180));
    assert!(
        status.success(),
        "softverbs-perf failed ({status}):\n{out}\n{err}"
    );
    let svg = std::fs::read_to_string(&file).expect("the chart was written");
    std::fs::remove_file(&file).unwrap();
    svg
}

#[test]
fn a_sweep_draws_bandwidth_and_latency_against_message_size() {
    let svg = sweep_plot("both", &[]);
    let doc = roxmltree::Document::parse(&svg).expect("the SVG is well-formed XML");
    let root = doc.root_element();
    assert!(
        root.has_tag_name(("http://www.w3.org/2000/svg", "svg")),
        "{svg:.200}"
    );
    let text = texts(&doc);
    for want in [
        "Bandwidth",
        "Latency",
        "message size [bytes]",
        "Gbit/s",
        "microseconds",
        "BW average",
        "BW peak",
        "median",
        "99th percentile",
    ] {
        assert!(text.iter().any(|t| t == want), "no {want:?} among {text:?}");
    }
    // The size axis has a tick at each size of the sweep, labelled in binary units.
    for label in ["64", "1K", "16K"] {
        assert!(
            text.iter().any(|t| t == label),
            "no tick {label:?} among {text:?}"
        );
    }
    // One polyline per series (four), and the axes and grid as lines or polylines too.
    let polylines = doc.descendants().filter(|n| n.has_tag_name("polyline")).count();
    assert!(polylines >= 4, "{polylines} polylines");
    // A marker per size and series: 3 sizes x 4 series.
    let circles = doc.descendants().filter(|n| n.has_tag_name("circle")).count();
    assert!(circles >= 3 * 4, "{circles} circles");
    // Every polyline of a series has a point per size.
    let series_points: Vec<usize> = doc
        .descendants()
        .filter(|n| n.has_tag_name("polyline"))
        .filter_map(|n| n.attribute("points"))
        .map(|p| p.split_whitespace().count())
        .filter(|&n| n == SIZES.len())
        .collect();
    assert!(
        series_points.len() >= 4,
        "series with {} points: {series_points:?}",
        SIZES.len()
    );
}

#[test]
fn an_explicit_metric_draws_only_its_chart() {
    let svg = sweep_plot("lat", &["--lat", "--test", "send"]);
    let doc = roxmltree::Document::parse(&svg).expect("well-formed");
    let text = texts(&doc);
    assert!(text.iter().any(|t| t == "Latency"), "{text:?}");
    assert!(!text.iter().any(|t| t == "Bandwidth"), "{text:?}");
}

#[test]
fn plot_is_refused_for_a_server_and_for_idle_cpu() {
    for args in [
        &["--plot", "x.svg"][..],
        &["--loopback", "--idle-cpu", "1", "--plot", "x.svg"],
    ] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_softverbs-perf"));
        cmd.args(args).current_dir(std::env::temp_dir());
        let (status, out, err) = common::run_bounded(cmd, Duration::from_secs(30));
        assert!(!status.success(), "{args:?}: {out}");
        assert!(err.contains("plot"), "{args:?}: {err}");
    }
}
