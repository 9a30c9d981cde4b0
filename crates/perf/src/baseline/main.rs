//! `softverbs-baseline`: the kernel and memory-copy baselines `scripts/bench` puts next to the
//! softverbs figures, each between two processes:
//!
//! - `udp-lat`: UDP ping-pong with busy polling (non-blocking `recv` in a loop) on both sides;
//!   one-way latency is half the round trip;
//! - `udp-gso`: UDP throughput with segmentation offload (`UDP_SEGMENT`) at the sender and
//!   receive offload (`UDP_GRO`) at the receiver, bytes counted where they arrive;
//! - `vm-writev`: `process_vm_writev` bandwidth into another process's buffer.
//!
//! Without `--serve`/`--connect` the command starts its peer itself as a child process on
//! 127.0.0.1; with them the two sides can run anywhere (e.g. in two network namespaces). The
//! side that has the result prints it as CSV: a header line, then one row.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use clap::{Args as ClapArgs, Parser, Subcommand};
use softverbs_tools::man;

mod udp_gso;
mod udp_lat;
mod vm_writev;

const DESCRIPTION: &str = concat!(
    "    Measures what the kernel gives on the same machine, for comparison with softverbs: UDP\n",
    "    ping-pong latency with both sides busy-polling (udp-lat), UDP throughput with segmentation\n",
    "    and receive offloads (udp-gso), and the bandwidth of process_vm_writev into another process\n",
    "    (vm-writev). Without --serve or --connect a UDP baseline starts its passive side itself,\n",
    "    as a child process; with them, the two sides can run anywhere, on one host or two.\n",
    "    \"softverbs-baseline COMMAND --help\" lists a command's options.",
);

const EXAMPLES: &[(&str, &str)] = &[
    ("softverbs-baseline udp-lat", "UDP latency between this process and a child on loopback."),
    ("softverbs-baseline udp-gso --serve 10.0.0.2:0   (on one host)\nsoftverbs-baseline udp-gso --connect 10.0.0.2:PORT   (on the other)", "UDP throughput between two hosts (the passive side prints the PORT it bound)."),
    ("softverbs-baseline vm-writev", "process_vm_writev bandwidth into a child process."),
];

const EXIT_STATUS: &str = "0 when the measurement completed; 1 when it failed (the error is printed); 2 when an argument is invalid.";

/// Kernel UDP and process_vm_writev baselines for the softverbs benchmarks.
#[derive(Parser, Debug)]
#[command(
    name = "softverbs-baseline",
    version,
    about = "kernel baselines for the softverbs benchmarks",
    long_about = None,
    before_help = DESCRIPTION,
    after_help = man::SEE_LONG_HELP,
    after_long_help = man::sections(&[], EXAMPLES, EXIT_STATUS),
    help_template = man::PAGE_WITH_COMMANDS,
)]
struct Cli {
    #[command(subcommand)]
    mode: Mode,
}

// Each command's page: its DESCRIPTION and EXAMPLES; `-h` lists the commands with `about`.
#[derive(Subcommand, Debug)]
enum Mode {
    /// UDP ping-pong latency with busy polling on both sides.
    #[command(
        long_about = None,
        before_help = concat!(
            "    Measures UDP ping-pong latency: the active side sends --size bytes, the passive side echoes\n",
            "    them, both busy-polling non-blocking sockets, for --duration seconds after a warm-up. The\n",
            "    latencies printed (minimum, typical, average, 99th percentile) are one-way: half a round trip.",
        ),
        after_help = man::SEE_LONG_HELP,
        after_long_help = man::sections(&[], &[
            ("softverbs-baseline udp-lat -s 8", "8-byte datagrams between this process and a child on 127.0.0.1."),
        ], EXIT_STATUS),
        help_template = man::PAGE,
    )]
    UdpLat(UdpLatArgs),
    /// UDP throughput with UDP_SEGMENT (GSO) at the sender and UDP_GRO at the receiver.
    #[command(
        long_about = None,
        before_help = concat!(
            "    Measures UDP throughput as the kernel offers it at best: the sender hands the kernel\n",
            "    --send-size bytes per call, cut into --segment-byte datagrams (UDP_SEGMENT), and the receiver\n",
            "    takes coalesced batches (UDP_GRO); the bytes are counted where they arrive.",
        ),
        after_help = man::SEE_LONG_HELP,
        after_long_help = man::sections(&[], &[
            ("softverbs-baseline udp-gso", "Between this process and a child on 127.0.0.1, 1472-byte segments."),
        ], EXIT_STATUS),
        help_template = man::PAGE,
    )]
    UdpGso(UdpGsoArgs),
    /// process_vm_writev bandwidth into a child process's buffer.
    #[command(
        long_about = None,
        before_help = concat!(
            "    Measures how fast one process can copy into another's memory with process_vm_writev: the\n",
            "    bound of a shared-memory transfer between two processes. The target is a child process,\n",
            "    which verifies the bytes.",
        ),
        after_help = man::SEE_LONG_HELP,
        after_long_help = man::sections(&[], &[
            ("softverbs-baseline vm-writev -s 1048576", "1 MiB copies for two seconds."),
        ], EXIT_STATUS),
        help_template = man::PAGE,
    )]
    VmWritev(VmWritevArgs),
}

