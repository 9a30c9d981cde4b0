//! Command-line options, and the test parameters the client hands to the server.

use std::fmt;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use softverbs_tools::man;

use crate::error::{bail, Error, Result};

/// The operation a test exercises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TestKind {
    /// SEND/RECV.
    Send,
    /// RDMA WRITE.
    Write,
    /// RDMA READ.
    Read,
    /// Atomics (fetch-and-add or compare-and-swap, see `--atomic-type`).
    Atomic,
}

impl TestKind {
    /// The name used on the command line and in machine-readable output.
    pub fn name(self) -> &'static str {
        match self {
            Self::Send => "send",
            Self::Write => "write",
            Self::Read => "read",
            Self::Atomic => "atomic",
        }
    }

    fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "send" => Self::Send,
            "write" => Self::Write,
            "read" => Self::Read,
            "atomic" => Self::Atomic,
            _ => bail!("unknown test {s:?}"),
        })
    }
}

/// The atomic operation of `--test atomic`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AtomicKind {
    /// Fetch-and-add 1.
    FetchAdd,
    /// Compare-and-swap, each operation moving the word from k to k+1.
    CmpSwap,
}

impl AtomicKind {
    /// The name used on the command line and in machine-readable output.
    pub fn name(self) -> &'static str {
        match self {
            Self::FetchAdd => "fetch-add",
            Self::CmpSwap => "cmp-swap",
        }
    }
}

/// The transport service of the QPs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Connection {
    /// Reliable connected: acknowledged, retransmitted.
    Rc,
    /// Unreliable connected: no acknowledgements (SEND and WRITE only).
    Uc,
}

impl Connection {
    /// The name used on the command line and in machine-readable output.
    pub fn name(self) -> &'static str {
        match self {
            Self::Rc => "RC",
            Self::Uc => "UC",
        }
    }
}

/// What is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    /// Bandwidth and message rate: many operations in flight.
    Bw,
    /// Latency: one operation at a time (ping-pong for SEND and WRITE).
    Lat,
    /// CPU used by connected, idle processes.
    Idle,
}

impl Metric {
    /// The name used in machine-readable output.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bw => "bw",
            Self::Lat => "lat",
            Self::Idle => "idle",
        }
    }
}

const DESCRIPTION: &str = concat!(
    "    Measures RDMA operations between two processes in the manner of perftest: SEND, RDMA\n",
    "    WRITE, RDMA READ and atomics, for bandwidth and message rate (--bw, the default) or latency\n",
    "    (--lat), over RC or UC, one size or a sweep of sizes, and the CPU an idle connection uses\n",
    "    (--idle-cpu). Start a server (no HOST) on one side and a client (with HOST) on the other, or\n",
    "    both in one command with --loopback. The client chooses the test and hands its parameters to\n",
    "    the server over a TCP connection, which also carries the QP numbers, PSNs, GIDs, rkeys and\n",
    "    addresses of both sides. Both sides print their results.",
);

const EXAMPLES: &[(&str, &str)] = &[
    (
        "softverbs-perf --loopback --test write --bw -s 65536",
        "RDMA WRITE bandwidth with 64 KiB messages, server and client in one command.",
    ),
    (
        "softverbs-perf &\nsoftverbs-perf --test send --lat -s 8 127.0.0.1",
        "SEND latency of 8-byte messages between two processes.",
    ),
    (
        "softverbs-perf --loopback --test read --sweep",
        "RDMA READ bandwidth for every power of two from 2 bytes to 8 MiB.",
    ),
    (
        "SOFTVERBS_SHM=0 softverbs-perf --loopback --test write --bw -q 4 -s 64",
        "The message rate of 4 QPs over UDP instead of shared memory.",
    ),
];

const EXIT_STATUS: &str = "0 when the measurement completed; 1 when it failed (the error is printed); 2 when an argument is invalid.";

/// A perftest-style benchmark for the softverbs software RoCEv2 device.
///
/// Start a server (no HOST) on one side and a client (with HOST) on the other, or run both in
/// one command with --loopback. The client chooses the test and hands its parameters to the
/// server over a TCP connection, which also carries the QP numbers, PSNs, GIDs, rkeys and
/// addresses of both sides.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "softverbs-perf",
    version,
    about = "bandwidth, message rate and latency of softverbs",
    long_about = None,
    before_help = DESCRIPTION,
    after_help = man::SEE_LONG_HELP,
    after_long_help = man::sections(man::DEVICE_ENVIRONMENT, EXAMPLES, EXIT_STATUS),
    help_template = man::PAGE_WITH_OPERANDS,
)]
pub struct Args {
    /// Server to connect to; without it, this process is the server.
    pub host: Option<String>,

