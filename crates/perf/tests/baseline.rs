//! Short runs of the `softverbs-baseline` modes (a fraction of a second each) and of
//! `scripts/bench --quick`: the figures must parse and be consistent with each other. Every
//! process run is bounded by a timeout; nothing depends on an idle host.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(120);
const BASELINE: &str = env!("CARGO_BIN_EXE_softverbs-baseline");

/// Waits for `child` at most `limit`, killing it then; returns its output.
fn wait_bounded(mut child: Child, limit: Duration) -> Output {
    let mut out = child.stdout.take();
    let mut err = child.stderr.take();
    let reader = std::thread::spawn(move || {
        let mut o = Vec::new();
        if let Some(s) = out.as_mut() {
            s.read_to_end(&mut o).unwrap();
        }
        o
    });
    let ereader = std::thread::spawn(move || {
        let mut e = Vec::new();
        if let Some(s) = err.as_mut() {
            s.read_to_end(&mut e).unwrap();
        }
        e
    });
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("process did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output {
        status,
        stdout: reader.join().unwrap(),
        stderr: ereader.join().unwrap(),
    }
}

fn spawn(args: &[&str]) -> Child {
    Command::new(BASELINE)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn softverbs-baseline")
}

/// Runs the baseline tool; returns its CSV result as (header names, values).
fn baseline(args: &[&str]) -> (Vec<String>, Vec<f64>) {
    let o = wait_bounded(spawn(args), LIMIT);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "softverbs-baseline {args:?} failed: {}\n{out}",
        String::from_utf8_lossy(&o.stderr)
    );
    csv(&out)
}

fn csv(out: &str) -> (Vec<String>, Vec<f64>) {
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "expected a header and one row:\n{out}");
    let head: Vec<String> = lines[0].split(',').map(str::to_string).collect();
    let row: Vec<f64> = lines[1]
        .split(',')
        .map(|v| v.parse().unwrap_or_else(|_| panic!("bad number {v:?} in {out}")))
        .collect();
    assert_eq!(head.len(), row.len(), "{out}");
    (head, row)
}

fn field(r: &(Vec<String>, Vec<f64>), name: &str) -> f64 {
    let i =
        r.0.iter()
            .position(|h| h == name)
            .unwrap_or_else(|| panic!("no {name} in {:?}", r.0));
    r.1[i]
}

#[test]
fn udp_lat_reports_ordered_positive_latencies() {
    let r = baseline(&["udp-lat", "-s", "8", "-D", "0.3"]);
    assert_eq!(field(&r, "bytes"), 8.0);
    assert!(field(&r, "iterations") >= 1.0);
    let (min, typ, p99) = (
        field(&r, "t_min_us"),
        field(&r, "t_typical_us"),
        field(&r, "p99_us"),
    );
    assert!(min > 0.0 && min <= typ && typ <= p99, "{r:?}");
    assert!(field(&r, "t_avg_us") >= min, "{r:?}");
}

#[test]
fn udp_gso_counts_received_bytes_consistently() {
    let r = baseline(&["udp-gso", "-D", "0.3"]);
    let (bytes, secs, gbps) = (
        field(&r, "bytes_received"),
        field(&r, "seconds"),
        field(&r, "gbps"),
    );
    assert!(bytes > 0.0 && secs > 0.0 && gbps > 0.0, "{r:?}");
    assert!(
        (bytes * 8.0 / secs / 1e9 - gbps).abs() <= 0.01 * gbps + 0.001,
        "{r:?}"
    );
    // The default send is the largest multiple of 1472 bytes that fits in one UDP send.
    assert_eq!(field(&r, "segment"), 1472.0);
    assert_eq!(field(&r, "send_size"), 64768.0);
    // GRO coalesces segments, and a receive never holds more than one send's worth.
    let receives = field(&r, "receives");
    assert!(receives >= 1.0 && bytes / receives <= 64768.0, "{r:?}");
}

