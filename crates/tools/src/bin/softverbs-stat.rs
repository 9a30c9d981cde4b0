//! `softverbs-stat`: the live counters of every process of this user that uses a softverbs
//! device on this host, as each publishes them on its counter board.

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use softverbs::{host_counters, CounterSnapshot, ProcessCounters};
use softverbs_tools::cli;

/// Show, for every process of this user using a softverbs device on this host, its QPs,
/// packets, bytes, drops by reason and retransmissions, refreshed every interval.
///
/// Each softverbs process keeps its counters in a small shared file of the user's private
/// directory in /dev/shm (its counter board); this tool reads them without disturbing the
/// processes. Rates are per second over the last interval. Only processes of the same user
/// are visible (the boards are private to the user).
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Only this device (e.g. sv_lo).
    #[arg(short = 'd', long)]
    device: Option<String>,

    /// Seconds between refreshes.
    #[arg(short = 'i', long, default_value_t = 1.0)]
    interval: f64,

    /// Stop after this many refreshes (default: until interrupted; 1 with --once).
    #[arg(short = 'n', long)]
    count: Option<u64>,

    /// Print the counters once and exit.
    #[arg(long)]
    once: bool,

    /// Every counter of every process and device, one `pid comm device name value` line each.
    #[arg(short = 'a', long)]
    all: bool,

    /// Include processes of other network namespaces.
    #[arg(long)]
    all_netns: bool,
}

/// Drops by reason, as the table's columns name them.
fn drops(c: &CounterSnapshot) -> [(&'static str, u64); 6] {
    [
        ("malformed", c.rx_malformed),
        ("unknown_qp", c.rx_unknown_qp),
        ("qp_dropped", c.rx_dropped),
        ("bad_pkey", c.rx_bad_pkey),
        ("bad_qkey", c.rx_bad_qkey),
        ("bad_icrc", c.rx_bad_icrc),
    ]
}

fn human(bytes_per_s: f64) -> String {
    let units = ["B", "KB", "MB", "GB"];
    let mut v = bytes_per_s;
    let mut u = 0;
    while v >= 1000.0 && u + 1 < units.len() {
        v /= 1000.0;
        u += 1;
    }
    format!("{v:.1}{}", units[u])
}

fn selected<'a>(
    args: &'a Args,
    procs: &'a [ProcessCounters],
) -> impl Iterator<Item = (&'a ProcessCounters, &'a str, &'a CounterSnapshot)> {
    procs
        .iter()
        .filter(move |p| args.all_netns || p.same_netns)
        .filter(|p| p.pid != std::process::id())
        .flat_map(|p| p.devices.iter().map(move |(d, c)| (p, d.as_str(), c)))
        .filter(move |(_, d, _)| args.device.as_deref().is_none_or(|want| want == *d))
}

fn print_all(args: &Args, procs: &[ProcessCounters]) {
    for (p, dev, c) in selected(args, procs) {
        for (name, value) in CounterSnapshot::NAMES.iter().zip(c.values()) {
            println!("{} {} {dev} {name} {value}", p.pid, p.comm);
        }
    }
}

fn print_table(
    args: &Args,
    procs: &[ProcessCounters],
    last: &HashMap<(u32, String), CounterSnapshot>,
    secs: f64,
) {
    println!(
        "{:>8} {:<16} {:<10} {:>6} {:>12} {:>12} {:>10} {:>10} {:>9} {:>9} {:>8} {:>8}  drops by reason",
        "pid",
        "command",
        "device",
        "qps",
        "tx_packets",
        "rx_packets",
        "tx/s",
        "rx/s",
        "resent",
        "timeouts",
        "seq_nak",
        "rnr_nak"
    );
    let mut rows = 0;
    for (p, dev, c) in selected(args, procs) {
        rows += 1;
        let (tx_rate, rx_rate) = match last.get(&(p.pid, dev.to_string())) {
            Some(prev) if secs > 0.0 => (
                human(c.tx_bytes.saturating_sub(prev.tx_bytes) as f64 / secs),
                human(c.rx_bytes.saturating_sub(prev.rx_bytes) as f64 / secs),
            ),
            _ => ("-".into(), "-".into()),
        };
        let reasons: Vec<String> = drops(c)
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(r, n)| format!("{r}={n}"))
            .collect();
        println!(
            "{:>8} {:<16} {:<10} {:>6} {:>12} {:>12} {:>10} {:>10} {:>9} {:>9} {:>8} {:>8}  {}",
            p.pid,
            p.comm,
            dev,
            c.qps,
            c.tx_packets,
            c.rx_packets,
            tx_rate,
            rx_rate,
            c.retransmits,
            c.timeouts,
            c.seq_naks,
            c.rnr_naks,
            if reasons.is_empty() {
                "-".into()
            } else {
                reasons.join(" ")
            }
        );
    }
    if rows == 0 {
        println!("(no other process of this user uses a softverbs device)");
    }
}

fn main() -> ExitCode {
    let args: Args = cli::parse_args();
    if !(args.interval > 0.0 && args.interval.is_finite()) {
        eprintln!("softverbs-stat: the interval must be a positive number of seconds");
        return ExitCode::from(2);
    }
    let count = if args.once { Some(1) } else { args.count };
    let mut last: HashMap<(u32, String), CounterSnapshot> = HashMap::new();
    let mut then = Instant::now();
    let mut n = 0u64;
    loop {
        let procs = host_counters();
        let secs = then.elapsed().as_secs_f64();
        then = Instant::now();
        if args.all {
            print_all(&args, &procs);
        } else {
            print_table(&args, &procs, &last, secs);
        }
        last = procs
            .iter()
            .flat_map(|p| p.devices.iter().map(move |(d, c)| ((p.pid, d.clone()), *c)))
            .collect();
        n += 1;
        if count.is_some_and(|c| n >= c) {
            return ExitCode::SUCCESS;
        }
        std::thread::sleep(Duration::from_secs_f64(args.interval));
        println!();
    }
}
