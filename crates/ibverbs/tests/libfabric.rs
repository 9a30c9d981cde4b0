//! Acceptance: libfabric's verbs provider (Debian's `libfabric-bin` 1.17, unmodified) over our
//! `libibverbs.so.1` and `librdmacm.so.1`, between two processes with fi_pingpong's data checks
//! (`-c`) on:
//!
//! - datagram domains: `ofi_rxd` over verbs UD on `sv_lo` (`-p "verbs;ofi_rxd" -e rdm`), and
//!   plain verbs datagram endpoints (`-p verbs -e dgram`);
//! - MSG endpoints (`-p verbs -e msg`: connections through librdmacm, event queues made from
//!   `rdma_cm` event channels) and `ofi_rxm` over them (`-p "verbs;ofi_rxm" -e rdm`, what
//!   fabtests' `fi_rdm_pingpong` runs; Debian does not package fabtests).
//!
//! The verbs provider offers MSG endpoints only on non-loopback interfaces, so those runs use
//! two network namespaces joined by a veth pair (root): the server in one, the client in the
//! other. Every run is bounded.

mod common;

use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::*;

const LIMIT: Duration = Duration::from_secs(120);
const FI_INFO: &str = "/usr/bin/fi_info";
const FI_PINGPONG: &str = "/usr/bin/fi_pingpong";
/// The sizes the reliable tests send and how often: one packet, one MTU, and a 1 MiB message
/// (fewer of those, so that a loaded machine stays well inside the time limit).
const SIZES: [(&str, u64); 3] = [("64", 100), ("4096", 100), ("1048576", 20)];

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

/// Where the two `fi_pingpong` processes run.
enum Hosts<'a> {
    /// Both in this network namespace, the client connecting to 127.0.0.1.
    Loopback,
    /// The server in the first namespace of a pair, the client in the second.
    Veth(&'a Veth),
}

impl Hosts<'_> {
    fn command(&self, i: usize) -> Command {
        match self {
            Hosts::Loopback => fi_command(FI_PINGPONG),
            Hosts::Veth(v) => {
                let mut c = v.command(i, FI_PINGPONG);
                for (k, _) in std::env::vars() {
                    if k.starts_with("FI_") {
                        c.env_remove(k);
                    }
                }
                c
            }
        }
    }

    fn server_addr(&self) -> &str {
        match self {
            Hosts::Loopback => "127.0.0.1",
            Hosts::Veth(v) => &v.ips[0],
        }
    }
}