#[test]
fn udp_gso_receiver_never_counts_more_than_was_sent() {
    let mut server = Command::new(BASELINE)
        .args(["udp-gso", "--serve", "127.0.0.1:0", "--segment", "4096"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    let mut stdout = BufReader::new(server.stdout.take().unwrap());
    stdout.read_line(&mut first).unwrap();
    let port = first.trim().strip_prefix("PORT ").expect("PORT line").to_string();
    let sender = baseline(&[
        "udp-gso",
        "--connect",
        &format!("127.0.0.1:{port}"),
        "--segment",
        "4096",
        "-D",
        "0.3",
    ]);
    let o = wait_bounded(server, LIMIT);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    let received = csv(&rest);
    let sent = field(&sender, "bytes_sent");
    let got = field(&received, "bytes_received");
    assert!(got > 0.0 && got <= sent, "received {got} of {sent}");
    assert_eq!(field(&received, "send_size"), 61440.0);
}

#[test]
fn vm_writev_copies_whole_buffers_into_the_target() {
    let r = baseline(&["vm-writev", "-s", "1048576", "-D", "0.3"]);
    let copies = field(&r, "copies");
    assert!(copies >= 1.0, "{r:?}");
    assert_eq!(field(&r, "bytes"), copies * 1048576.0);
    assert!(field(&r, "gbps") > 0.0 && field(&r, "seconds") > 0.0, "{r:?}");
}

#[test]
fn bad_options_fail() {
    for args in [
        &["udp-lat", "-D", "0"][..],
        &["udp-lat", "-s", "0"],
        &["udp-gso", "--segment", "100", "--send-size", "65000"],
        &["vm-writev", "-s", "0"],
    ] {
        let o = wait_bounded(spawn(args), LIMIT);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(!o.stderr.is_empty(), "{args:?} said nothing");
    }
}

fn which(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(program).exists()))
}