    /// The operation to measure.
    #[arg(long, value_enum, default_value_t = TestKind::Write)]
    pub test: TestKind,

    /// Measure bandwidth and message rate (the default).
    #[arg(long, conflicts_with = "lat")]
    pub bw: bool,

    /// Measure latency: ping-pong for send and write (one-way = RTT/2), single outstanding
    /// round trips for read and atomic.
    #[arg(long)]
    pub lat: bool,

    /// Message size in bytes (default 65536 for --bw, 2 for --lat; atomics are always 8).
    #[arg(short, long, conflicts_with = "sweep", value_parser = parse_size_arg)]
    pub size: Option<usize>,

    /// Run several sizes: without a value every power of two from 2 to 8 MiB, or a
    /// comma-separated list (suffixes k and m are 1024 and 1048576).
    #[arg(long, value_name = "LIST", num_args = 0..=1, default_missing_value = "all")]
    pub sweep: Option<String>,

    /// Iterations per QP (default 5000 for --bw, 1000 for --lat).
    #[arg(short = 'n', long, conflicts_with = "duration")]
    pub iters: Option<u64>,

    /// Run each size for this many seconds instead of a number of iterations.
    #[arg(short = 'D', long, value_name = "SECS")]
    pub duration: Option<f64>,

    /// Outstanding work requests per QP.
    #[arg(short = 't', long, default_value_t = 128)]
    pub tx_depth: u32,

    /// Receive work requests kept posted per QP (send tests).
    #[arg(short = 'r', long, default_value_t = 512)]
    pub rx_depth: u32,

    /// Number of QPs; work is posted to them round-robin (bandwidth tests only).
    #[arg(short = 'q', long, default_value_t = 1)]
    pub qps: u32,

    /// Request a completion for every N-th work request.
    #[arg(short = 'Q', long, default_value_t = 100)]
    pub cq_mod: u32,

    /// Post work requests in lists of up to N per ibv_post_send call (bandwidth tests).
    #[arg(short = 'l', long, default_value_t = 1)]
    pub post_list: u32,

    /// Sleep on a completion channel when the CQ is empty instead of busy-polling it
    /// (perftest's --use_event).
    #[arg(short = 'e', long)]
    pub use_event: bool,

    /// Send messages of up to BYTES inline (IBV_SEND_INLINE); without a value, up to the
    /// device maximum (512).
    #[arg(short = 'I', long, value_name = "BYTES", num_args = 0..=1, default_missing_value = "512")]
    pub inline: Option<u32>,

    /// Path MTU in bytes (256, 512, 1024, 2048 or 4096; default: the port's active MTU).
    #[arg(short = 'm', long)]
    pub mtu: Option<u32>,

    /// Device (e.g. sv_lo) or network interface (e.g. lo); default: the device holding the
    /// address the TCP connection uses.
    #[arg(short = 'd', long)]
    pub device: Option<String>,

    /// Source GID index; default: the GID of the TCP connection's local address.
    #[arg(short = 'g', long)]
    pub gid_index: Option<u32>,

    /// TCP port of the out-of-band exchange.
    #[arg(short = 'p', long, default_value_t = 18515)]
    pub port: u16,

    /// The atomic operation of --test atomic.
    #[arg(short = 'A', long, value_enum, default_value_t = AtomicKind::FetchAdd)]
    pub atomic_type: AtomicKind,

    /// Transport service: RC, or UC (no acknowledgements; send and write only).
    #[arg(short = 'c', long, value_enum, default_value_t = Connection::Rc)]
    pub connection: Connection,

    /// Run server and client in one command: the server is a child process (RoCEv2 over UDP
    /// between the two), or a thread with --threads.
    #[arg(long, conflicts_with = "host")]
    pub loopback: bool,

    /// With --loopback: server and client are two threads of one process (in-memory path).
    #[arg(long, requires = "loopback")]
    pub threads: bool,

    /// Print the results as one JSON document.
    #[arg(long, conflicts_with = "csv")]
    pub json: bool,

    /// Print the results as CSV.
    #[arg(long)]
    pub csv: bool,

