//! Turning measurements into the figures perftest reports, and printing them as a table, JSON or
//! CSV.

use std::fmt::Write as _;

use crate::cli::Format;

/// One row of a bandwidth test.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BwRow {
    /// Message size.
    pub bytes: usize,
    /// Iterations per QP.
    pub iterations: u64,
    /// Best bandwidth over a window of at least 1/16 of the messages, Gbit/s (10^9).
    pub bw_peak_gbps: f64,
    /// Bandwidth over the whole run, Gbit/s (10^9).
    pub bw_avg_gbps: f64,
    /// Messages per second over the whole run, in millions.
    pub msg_rate_mpps: f64,
    /// Request packets this side resent during the run (RC), over all its QPs.
    pub retransmits: u64,
    /// Retransmission timer expiries during the run, over all its QPs.
    pub timeouts: u64,
    /// Tail probes sent during the run (the newest packet sent again to ask for an
    /// acknowledgement; not in `retransmits`), over all its QPs.
    pub tail_probes: u64,
}

/// One row of a latency test, in microseconds. For SEND and WRITE ping-pong the figures are
/// one-way (half the round trip); for READ and atomics they are the full round trip of a single
/// outstanding operation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatRow {
    /// Message size.
    pub bytes: usize,
    /// Iterations measured.
    pub iterations: u64,
    /// Minimum.
    pub t_min: f64,
    /// Maximum.
    pub t_max: f64,
    /// Median.
    pub t_typical: f64,
    /// Mean.
    pub t_avg: f64,
    /// Standard deviation.
    pub t_stdev: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
}

/// The result of an idle-CPU run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IdleRow {
    /// Seconds spent idle.
    pub seconds: f64,
    /// CPU time (user + system) of the client process, percent of one core.
    pub client_cpu_pct: f64,
    /// CPU time (user + system) of the server process, percent of one core.
    pub server_cpu_pct: f64,
}

/// A result row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Row {
    /// Bandwidth.
    Bw(BwRow),
    /// Latency.
    Lat(LatRow),
    /// Idle CPU.
    Idle(IdleRow),
}

/// The best rate over any stretch of at least `min_msgs` messages, in messages per second.
///
/// `points` are (seconds since the start, messages completed by then), in time order; the start
/// itself (0, 0) is implied. Falls back to the overall rate when no stretch is long enough.
pub fn peak_rate(points: &[(f64, u64)], min_msgs: u64) -> f64 {
    let mut all = Vec::with_capacity(points.len() + 1);
    all.push((0.0, 0u64));
    all.extend_from_slice(points);
    let min_msgs = min_msgs.max(1);
    let mut best: f64 = 0.0;
    let mut i = 0;
    for j in 1..all.len() {
        // Move the window's start as far forward as it can go while staying long enough.
        while i + 1 < j && all[j].1 - all[i + 1].1 >= min_msgs {
            i += 1;
        }
        let (dm, dt) = (all[j].1 - all[i].1, all[j].0 - all[i].0);
        if dm >= min_msgs && dt > 0.0 {
            best = best.max(dm as f64 / dt);
        }
    }
    if best == 0.0 {
        let &(t, m) = all.last().expect("non-empty");
        if t > 0.0 {
            return m as f64 / t;
        }
    }
    best
}

/// Bandwidth figures from a run of `total_msgs` messages of `bytes` bytes in `secs`, with
/// completion `points` as in [`peak_rate`].
pub fn bw_row(bytes: usize, iterations: u64, total_msgs: u64, secs: f64, points: &[(f64, u64)]) -> BwRow {
    let rate = if secs > 0.0 { total_msgs as f64 / secs } else { 0.0 };
    let peak = peak_rate(points, total_msgs / 16).max(rate);
    let bits = bytes as f64 * 8.0;
    BwRow {
        bytes,
        iterations,
        bw_peak_gbps: peak * bits / 1e9,
        bw_avg_gbps: rate * bits / 1e9,
        msg_rate_mpps: rate / 1e6,
        retransmits: 0,
        timeouts: 0,
        tail_probes: 0,
    }
}

/// Latency figures from per-iteration times in nanoseconds, each divided by `divisor` (2 for
/// ping-pong one-way latency).
pub fn lat_row(bytes: usize, samples_ns: &[f64], divisor: f64) -> LatRow {
    let mut v: Vec<f64> = samples_ns.iter().map(|s| s / divisor / 1000.0).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return LatRow {
            bytes,
            iterations: 0,
            t_min: 0.0,
            t_max: 0.0,
            t_typical: 0.0,
            t_avg: 0.0,
            t_stdev: 0.0,
            p99: 0.0,
            p999: 0.0,
        };
    }
    let mean = v.iter().sum::<f64>() / n as f64;
    let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
    let pct = |p: f64| v[((p * n as f64).ceil() as usize).clamp(1, n) - 1];
    LatRow {
        bytes,
        iterations: n as u64,
        t_min: v[0],
        t_max: v[n - 1],
        t_typical: if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        },
        t_avg: mean,
        t_stdev: var.sqrt(),
        p99: pct(0.99),
        p999: pct(0.999),
    }
}

