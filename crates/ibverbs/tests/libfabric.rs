//! Acceptance: libfabric's verbs provider (Debian's `libfabric-bin`, unmodified) over our
//! `libibverbs.so.1`. Without a connection manager only its datagram domains work: `fi_info`
//! lists `sv_lo-dgram`, and `fi_pingpong` runs reliable messages (`ofi_rxd` over verbs UD)
//! between two processes with its data checks on. Its `msg` and `dgram` endpoint tests open an
//! event queue, which the verbs provider makes from an `rdma_cm` event channel (librdmacm).

mod common;

use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::*;

const LIMIT: Duration = Duration::from_secs(60);
const FI_INFO: &str = "/usr/bin/fi_info";
const FI_PINGPONG: &str = "/usr/bin/fi_pingpong";

/// The runs share two cores; one at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    let guard = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    for program in [FI_INFO, FI_PINGPONG] {
        assert!(
            std::path::Path::new(program).exists(),
            "{program} is not installed: run scripts/setup-deps (libfabric-bin)"
        );
    }
    guard
}

/// A libfabric command on our library, with no `FI_` setting inherited.
fn fi_command(program: &str) -> Command {
    let mut c = command(program);
    for (k, _) in std::env::vars() {
        if k.starts_with("FI_") {
            c.env_remove(k);
        }
    }
    c
}

fn spawn(mut c: Command) -> Child {
    c.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c.spawn().expect("spawn fi_pingpong")
}

/// `fi_info -p verbs` lists the datagram domain of sv_lo.
#[test]
fn fi_info_lists_the_verbs_datagram_domain_of_sv_lo() {
    let _serial = serial();
    let mut c = fi_command(FI_INFO);
    c.args(["-p", "verbs"]);
    let o = run_bounded(c, LIMIT);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    // Each entry is a block of "key: value" lines starting with "provider:".
    let entries: Vec<Vec<&str>> = out
        .split("provider:")
        .skip(1)
        .map(|e| e.lines().map(str::trim).collect())
        .collect();
    assert!(
        entries.iter().any(|e| e[0] == "verbs"
            && e.contains(&"domain: sv_lo-dgram")
            && e.contains(&"type: FI_EP_DGRAM")
            && e.contains(&"protocol: FI_PROTO_IB_UD")),
        "no verbs FI_EP_DGRAM entry for sv_lo-dgram:\n{out}{err}"
    );
}

/// Runs an `fi_pingpong` server and client with `args` (the server on a free control port);
/// both must exit 0. Returns the client's results row: size, iterations, MB/s, usec/xfer.
fn pingpong(args: &[&str]) -> (String, u64, f64, f64) {
    let port = free_port().to_string();
    let mut s = fi_command(FI_PINGPONG);
    s.args(args).args(["-B", &port]);
    let mut server = spawn(s);
    let start = Instant::now();
    while !listening(port.parse().unwrap()) {
        let exited = server.try_wait().expect("wait").is_some();
        if exited || start.elapsed() > Duration::from_secs(20) {
            let _ = server.kill();
            let (out, err) = text(&server.wait_with_output().expect("output"));
            panic!("fi_pingpong {args:?}: the server never listened on {port}\n{out}{err}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut c = fi_command(FI_PINGPONG);
    c.args(args).args(["-P", &port, "127.0.0.1"]);
    let client = spawn(c);
    let c = wait_bounded(client, LIMIT);
    let s = wait_bounded(server, LIMIT);
    let show = |o: &Output| {
        let (out, err) = text(o);
        format!("({:?})\nstdout:\n{out}\nstderr:\n{err}", o.status)
    };
    let report = format!(
        "fi_pingpong {args:?}\n-- client {}\n-- server {}",
        show(&c),
        show(&s)
    );
    assert!(c.status.success() && s.status.success(), "{report}");
    let out = text(&c).0;
    let row: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("bytes"))
        .nth(1)
        .unwrap_or_else(|| panic!("no results row: {report}"))
        .split_whitespace()
        .collect();
    assert_eq!(row.len(), 8, "{report}");
    let sent: u64 = row[1].parse().unwrap_or_else(|_| panic!("{report}"));
    assert_eq!(
        row[2],
        format!("={sent}"),
        "not every message acknowledged: {report}"
    );
    let mb_s: f64 = row[5].parse().unwrap_or_else(|_| panic!("{report}"));
    let usec: f64 = row[6].parse().unwrap_or_else(|_| panic!("{report}"));
    println!("fi_pingpong {args:?}: {}", row.join(" "));
    (row[0].to_string(), sent, mb_s, usec)
}

/// Reliable messages of `ofi_rxd` over the verbs provider's UD endpoints on sv_lo, with
/// fi_pingpong's data checks (`-c`), from one packet to many (a 1 MiB message is 256 packets).
fn rxd_pingpong(mode: &str) {
    let _serial = serial();
    for size in ["64", "4096", "1048576"] {
        let (shown, sent, mb_s, usec) = pingpong(&[
            "-p",
            "verbs;ofi_rxd",
            "-e",
            "rdm",
            "-d",
            "sv_lo-dgram",
            "-m",
            mode,
            "-c",
            "-I",
            "100",
            "-S",
            size,
        ]);
        assert_eq!(sent, 100, "{size}: {shown}");
        assert!(mb_s > 0.0 && usec > 0.0, "{size}: {mb_s} MB/s, {usec} usec");
        // A transfer between two processes on one host taking over 100 ms means a stall.
        assert!(usec < 100_000.0, "{size}: {usec} usec per transfer");
    }
}

#[test]
fn fi_pingpong_rdm_over_verbs_ud_with_rxd() {
    rxd_pingpong("msg");
}

#[test]
fn fi_pingpong_rdm_tagged_over_verbs_ud_with_rxd() {
    rxd_pingpong("tagged");
}