    /// Also draw the results as an SVG chart in FILE: bandwidth and latency against message
    /// size (use with --sweep). With --loopback and neither --bw nor --lat, both are measured,
    /// one sweep after the other (with --json, one document per line for each).
    #[arg(long, value_name = "FILE", conflicts_with = "idle_cpu")]
    pub plot: Option<std::path::PathBuf>,

    /// Verify the data at the end of each size (and the atomic counters).
    #[arg(long)]
    pub check: bool,

    /// Register memory the program owns (a page-aligned anonymous mapping, as perftest
    /// allocates) without a copy (`register_owned`), instead of memory the safe API allocates
    /// as atomic words. Both sides use it (the client tells the server).
    #[arg(long)]
    pub zero_copy: bool,

    /// Connect the QPs, then stay idle for SECS and report the CPU time used by each process
    /// (user + system, as a percentage of one core).
    #[arg(long, value_name = "SECS")]
    pub idle_cpu: Option<f64>,

    /// Warm-up iterations before each measured run (default: the TX depth for --bw, 100 for
    /// --lat).
    #[arg(long)]
    pub warmup: Option<u64>,

    /// Internal: print `PORT <n>` once listening and print nothing else (the loopback child).
    #[arg(long, hide = true)]
    pub announce: bool,
}

impl Args {
    /// What is measured.
    pub fn metric(&self) -> Metric {
        if self.idle_cpu.is_some() {
            Metric::Idle
        } else if self.lat {
            Metric::Lat
        } else {
            Metric::Bw
        }
    }
}

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// perftest-style table.
    Table,
    /// One JSON document.
    Json,
    /// CSV with a header line.
    Csv,
}

/// The parameters of a run, chosen by the client and adopted by the server.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// The operation.
    pub test: TestKind,
    /// What is measured.
    pub metric: Metric,
    /// Message sizes, in order.
    pub sizes: Vec<usize>,
    /// Iterations per QP; `None` with a duration.
    pub iters: Option<u64>,
    /// Seconds per size; `None` with a number of iterations.
    pub duration: Option<f64>,
    /// Warm-up iterations per QP before each measured run.
    pub warmup: u64,
    /// Outstanding send WRs per QP.
    pub tx_depth: u32,
    /// Posted receive WRs per QP.
    pub rx_depth: u32,
    /// Number of QPs.
    pub qps: u32,
    /// Completion moderation.
    pub cq_mod: u32,
    /// Work requests per post call.
    pub post_list: u32,
    /// Largest inline message (0: none).
    pub inline: u32,
    /// Wait for completions on a completion channel.
    pub use_event: bool,
    /// Path MTU in bytes (0: the port's active MTU).
    pub mtu: u32,
    /// The atomic operation.
    pub atomic: AtomicKind,
    /// Transport service.
    pub connection: Connection,
    /// Verify data.
    pub check: bool,
    /// Register owned memory without a copy.
    pub zero_copy: bool,
    /// Idle seconds (`Metric::Idle`).
    pub idle_secs: f64,
}

/// Largest message of the default sweep.
pub const MAX_SWEEP: usize = 8 << 20;

fn parse_size_arg(s: &str) -> Result<usize, String> {
    parse_size(s).map_err(|e| e.to_string())
}

fn parse_size(s: &str) -> Result<usize> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 1024),
        Some('m' | 'M') => (&s[..s.len() - 1], 1 << 20),
        _ => (s, 1),
    };
    let n: usize = num.parse().map_err(|_| Error::msg(format!("bad size {s:?}")))?;
    n.checked_mul(mult)
        .ok_or_else(|| Error::msg(format!("size {s:?} is too large")))
}