/// `x` with two decimals, or enough for four significant digits when it is below 1 (so that
/// small bandwidths do not print as 0.00).
fn fig(x: f64) -> String {
    if x >= 1.0 || x <= 0.0 || !x.is_finite() {
        format!("{x:.2}")
    } else {
        let digits = (3 - x.log10().floor() as i32).clamp(2, 12) as usize;
        format!("{x:.digits$}")
    }
}

const RULE: &str = "---------------------------------------------------------------------------------------";

/// Prints results as they come, in the chosen format.
#[derive(Debug)]
pub struct Reporter {
    format: Format,
    /// (key, value) pairs describing the run, for the JSON document and the table header.
    meta: Vec<(String, String)>,
    rows: Vec<Row>,
    header_printed: bool,
}

fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Whether `v` is a JSON number as written here: `-?(0|[1-9][0-9]*)(\.[0-9]+)?`.
fn is_json_number(v: &str) -> bool {
    let v = v.strip_prefix('-').unwrap_or(v);
    let (int, frac) = match v.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (v, None),
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    digits(int) && (int == "0" || !int.starts_with('0')) && frac.is_none_or(digits)
}

fn json_num(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.6}")
    } else {
        "null".to_string()
    }
}

impl Reporter {
    /// A reporter printing in `format`; `meta` describes the run (test, device, ...).
    pub fn new(format: Format, meta: Vec<(String, String)>) -> Self {
        Self {
            format,
            meta,
            rows: Vec::new(),
            header_printed: false,
        }
    }

    /// The rows reported so far.
    pub fn rows(&self) -> &[Row] {
        &self.rows
    }

    fn header(row: &Row) -> (&'static str, &'static str) {
        match row {
            Row::Bw(_) => (
                " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]   Resent  Timeouts  Probes",
                "bytes,iterations,bw_peak_gbps,bw_avg_gbps,msg_rate_mpps,retransmits,timeouts,tail_probes",
            ),
            Row::Lat(_) => (
                " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]",
                "bytes,iterations,t_min_us,t_max_us,t_typical_us,t_avg_us,t_stdev_us,p99_us,p999_us",
            ),
            Row::Idle(_) => (
                " #seconds   CPU client[% of a core]   CPU server[% of a core]",
                "seconds,client_cpu_pct,server_cpu_pct",
            ),
        }
    }

    /// Adds a row, printing it at once unless the format is JSON (printed by [`Reporter::finish`]).
    pub fn add(&mut self, row: Row) {
        if !self.header_printed {
            self.header_printed = true;
            let (table, csv) = Self::header(&row);
            match self.format {
                Format::Table => println!("{RULE}\n{table}"),
                Format::Csv => println!("{csv}"),
                Format::Json => {}
            }
        }
        match (self.format, &row) {
            (Format::Table, Row::Bw(r)) => println!(
                " {:<10} {:<14} {:<18} {:<20} {:<15.6} {:<7} {:<9} {}",
                r.bytes,
                r.iterations,
                fig(r.bw_peak_gbps),
                fig(r.bw_avg_gbps),
                r.msg_rate_mpps,
                r.retransmits,
                r.timeouts,
                r.tail_probes
            ),
            (Format::Table, Row::Lat(r)) => println!(
                " {:<7} {:<11} {:<14.2} {:<14.2} {:<16.2} {:<14.2} {:<15.2} {:<22.2} {:.2}",
                r.bytes, r.iterations, r.t_min, r.t_max, r.t_typical, r.t_avg, r.t_stdev, r.p99, r.p999
            ),
            (Format::Table, Row::Idle(r)) => {
                println!(
                    " {:<10.2} {:<25.3} {:.3}",
                    r.seconds, r.client_cpu_pct, r.server_cpu_pct
                );
            }
            (Format::Csv, Row::Bw(r)) => println!(
                "{},{},{:.6},{:.6},{:.6},{},{},{}",
                r.bytes,
                r.iterations,
                r.bw_peak_gbps,
                r.bw_avg_gbps,
                r.msg_rate_mpps,
                r.retransmits,
                r.timeouts,
                r.tail_probes
            ),
            (Format::Csv, Row::Lat(r)) => println!(
                "{},{},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3}",
                r.bytes, r.iterations, r.t_min, r.t_max, r.t_typical, r.t_avg, r.t_stdev, r.p99, r.p999
            ),
            (Format::Csv, Row::Idle(r)) => {
                println!("{:.3},{:.4},{:.4}", r.seconds, r.client_cpu_pct, r.server_cpu_pct);
            }
            (Format::Json, _) => {}
        }
        self.rows.push(row);
    }