/// Runs an `fi_pingpong` server and client with `args` on `hosts` (the server on a free control
/// port); both must exit 0. Returns the client's results rows (size, iterations, MB/s,
/// usec/xfer), each checked for every message acknowledged.
fn pingpong_on(hosts: &Hosts<'_>, args: &[&str]) -> Vec<(String, u64, f64, f64)> {
    let port = free_port().to_string();
    let mut s = hosts.command(0);
    s.args(args).args(["-B", &port]);
    let mut server = spawn(s);
    let start = Instant::now();
    while !pid_listening(server.id(), port.parse().unwrap()) {
        let exited = server.try_wait().expect("wait").is_some();
        if exited || start.elapsed() > Duration::from_secs(20) {
            let _ = server.kill();
            let (out, err) = text(&server.wait_with_output().expect("output"));
            panic!("fi_pingpong {args:?}: the server never listened on {port}\n{out}{err}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut c = hosts.command(1);
    c.args(args).args(["-P", &port, hosts.server_addr()]);
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
    let rows: Vec<Vec<&str>> = out
        .lines()
        .skip_while(|l| !l.starts_with("bytes"))
        .skip(1)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert!(!rows.is_empty(), "no results row: {report}");
    rows.iter()
        .map(|row| {
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
        })
        .collect()
}

/// [`pingpong_on`] between two processes of this namespace: one results row.
fn pingpong(args: &[&str]) -> (String, u64, f64, f64) {
    let rows = pingpong_on(&Hosts::Loopback, args);
    assert_eq!(rows.len(), 1, "{rows:?}");
    rows.into_iter().next().unwrap()
}

/// Checks `rows` are the runs of `sizes` (fi_pingpong's names: 64, 4k, 1m), `iterations` each,
/// with a positive time per transfer (fi_pingpong rounds MB/s to 0.00 for small messages on a
/// slow machine). How fast is not checked: the debug build on a shared machine varies too
/// much, and the time limit catches a hang.
fn assert_rows(rows: &[(String, u64, f64, f64)], sizes: &[&str], iterations: u64) {
    let shown: Vec<&str> = rows.iter().map(|r| r.0.as_str()).collect();
    assert_eq!(shown, sizes, "{rows:?}");
    for (size, sent, mb_s, usec) in rows {
        assert_eq!(*sent, iterations, "{size}: {rows:?}");
        assert!(*mb_s >= 0.0 && *usec > 0.0, "{size}: {mb_s} MB/s, {usec} usec");
    }
}

/// Reliable messages of `ofi_rxd` over the verbs provider's UD endpoints on sv_lo, with
/// fi_pingpong's data checks (`-c`), from one packet to many (a 1 MiB message is 256 packets).
fn rxd_pingpong(mode: &str) {
    let _serial = serial();
    for (size, iterations) in SIZES {
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
            &iterations.to_string(),
            "-S",
            size,
        ]);
        assert_eq!(sent, iterations, "{size}: {shown}");
        assert!(mb_s >= 0.0 && usec > 0.0, "{size}: {mb_s} MB/s, {usec} usec");
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

/// Datagrams of the verbs provider's own DGRAM endpoints (no utility provider) on sv_lo,
/// checked, up to the 4 KiB MTU.
#[test]
fn fi_pingpong_dgram_over_verbs_ud() {
    let _serial = serial();
    for (size, iterations) in [("64", 100), ("1024", 100), ("4096", 100)] {
        let (shown, sent, mb_s, usec) = pingpong(&[
            "-p",
            "verbs",
            "-e",
            "dgram",
            "-d",
            "sv_lo-dgram",
            "-c",
            "-I",
            &iterations.to_string(),
            "-S",
            size,
        ]);
        assert_eq!(sent, iterations, "{size}: {shown}");
        assert!(mb_s >= 0.0 && usec > 0.0, "{size}: {mb_s} MB/s, {usec} usec");
    }
}

/// Two hosts (namespaces) joined by a veth pair, for the MSG endpoints.
fn hosts(tag: &str) -> Veth {
    Veth::new(tag, 2, 79)
}

/// `fi_info -p verbs -t FI_EP_MSG` inside a namespace with a veth end: the veth's device has
/// MSG entries, found from its IPv4 and link-local IPv6 addresses; loopback has none.
#[test]
fn fi_info_lists_verbs_msg_domains_of_a_veth() {
    let _serial = serial();
    let v = hosts("finf");
    let mut c = v.command(0, FI_INFO);
    c.args(["-p", "verbs", "-t", "FI_EP_MSG"])
        .env("FI_LOG_LEVEL", "info");
    let o = wait_bounded(c.spawn().expect("spawn fi_info"), LIMIT);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    let dev = format!("sv_{}", v.ifs[0]);
    assert!(
        out.contains(&format!("domain: {dev}\n")) && out.contains("type: FI_EP_MSG"),
        "no FI_EP_MSG domain {dev}:\n{out}"
    );
    assert!(!out.contains("domain: sv_lo\n"), "{out}");
    // The provider found the device from both of its addresses (the link-local one through
    // rdma_getaddrinfo with a scope), and did not give up on the socket address.
    assert!(err.contains(&format!("#1 {dev} - IPoIB addresses")), "{err}");
    assert!(err.contains(&format!("\t{}\n", v.ips[0])), "{err}");
    assert!(err.contains("\tfe80::"), "{err}");
    assert!(!err.contains("handling of the socket address fails"), "{err}");
}

/// Every size fi_pingpong runs over connected MSG endpoints between two hosts: 64 B to 1 MiB,
/// 40 iterations each, every byte checked.
#[test]
fn fi_pingpong_msg_over_verbs_between_two_hosts() {
    let _serial = serial();
    let v = hosts("fmsg");
    let rows = pingpong_on(&Hosts::Veth(&v), &["-p", "verbs", "-e", "msg", "-c", "-I", "40"]);
    assert_rows(&rows, &["64", "256", "1k", "4k", "64k", "1m"], 40);
}

/// `ofi_rxm` (reliable datagrams over MSG connections it sets up on demand) between two hosts,
/// with fi_pingpong's message and tagged modes, from one packet to a rendezvous of 1 MiB.
fn rxm_pingpong(mode: &str, tag: &str) {
    let _serial = serial();
    let v = hosts(tag);
    for (size, iterations) in SIZES {
        let rows = pingpong_on(
            &Hosts::Veth(&v),
            &[
                "-p",
                "verbs;ofi_rxm",
                "-e",
                "rdm",
                "-m",
                mode,
                "-c",
                "-I",
                &iterations.to_string(),
                "-S",
                size,
            ],
        );
        let shown = match size {
            "64" => "64",
            "4096" => "4k",
            _ => "1m",
        };
        assert_rows(&rows, &[shown], iterations);
    }
}

#[test]
fn fi_pingpong_rdm_over_verbs_msg_with_rxm() {
    rxm_pingpong("msg", "frxm");
}

#[test]
fn fi_pingpong_rdm_tagged_over_verbs_msg_with_rxm() {
    rxm_pingpong("tagged", "frxt");
}