impl Params {
    /// The parameters the options ask for, checked for consistency.
    pub fn from_args(a: &Args) -> Result<Self> {
        let metric = a.metric();
        let sizes = if a.test == TestKind::Atomic {
            vec![8]
        } else if let Some(list) = &a.sweep {
            if list == "all" {
                (1..=23).map(|k| 1usize << k).collect()
            } else {
                list.split(',').map(parse_size).collect::<Result<Vec<_>>>()?
            }
        } else {
            vec![a.size.unwrap_or(if metric == Metric::Lat { 2 } else { 65536 })]
        };
        if sizes.is_empty() || sizes.contains(&0) {
            bail!("message sizes must be at least 1 byte");
        }
        if sizes.iter().any(|&s| s > 1 << 30) {
            bail!("message sizes are limited to 1 GiB");
        }
        if metric == Metric::Lat && a.qps > 1 {
            bail!("latency tests use one QP (-q 1)");
        }
        if a.qps == 0 || a.tx_depth == 0 || a.rx_depth == 0 || a.cq_mod == 0 || a.post_list == 0 {
            bail!("--qps, --tx-depth, --rx-depth, --cq-mod and --post-list must be at least 1");
        }
        if let Some(d) = a.duration {
            if !(d > 0.0 && d.is_finite()) {
                bail!("--duration must be positive");
            }
        }
        if a.connection == Connection::Uc && matches!(a.test, TestKind::Read | TestKind::Atomic) {
            bail!("UC QPs carry only SEND and RDMA WRITE");
        }
        if a.iters == Some(0) {
            bail!("--iters must be at least 1");
        }
        if let Some(m) = a.mtu {
            if ![256, 512, 1024, 2048, 4096].contains(&m) {
                bail!("--mtu must be 256, 512, 1024, 2048 or 4096");
            }
        }
        let idle_secs = a.idle_cpu.unwrap_or(0.0);
        if a.idle_cpu.is_some() && !(idle_secs > 0.0 && idle_secs.is_finite()) {
            bail!("--idle-cpu needs a positive number of seconds");
        }
        let iters = match a.duration {
            Some(_) => None,
            None => Some(a.iters.unwrap_or(if metric == Metric::Lat { 1000 } else { 5000 })),
        };
        let warmup = a.warmup.unwrap_or(if metric == Metric::Lat {
            100
        } else {
            u64::from(a.tx_depth)
        });
        Ok(Self {
            test: a.test,
            metric,
            sizes,
            iters,
            duration: a.duration,
            warmup,
            tx_depth: a.tx_depth,
            rx_depth: a.rx_depth,
            qps: a.qps,
            cq_mod: a.cq_mod.min(a.tx_depth),
            post_list: a.post_list.min(a.tx_depth),
            inline: a.inline.unwrap_or(0),
            use_event: a.use_event,
            mtu: a.mtu.unwrap_or(0),
            atomic: a.atomic_type,
            connection: a.connection,
            check: a.check,
            zero_copy: a.zero_copy,
            idle_secs,
        })
    }

    /// The largest message size.
    pub fn max_size(&self) -> usize {
        self.sizes.iter().copied().max().unwrap_or(8)
    }

    /// The duration of each size, if the run is timed.
    pub fn duration(&self) -> Option<Duration> {
        self.duration.map(Duration::from_secs_f64)
    }

    /// The space-separated `key=value` form sent to the server.
    pub fn encode(&self) -> String {
        let sizes: Vec<String> = self.sizes.iter().map(ToString::to_string).collect();
        format!(
            "test={} metric={} sizes={} iters={} duration={} warmup={} tx_depth={} rx_depth={} qps={} cq_mod={} \
             post_list={} inline={} event={} mtu={} atomic={} conn={} check={} zero_copy={} idle={}",
            self.test.name(),
            self.metric.name(),
            sizes.join(","),
            self.iters.unwrap_or(0),
            self.duration.unwrap_or(0.0),
            self.warmup,
            self.tx_depth,
            self.rx_depth,
            self.qps,
            self.cq_mod,
            self.post_list,
            self.inline,
            u8::from(self.use_event),
            self.mtu,
            self.atomic.name(),
            self.connection.name(),
            u8::from(self.check),
            u8::from(self.zero_copy),
            self.idle_secs,
        )
    }

