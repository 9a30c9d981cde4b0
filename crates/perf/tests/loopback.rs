//! End-to-end runs of the `softverbs-perf` binary in `--loopback` mode: a server child process
//! and the client talking RoCEv2 over UDP on the loopback interface (and, for comparison, two
//! threads of one process). Sizes and iteration counts are small; every run is bounded by a
//! timeout, and the printed figures must be positive.

use std::process::Command;
use std::time::Duration;

mod common;

const TIMEOUT: Duration = Duration::from_secs(120);

/// Runs the binary with `args`, returning its standard output; fails on a non-zero exit or
/// after [`TIMEOUT`].
fn perf(args: &[&str]) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_softverbs-perf"));
    cmd.args(args).env("SOFTVERBS_INTERFACES", "lo");
    let (status, out, err) = common::run_bounded(cmd, TIMEOUT);
    assert!(
        status.success(),
        "softverbs-perf {args:?} failed ({status}):\n{out}\n{err}"
    );
    out
}

/// The data rows of the table under the header line starting with `header`, as numbers.
fn table(out: &str, header: &str) -> Vec<Vec<f64>> {
    let mut lines = out.lines().skip_while(|l| !l.trim_start().starts_with(header));
    assert!(lines.next().is_some(), "no table with {header:?} in:\n{out}");
    let rows: Vec<Vec<f64>> = lines
        .take_while(|l| !l.starts_with("---"))
        .map(|l| {
            l.split_whitespace()
                .map(|w| {
                    w.parse::<f64>()
                        .unwrap_or_else(|_| panic!("bad number {w:?} in {l:?}"))
                })
                .collect()
        })
        .collect();
    assert!(!rows.is_empty(), "empty table in:\n{out}");
    rows
}

/// Checks a bandwidth table: one row per size, every figure positive.
fn check_bw(out: &str, sizes: &[f64]) {
    assert!(
        out.contains("#bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]"),
        "{out}"
    );
    let rows = table(out, "#bytes");
    assert_eq!(rows.len(), sizes.len(), "{out}");
    for (row, &size) in rows.iter().zip(sizes) {
        // bytes, iterations, peak, average, rate, then the retransmissions, timeouts and tail
        // probes counted.
        assert_eq!(row.len(), 8, "{row:?}");
        assert_eq!(row[0], size);
        assert!(
            row[1..5].iter().all(|&x| x > 0.0),
            "non-positive figure in {row:?}\n{out}"
        );
        assert!(
            row[5..].iter().all(|&x| x >= 0.0 && x.fract() == 0.0),
            "counts must be whole numbers: {row:?}\n{out}"
        );
        assert!(
            row[2] >= 0.999 * row[3],
            "peak {} below average {}",
            row[2],
            row[3]
        );
    }
}

/// Checks a latency table: one row, every figure positive and ordered.
fn check_lat(out: &str, size: f64) {
    assert!(out.contains("t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]"), "{out}");
    let rows = table(out, "#bytes");
    assert_eq!(rows.len(), 1, "{out}");
    let r = &rows[0];
    assert_eq!(r.len(), 9, "{r:?}");
    assert_eq!(r[0], size);
    assert!(
        r[1] > 0.0 && r[2] > 0.0 && r[3] > 0.0 && r[4] > 0.0 && r[5] > 0.0 && r[7] > 0.0 && r[8] > 0.0,
        "{r:?}"
    );
    assert!(
        r[2] <= r[4] && r[4] <= r[3] && r[2] <= r[7] && r[7] <= r[3],
        "min <= typical <= max, p99 within: {r:?}"
    );
}

#[test]
fn write_bandwidth() {
    let out = perf(&[
        "--loopback",
        "--test",
        "write",
        "--bw",
        "-s",
        "4096",
        "-n",
        "300",
        "--check",
    ]);
    check_bw(&out, &[4096.0]);
    assert!(
        out.contains("RDMA_Write BW Test") && out.contains("RoCEv2 over UDP"),
        "{out}"
    );
    assert!(out.contains("Data check: passed"), "{out}");
}