/// Where the two sides of a UDP baseline run.
#[derive(ClapArgs, Debug, Clone)]
struct Placement {
    /// Be the passive side (echo / receiver) bound to ADDR (port 0: any free port); prints
    /// `PORT <n>` once bound.
    #[arg(long, value_name = "ADDR", conflicts_with = "connect")]
    serve: Option<SocketAddr>,

    /// Be the active side (pinger / sender), talking to a passive side at ADDR.
    #[arg(long, value_name = "ADDR")]
    connect: Option<SocketAddr>,
}

#[derive(ClapArgs, Debug)]
struct UdpLatArgs {
    #[command(flatten)]
    place: Placement,
    /// Payload bytes per datagram.
    #[arg(short, long, default_value_t = 8)]
    size: usize,
    /// Seconds of measured ping-pong (after a warm-up of a tenth of it).
    #[arg(short = 'D', long, default_value_t = 2.0)]
    duration: f64,
}

#[derive(ClapArgs, Debug)]
struct UdpGsoArgs {
    #[command(flatten)]
    place: Placement,
    /// GSO segment size (UDP payload bytes per wire datagram).
    #[arg(long, default_value_t = 1472)]
    segment: u16,
    /// Bytes per send call (default: the largest multiple of the segment that fits in one
    /// UDP send, 64768 for 1472-byte segments).
    #[arg(long)]
    send_size: Option<usize>,
    /// Seconds the sender sends.
    #[arg(short = 'D', long, default_value_t = 2.0)]
    duration: f64,
}

#[derive(ClapArgs, Debug)]
struct VmWritevArgs {
    /// Bytes per copy.
    #[arg(short, long, default_value_t = 1 << 20)]
    size: usize,
    /// Seconds of copying.
    #[arg(short = 'D', long, default_value_t = 2.0)]
    duration: f64,
    /// Internal: be the target process (print its pid and buffer address, then verify).
    #[arg(long, hide = true)]
    target: bool,
}

type Result<T> = std::result::Result<T, String>;

/// How long a side waits for its peer to appear before giving up.
const PEER_TIMEOUT: Duration = Duration::from_secs(30);

/// A copy of this executable running as the peer, with its output read line by line.
struct PeerChild {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl PeerChild {
    fn spawn(args: &[String]) -> Result<Self> {
        let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
        let mut child = Command::new(exe)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("spawn peer: {e}"))?;
        let stdout: ChildStdout = child.stdout.take().ok_or("no stdout")?;
        let stdin = child.stdin.take();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).lines() {
                let Ok(l) = l else { return };
                if tx.send(l).is_err() {
                    return;
                }
            }
        });
        Ok(Self { child, stdin, lines })
    }

    /// The next output line, waiting at most `timeout`.
    fn line(&self, timeout: Duration) -> Result<String> {
        self.lines
            .recv_timeout(timeout)
            .map_err(|_| "the peer process printed nothing in time or exited".to_string())
    }

    /// The rest of the output after the peer exits successfully.
    fn finish(mut self, timeout: Duration) -> Result<Vec<String>> {
        drop(self.stdin.take());
        let deadline = std::time::Instant::now() + timeout;
        let status = loop {
            if let Some(s) = self.child.try_wait().map_err(|e| e.to_string())? {
                break s;
            }
            if std::time::Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return Err("the peer process did not finish in time".into());
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        if !status.success() {
            return Err(format!("the peer process failed: {status}"));
        }
        let mut rest = Vec::new();
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(2)) {
            rest.push(l);
        }
        Ok(rest)
    }

    fn send_line(&mut self, line: &str) -> Result<()> {
        let stdin = self.stdin.as_mut().ok_or("peer stdin closed")?;
        writeln!(stdin, "{line}").map_err(|e| format!("write to peer: {e}"))
    }
}

impl Drop for PeerChild {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Starts this executable as the passive side of `mode` on 127.0.0.1 and returns it with the
/// address it bound.
fn spawn_server(mode: &str, extra: &[String]) -> Result<(PeerChild, SocketAddr)> {
    let mut args = vec![mode.to_string(), "--serve".into(), "127.0.0.1:0".into()];
    args.extend_from_slice(extra);
    let peer = PeerChild::spawn(&args)?;
    let line = peer.line(PEER_TIMEOUT)?;
    let port: u16 = line
        .strip_prefix("PORT ")
        .and_then(|p| p.trim().parse().ok())
        .ok_or_else(|| format!("unexpected first line from the peer: {line:?}"))?;
    Ok((peer, SocketAddr::from(([127, 0, 0, 1], port))))
}

/// Prints the `PORT <n>` line of a passive side, at once.
fn announce(port: u16) {
    println!("PORT {port}");
    let _ = std::io::stdout().flush();
}

fn check_duration(d: f64) -> Result<Duration> {
    if d > 0.0 && d.is_finite() {
        Ok(Duration::from_secs_f64(d))
    } else {
        Err("--duration must be positive".into())
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.mode {
        Mode::UdpLat(a) => udp_lat::run(&a),
        Mode::UdpGso(a) => udp_gso::run(&a),
        Mode::VmWritev(a) => vm_writev::run(&a),
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("softverbs-baseline: {e}");
            ExitCode::FAILURE
        }
    }
}