    /// Parses [`Params::encode`]'s output.
    pub fn decode(s: &str) -> Result<Self> {
        let mut p = Self {
            test: TestKind::Write,
            metric: Metric::Bw,
            sizes: vec![65536],
            iters: Some(5000),
            duration: None,
            warmup: 0,
            tx_depth: 128,
            rx_depth: 512,
            qps: 1,
            cq_mod: 100,
            post_list: 1,
            inline: 0,
            use_event: false,
            mtu: 0,
            atomic: AtomicKind::FetchAdd,
            connection: Connection::Rc,
            check: false,
            zero_copy: false,
            idle_secs: 0.0,
        };
        fn num<T: std::str::FromStr>(k: &str, v: &str) -> Result<T> {
            v.parse()
                .map_err(|_| Error::msg(format!("bad value {v:?} for {k}")))
        }
        for kv in s.split_whitespace() {
            let Some((k, v)) = kv.split_once('=') else {
                bail!("bad parameter {kv:?}")
            };
            match k {
                "test" => p.test = TestKind::parse(v)?,
                "metric" => {
                    p.metric = match v {
                        "bw" => Metric::Bw,
                        "lat" => Metric::Lat,
                        "idle" => Metric::Idle,
                        _ => bail!("unknown metric {v:?}"),
                    }
                }
                "sizes" => p.sizes = v.split(',').map(|s| num(k, s)).collect::<Result<_>>()?,
                "iters" => p.iters = Some(num::<u64>(k, v)?).filter(|&n| n > 0),
                "duration" => p.duration = Some(num::<f64>(k, v)?).filter(|&d| d > 0.0),
                "warmup" => p.warmup = num(k, v)?,
                "tx_depth" => p.tx_depth = num(k, v)?,
                "rx_depth" => p.rx_depth = num(k, v)?,
                "qps" => p.qps = num(k, v)?,
                "cq_mod" => p.cq_mod = num(k, v)?,
                "post_list" => p.post_list = num(k, v)?,
                "inline" => p.inline = num(k, v)?,
                "event" => p.use_event = v == "1",
                "mtu" => p.mtu = num(k, v)?,
                "atomic" => {
                    p.atomic = match v {
                        "fetch-add" => AtomicKind::FetchAdd,
                        "cmp-swap" => AtomicKind::CmpSwap,
                        _ => bail!("unknown atomic {v:?}"),
                    }
                }
                "conn" => {
                    p.connection = match v {
                        "RC" => Connection::Rc,
                        "UC" => Connection::Uc,
                        _ => bail!("unknown connection {v:?}"),
                    }
                }
                "check" => p.check = v == "1",
                "zero_copy" => p.zero_copy = v == "1",
                "idle" => p.idle_secs = num(k, v)?,
                // Unknown keys come from a newer client; ignore them.
                _ => {}
            }
        }
        if p.qps == 0
            || p.tx_depth == 0
            || p.rx_depth == 0
            || p.cq_mod == 0
            || p.post_list == 0
            || p.sizes.is_empty()
        {
            bail!("inconsistent parameters: {s}");
        }
        Ok(p)
    }

    /// The test's title, as perftest names it (e.g. "RDMA_Write BW Test").
    pub fn title(&self) -> String {
        let op = match self.test {
            TestKind::Send => "Send",
            TestKind::Write => "RDMA_Write",
            TestKind::Read => "RDMA_Read",
            TestKind::Atomic => match self.atomic {
                AtomicKind::FetchAdd => "Atomic FETCH_AND_ADD",
                AtomicKind::CmpSwap => "Atomic CMP_AND_SWAP",
            },
        };
        match self.metric {
            Metric::Bw => format!("{op} BW Test"),
            Metric::Lat => format!("{op} Latency Test"),
            Metric::Idle => "Idle CPU Test".to_string(),
        }
    }
}

impl fmt::Display for Params {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.encode())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_round_trip() {
        let a = Args::parse_from([
            "softverbs-perf",
            "--test",
            "read",
            "--sweep",
            "2,4k,1m",
            "-q",
            "3",
            "--check",
            "--zero-copy",
        ]);
        let p = Params::from_args(&a).unwrap();
        assert_eq!(p.sizes, vec![2, 4096, 1 << 20]);
        assert!(p.zero_copy);
        assert_eq!(Params::decode(&p.encode()).unwrap(), p);
        let a = Args::parse_from([
            "softverbs-perf",
            "--lat",
            "--test",
            "send",
            "-D",
            "1.5",
            "-I",
            "-c",
            "uc",
        ]);
        let p = Params::from_args(&a).unwrap();
        assert_eq!((p.sizes.clone(), p.iters, p.inline), (vec![2], None, 512));
        assert_eq!(Params::decode(&p.encode()).unwrap(), p);
    }

    #[test]
    fn default_sweep_is_powers_of_two_to_8_mib() {
        let a = Args::parse_from(["softverbs-perf", "--sweep"]);
        let p = Params::from_args(&a).unwrap();
        assert_eq!(p.sizes.first(), Some(&2));
        assert_eq!(p.sizes.last(), Some(&MAX_SWEEP));
        assert_eq!(p.sizes.len(), 23);
    }
}