#[test]
fn send_bandwidth() {
    let out = perf(&[
        "--loopback",
        "--test",
        "send",
        "--bw",
        "-s",
        "5000",
        "-n",
        "300",
        "--check",
    ]);
    check_bw(&out, &[5000.0]);
}

#[test]
fn read_bandwidth() {
    let out = perf(&[
        "--loopback",
        "--test",
        "read",
        "--bw",
        "-s",
        "10000",
        "-n",
        "200",
        "--check",
    ]);
    check_bw(&out, &[10000.0]);
}

#[test]
fn atomic_bandwidth_both_kinds() {
    let out = perf(&["--loopback", "--test", "atomic", "--bw", "-n", "300", "--check"]);
    check_bw(&out, &[8.0]);
    let out = perf(&[
        "--loopback",
        "--test",
        "atomic",
        "-A",
        "cmp-swap",
        "--bw",
        "-n",
        "300",
        "-q",
        "2",
        "--check",
    ]);
    check_bw(&out, &[8.0]);
    assert!(out.contains("CMP_AND_SWAP"), "{out}");
}

#[test]
fn message_rate_over_several_qps() {
    let out = perf(&[
        "--loopback",
        "--test",
        "write",
        "--bw",
        "-s",
        "64",
        "-q",
        "4",
        "-n",
        "500",
        "-l",
        "8",
        "--check",
    ]);
    check_bw(&out, &[64.0]);
    assert!(out.contains("Number of qps  : 4"), "{out}");
}

#[test]
fn sweep_of_sizes() {
    let out = perf(&[
        "--loopback",
        "--test",
        "write",
        "--bw",
        "--sweep",
        "2,1k,64k",
        "-n",
        "40",
        "--check",
    ]);
    check_bw(&out, &[2.0, 1024.0, 65536.0]);
}

#[test]
fn send_latency() {
    let out = perf(&[
        "--loopback",
        "--test",
        "send",
        "--lat",
        "-s",
        "8",
        "-n",
        "200",
        "--check",
    ]);
    check_lat(&out, 8.0);
    assert!(out.contains("Send Latency Test"), "{out}");
}

#[test]
fn write_latency_polls_the_last_byte() {
    let out = perf(&[
        "--loopback",
        "--test",
        "write",
        "--lat",
        "-s",
        "3000",
        "-n",
        "200",
        "--check",
    ]);
    check_lat(&out, 3000.0);
    // Inline, and a sweep: the counter byte of one size must not spoil the next size's data.
    let out = perf(&[
        "--loopback",
        "--test",
        "write",
        "--lat",
        "--sweep",
        "16,100",
        "-I",
        "64",
        "-n",
        "50",
        "--check",
    ]);
    assert_eq!(table(&out, "#bytes").len(), 2, "{out}");
}

#[test]
fn unreliable_connection() {
    let out = perf(&[
        "--loopback",
        "-c",
        "uc",
        "--test",
        "send",
        "--lat",
        "-s",
        "32",
        "-n",
        "100",
        "--check",
    ]);
    check_lat(&out, 32.0);
    assert!(out.contains("UC (RoCEv2)"), "{out}");
    let out = perf(&[
        "--loopback",
        "-c",
        "uc",
        "--test",
        "write",
        "--lat",
        "-s",
        "32",
        "-n",
        "100",
        "--check",
    ]);
    check_lat(&out, 32.0);
    let out = perf(&[
        "--loopback",
        "-c",
        "uc",
        "--test",
        "write",
        "--bw",
        "-s",
        "4096",
        "-n",
        "100",
        "-t",
        "16",
    ]);
    check_bw(&out, &[4096.0]);
}

#[test]
fn read_latency() {
    let out = perf(&[
        "--loopback",
        "--test",
        "read",
        "--lat",
        "-s",
        "100",
        "-n",
        "200",
        "--check",
    ]);
    check_lat(&out, 100.0);
}

#[test]
fn atomic_latency() {
    let out = perf(&["--loopback", "--test", "atomic", "--lat", "-n", "200", "--check"]);
    check_lat(&out, 8.0);
    let out = perf(&[
        "--loopback",
        "--test",
        "atomic",
        "-A",
        "cmp-swap",
        "--lat",
        "-n",
        "100",
        "--check",
    ]);
    check_lat(&out, 8.0);
}