/// The drop-in library of this test's build profile, built with cargo if this run has not
/// built it.
fn library(bin_dir: &Path) -> PathBuf {
    let lib = bin_dir.join("libibverbs.so");
    if !lib.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut args = vec!["build", "-p", "softverbs-ibverbs"];
        if bin_dir.ends_with("release") {
            args.push("--release");
        }
        let c = Command::new(cargo)
            .args(&args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let o = wait_bounded(c, Duration::from_secs(600));
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    assert!(lib.exists(), "{} was not built", lib.display());
    let dir = std::env::temp_dir().join(format!("softverbs-bench-lib-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let link = dir.join("libibverbs.so.1");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&lib, &link).unwrap();
    dir
}

/// `scripts/bench --quick` on this build's binaries prints every row, each with a number for
/// softverbs, writes the same rows as Markdown, and draws their ratios as an SVG chart. Runs
/// where perftest is installed (CI installs it with scripts/setup-deps).
#[test]
fn bench_quick_prints_every_row() {
    if !which("ib_write_bw") {
        eprintln!("perftest is not installed: bench_quick_prints_every_row does not run");
        return;
    }
    let bin_dir = Path::new(BASELINE).parent().unwrap().to_path_buf();
    let lib_dir = library(&bin_dir);
    let md = lib_dir.join("bench.md");
    let chart = lib_dir.join("bench.svg");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/bench");
    let child = Command::new(script)
        .arg("--quick")
        .arg("--no-build")
        .arg("--bin-dir")
        .arg(&bin_dir)
        .arg("--lib-dir")
        .arg(&lib_dir)
        .arg("--markdown")
        .arg(&md)
        .arg("--chart")
        .arg(&chart)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let o = wait_bounded(child, Duration::from_secs(300));
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "scripts/bench --quick failed:\n{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let metrics = [
        "SEND 8 B one-way latency [us]",
        "RC WRITE 1 MiB [Gbit/s]",
        "RC WRITE 1 MiB vs UCX [Gbit/s]",
        "SEND 64 B, 1 QP [M msg/s]",
        "RC WRITE 64 KiB [Gbit/s]",
        "WRITE 64 B, 4 QPs [M msg/s]",
        "ib_send_lat -s 8 one-way [us]",
        "ib_write_bw -s 65536 [Gbit/s]",
        "ib_write_bw -s 1048576 [Gbit/s]",
        "ib_send_bw -s 64 -q 4 [M msg/s]",
        "CPU s/GB, RC WRITE 1 MiB",
        "CPU s/GB, RC WRITE 64 KiB",
        "CPU s/GB, ib_write_bw 64 KiB",
        "CPU s/GB, ib_write_bw 1 MiB",
        "RC WRITE 64 KiB, --zero-copy [Gbit/s]",
        "RC WRITE 1 MiB, --zero-copy [Gbit/s]",
        "RC WRITE 64 KiB, --zero-copy vs atomic words",
        "RC WRITE 1 MiB, --zero-copy vs atomic words",
        "CPU s/GB, RC WRITE 1 MiB --zero-copy",
        "idle CPU, client [% of a core]",
        "idle CPU, server [% of a core]",
        "QPs in one process: bytes per idle connected QP",
        "QPs in one process: create + connect all [ms]",
        "QPs in one process: WRITE 64 B over all [M msg/s]",
        "QPs in one process: idle CPU [% of a core]",
        "processes: WRITE 64 B aggregate [M msg/s]",
        "processes: idle CPU, busiest [% of a core]",
    ];
    for m in metrics {
        assert!(out.contains(m), "no row {m:?} in:\n{out}");
    }
    assert!(
        out.contains("shm rows"),
        "no note on the shared-memory rows:\n{out}"
    );
    let text = std::fs::read_to_string(&md).unwrap();
    let rows: Vec<Vec<&str>> = text
        .lines()
        .filter(|l| l.starts_with('|') && !l.starts_with("|---") && !l.starts_with("| section"))
        .map(|l| l.trim_matches('|').split('|').map(str::trim).collect())
        .collect();
    assert_eq!(rows.len(), 30, "{text}");
    let ucx = which("ucx_perftest");
    for r in &rows {
        assert_eq!(r.len(), 8, "{r:?}");
        let v: f64 = r[3]
            .parse()
            .unwrap_or_else(|_| panic!("no softverbs figure in {r:?}"));
        // Idle processes may use no measurable CPU at all; everything else moved data.
        assert!(v > 0.0 || (r[2].contains("idle CPU") && v == 0.0), "{r:?}");
        if let Some((_, base)) = r[4].rsplit_once(": ") {
            if ucx || !r[4].starts_with("UCX") {
                let b: f64 = base.parse().unwrap_or_else(|_| panic!("no baseline in {r:?}"));
                assert!(b > 0.0, "{r:?}");
                assert!(r[5].parse::<f64>().is_ok_and(|q| q > 0.0), "{r:?}");
            }
        }
        assert!(["met", "NOT met", "-"].contains(&r[7]), "{r:?}");
    }
    // The chart: a bar per row with a ratio, its target tick where the target is a ratio.
    let svg = std::fs::read_to_string(&chart).unwrap();
    let doc = roxmltree::Document::parse(&svg).expect("the chart is well-formed XML");
    let class = |c: &str| {
        doc.descendants()
            .filter(|n| n.attribute("class") == Some(c))
            .count()
    };
    let with_ratio = rows.iter().filter(|r| r[5] != "-").count();
    assert!(with_ratio > 0);
    assert_eq!(class("ratio"), with_ratio, "{svg}");
    let is_ratio = |w: &str| w.strip_suffix('x').is_some_and(|n| n.parse::<f64>().is_ok());
    let ratio_targets = rows
        .iter()
        .filter(|r| r[5] != "-" && r[6].split_whitespace().any(is_ratio))
        .count();
    assert_eq!(class("target"), ratio_targets, "{svg}");
    let _ = std::fs::remove_dir_all(&lib_dir);
}