    /// Ends the output: the closing rule of the table, or the JSON document.
    pub fn finish(&self) {
        match self.format {
            Format::Table => {
                if self.header_printed {
                    println!("{RULE}");
                }
            }
            Format::Csv => {}
            Format::Json => println!("{}", self.json()),
        }
    }

    /// The JSON document: the run's description and a `results` array.
    pub fn json(&self) -> String {
        let mut s = String::from("{");
        for (k, v) in &self.meta {
            let val = if is_json_number(v) || v == "true" || v == "false" {
                v.clone()
            } else {
                json_str(v)
            };
            let _ = write!(s, "{}:{},", json_str(k), val);
        }
        s.push_str("\"results\":[");
        for (i, row) in self.rows.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            let fields: Vec<(&str, String)> = match row {
                Row::Bw(r) => vec![
                    ("bytes", r.bytes.to_string()),
                    ("iterations", r.iterations.to_string()),
                    ("bw_peak_gbps", json_num(r.bw_peak_gbps)),
                    ("bw_avg_gbps", json_num(r.bw_avg_gbps)),
                    ("msg_rate_mpps", json_num(r.msg_rate_mpps)),
                    ("retransmits", r.retransmits.to_string()),
                    ("timeouts", r.timeouts.to_string()),
                    ("tail_probes", r.tail_probes.to_string()),
                ],
                Row::Lat(r) => vec![
                    ("bytes", r.bytes.to_string()),
                    ("iterations", r.iterations.to_string()),
                    ("t_min_us", json_num(r.t_min)),
                    ("t_max_us", json_num(r.t_max)),
                    ("t_typical_us", json_num(r.t_typical)),
                    ("t_avg_us", json_num(r.t_avg)),
                    ("t_stdev_us", json_num(r.t_stdev)),
                    ("p99_us", json_num(r.p99)),
                    ("p999_us", json_num(r.p999)),
                ],
                Row::Idle(r) => vec![
                    ("seconds", json_num(r.seconds)),
                    ("client_cpu_pct", json_num(r.client_cpu_pct)),
                    ("server_cpu_pct", json_num(r.server_cpu_pct)),
                ],
            };
            s.push('{');
            let body: Vec<String> = fields
                .iter()
                .map(|(k, v)| format!("{}:{v}", json_str(k)))
                .collect();
            s.push_str(&body.join(","));
            s.push('}');
        }
        s.push_str("]}");
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_statistics() {
        let samples: Vec<f64> = (1..=100).map(|i| f64::from(i) * 2000.0).collect();
        let r = lat_row(8, &samples, 2.0);
        assert_eq!(r.iterations, 100);
        assert!((r.t_min - 1.0).abs() < 1e-9 && (r.t_max - 100.0).abs() < 1e-9);
        assert!((r.t_typical - 50.5).abs() < 1e-9);
        assert!((r.t_avg - 50.5).abs() < 1e-9);
        assert!((r.p99 - 99.0).abs() < 1e-9);
        assert!((r.p999 - 100.0).abs() < 1e-9);
        assert!(r.t_stdev > 28.0 && r.t_stdev < 29.0);
    }

    #[test]
    fn peak_is_the_best_window() {
        // 100 messages in the first second, 300 in the next.
        let points = [(1.0, 100), (2.0, 400)];
        assert!((peak_rate(&points, 100) - 300.0).abs() < 1e-9);
        let r = bw_row(1000, 400, 400, 2.0, &points);
        assert!((r.bw_avg_gbps - 200.0 * 8000.0 / 1e9).abs() < 1e-12);
        assert!(r.bw_peak_gbps > r.bw_avg_gbps);
    }

    #[test]
    fn small_figures_keep_significant_digits() {
        assert_eq!(fig(12.345), "12.35");
        assert_eq!(fig(0.000724), "0.0007240");
        assert_eq!(fig(0.5), "0.5000");
        assert_eq!(fig(0.0), "0.00");
    }

    #[test]
    fn json_document() {
        let mut rep = Reporter::new(
            Format::Json,
            vec![("test".into(), "write".into()), ("qps".into(), "2".into())],
        );
        rep.add(Row::Idle(IdleRow {
            seconds: 1.0,
            client_cpu_pct: 0.5,
            server_cpu_pct: 0.25,
        }));
        let j = rep.json();
        assert!(
            j.starts_with("{\"test\":\"write\",\"qps\":2,\"results\":[{\"seconds\":1.000000"),
            "{j}"
        );
        assert!(j.ends_with("}]}"));
    }
}