#[test]
fn timed_runs_and_completion_events() {
    let out = perf(&[
        "--loopback",
        "--test",
        "write",
        "--bw",
        "-s",
        "1024",
        "-D",
        "0.3",
        "-e",
        "--check",
    ]);
    check_bw(&out, &[1024.0]);
    let out = perf(&[
        "--loopback",
        "--test",
        "send",
        "--bw",
        "-s",
        "512",
        "-D",
        "0.3",
        "--check",
    ]);
    check_bw(&out, &[512.0]);
    let out = perf(&[
        "--loopback",
        "--test",
        "send",
        "--lat",
        "-s",
        "8",
        "-D",
        "0.2",
        "-e",
    ]);
    check_lat(&out, 8.0);
}

#[test]
fn threads_json_and_csv() {
    let out = perf(&[
        "--loopback",
        "--threads",
        "--test",
        "write",
        "--bw",
        "-s",
        "4096",
        "-n",
        "200",
        "--json",
        "--check",
    ]);
    let line = out.trim();
    assert!(line.starts_with('{') && line.ends_with("]}"), "{out}");
    assert!(
        line.contains("\"peer\":\"thread of this process (in-memory path)\""),
        "{out}"
    );
    let avg = line
        .split("\"bw_avg_gbps\":")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .expect("bw_avg_gbps");
    assert!(avg.parse::<f64>().unwrap() > 0.0, "{out}");

    let out = perf(&[
        "--loopback",
        "--test",
        "read",
        "--lat",
        "-s",
        "64",
        "-n",
        "100",
        "--csv",
    ]);
    let mut lines = out.lines();
    assert_eq!(
        lines.next(),
        Some("bytes,iterations,t_min_us,t_max_us,t_typical_us,t_avg_us,t_stdev_us,p99_us,p999_us")
    );
    let row: Vec<f64> = lines
        .next()
        .expect("a row")
        .split(',')
        .map(|x| x.parse().unwrap())
        .collect();
    assert_eq!(row[0], 64.0);
    assert!(row[2..].iter().all(|&x| x > 0.0), "{row:?}");
}

#[test]
fn idle_cpu() {
    let out = perf(&["--loopback", "--idle-cpu", "1"]);
    assert!(out.contains("CPU client[% of a core]"), "{out}");
    let rows = table(&out, "#seconds");
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    assert!(r[0] >= 0.99, "{r:?}");
    // Connected but idle processes use (almost) no CPU.
    assert!(r[1] >= 0.0 && r[1] < 20.0 && r[2] >= 0.0 && r[2] < 20.0, "{r:?}");
}

#[test]
fn bad_options_fail_cleanly() {
    for (args, msg) in [
        (
            &["--loopback", "--lat", "-q", "2"][..],
            "latency tests use one QP",
        ),
        (
            &["--loopback", "-c", "uc", "--test", "read"][..],
            "UC QPs carry only SEND and RDMA WRITE",
        ),
        (&["--loopback", "-s", "0"][..], "at least 1 byte"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_softverbs-perf"))
            .args(args)
            .output()
            .expect("run");
        assert!(!out.status.success(), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(msg),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn zero_copy_memory_moves_exact_data() {
    // The program's own mapping registered without a copy, for every operation that places
    // data: WRITE, READ and SEND bandwidth (payloads of 64 KiB take the copy-once path between
    // the two endpoints' memory) and WRITE latency, which polls the last byte of the region.
    for (test, metric, size) in [
        ("write", "--bw", "65536"),
        ("read", "--bw", "65536"),
        ("send", "--bw", "65536"),
        ("write", "--lat", "3000"),
    ] {
        let out = perf(&[
            "--loopback",
            "--test",
            test,
            metric,
            "-s",
            size,
            "-n",
            "200",
            "--zero-copy",
            "--check",
        ]);
        let s: f64 = size.parse().unwrap();
        if metric == "--bw" {
            check_bw(&out, &[s]);
        } else {
            check_lat(&out, s);
        }
        assert!(out.contains("owned, zero copy"), "{out}");
        assert!(out.contains("Data check: passed"), "{test} {metric}:\n{out}");
    }
}
