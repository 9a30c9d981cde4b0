//! Acceptance: UCX (Debian's `ucx-utils`, unmodified) over our `libibverbs.so.1`. `ucx_info -d`
//! must list the `rc_verbs` and `ud_verbs` transports on `sv_lo`, and `ucx_perftest` must run
//! between two processes over them, both through UCP (`UCX_TLS`) and directly on the UCT
//! transport (`-x`).
//!
//! UCX uses a verbs device only if `/dev/infiniband/<dev_name>` is a character device the user
//! may read and write. If that node is missing, these tests create it with
//! `scripts/dev-nodes add sv_lo` (root) and remove it again when they end; a node that was there
//! before is left alone. Without root and without the node they fail, saying what to run.
//!
//! UCX before 1.19 reads the IP version of a RoCE datagram from `wc.sl` (an mlx5 convention), so
//! with an IPv4 GID its `ud_verbs` drops every datagram unless `UCX_UD_ETH_DGID_CHECK=n`; with
//! an IPv6 GID (`UCX_IB_GID_INDEX`) the check passes as it is.

mod common;

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::*;

const LIMIT: Duration = Duration::from_secs(60);
const NODE: &str = "/dev/infiniband/sv_lo";
const UCX_INFO: &str = "/usr/bin/ucx_info";
const UCX_PERFTEST: &str = "/usr/bin/ucx_perftest";

/// One test at a time holds this: it serialises the runs (they share two cores) and owns the
/// placeholder node while it is needed. A node this guard added is removed on drop.
struct Ucx {
    node: DevNode,
    _serial: MutexGuard<'static, ()>,
}

impl Ucx {
    fn new() -> Self {
        static LOCK: Mutex<()> = Mutex::new(());
        let serial = LOCK.lock().unwrap_or_else(|p| p.into_inner());
        for program in [UCX_INFO, UCX_PERFTEST] {
            assert!(
                Path::new(program).exists(),
                "{program} is not installed: run scripts/setup-deps (ucx-utils)"
            );
        }
        Self {
            node: DevNode::ensure("sv_lo"),
            _serial: serial,
        }
    }
}

/// A UCX command on our library, with `env` and nothing else of UCX's configuration inherited.
fn ucx_command(program: &str, env: &[(&str, &str)]) -> Command {
    let mut c = command(program);
    for (k, _) in std::env::vars() {
        if k.starts_with("UCX_") {
            c.env_remove(k);
        }
    }
    c.envs(env.iter().copied());
    c
}

fn spawn(mut c: Command) -> Child {
    c.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c.spawn().expect("spawn ucx_perftest")
}

/// The numbers of `ucx_perftest`'s `Final:` row.
#[derive(Debug)]
struct Final {
    iterations: u64,
    latency_avg_us: f64,
    bandwidth_avg_mb_s: f64,
    rate_avg: f64,
}

fn final_row(out: &str) -> Option<Final> {
    let line = out.lines().find(|l| l.trim_start().starts_with("Final:"))?;
    let cols: Vec<&str> = line.split_whitespace().skip(1).collect();
    if cols.len() != 8 {
        return None;
    }
    let f = |i: usize| cols[i].parse::<f64>().ok();
    Some(Final {
        iterations: cols[0].parse().ok()?,
        latency_avg_us: f(2)?,
        bandwidth_avg_mb_s: f(4)?,
        rate_avg: f(6)?,
    })
}

/// Runs an `ucx_perftest` server and client (`args` plus `-p PORT`, the client also
/// `127.0.0.1`) with `env`; both must exit 0 and report no error. Returns the client's final
/// row and its whole output.
fn perftest(env: &[(&str, &str)], args: &[&str]) -> (Final, String) {
    let port = free_port();
    let mut args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    args.extend(["-p".into(), port.to_string()]);
    let mut s = ucx_command(UCX_PERFTEST, env);
    s.args(&args);
    let mut server = spawn(s);
    let start = Instant::now();
    while !listening(port) {
        let exited = server.try_wait().expect("wait").is_some();
        if exited || start.elapsed() > Duration::from_secs(20) {
            let _ = server.kill();
            let (out, err) = text(&server.wait_with_output().expect("output"));
            panic!("ucx_perftest {args:?}: the server never listened on {port}\n{out}{err}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut c = ucx_command(UCX_PERFTEST, env);
    c.args(&args).arg("127.0.0.1");
    let client = spawn(c);
    let c = wait_bounded(client, LIMIT);
    let s = wait_bounded(server, LIMIT);
    let show = |o: &Output| {
        let (out, err) = text(o);
        format!("({:?})\nstdout:\n{out}\nstderr:\n{err}", o.status)
    };
    let report = format!(
        "ucx_perftest {args:?} {env:?}\n-- client {}\n-- server {}",
        show(&c),
        show(&s)
    );
    assert!(c.status.success() && s.status.success(), "{report}");
    for o in [&c, &s] {
        assert!(!text(o).1.contains(" ERROR "), "{report}");
    }
    let out = text(&c);
    let row = final_row(&out.0).unwrap_or_else(|| panic!("no Final row: {report}"));
    (row, format!("{}{}", out.0, out.1))
}

/// Checks the row is a completed run of `n` iterations with positive, finite figures.
fn assert_sane(row: &Final, n: u64, what: &str) {
    println!("{what}: {row:?}");
    assert_eq!(row.iterations, n, "{what}: {row:?}");
    for v in [row.latency_avg_us, row.bandwidth_avg_mb_s, row.rate_avg] {
        assert!(v.is_finite() && v > 0.0, "{what}: {row:?}");
    }
    // Two processes on one host: a round trip beyond 10 ms on average means something stalls.
    assert!(row.latency_avg_us < 10_000.0, "{what}: {row:?}");
}

/// A UCP test over `sv_lo` with the given `UCX_TLS`; the client's log must show that `lane`
/// (e.g. `tag(rc_verbs/sv_lo:1)`) carried the traffic.
fn ucp(tls: &str, extra_env: &[(&str, &str)], test: &str, size: &str, lane: &str) -> Final {
    let _ucx = Ucx::new();
    let mut env = vec![
        ("UCX_NET_DEVICES", "sv_lo:1"),
        ("UCX_TLS", tls),
        ("UCX_LOG_LEVEL", "info"),
    ];
    env.extend_from_slice(extra_env);
    let (row, log) = perftest(&env, &["-t", test, "-s", size, "-n", "2000"]);
    assert!(log.contains(lane), "{test} did not run on {lane}:\n{log}");
    assert_sane(&row, 2000, test);
    row
}

const RC: &str = "rc_verbs,ud_verbs:aux,self";
const UD: &str = "ud_verbs,self";
const NO_DGID_CHECK: (&str, &str) = ("UCX_UD_ETH_DGID_CHECK", "n");

/// `ucx_info -d`'s output.
fn ucx_info() -> String {
    let mut c = ucx_command(UCX_INFO, &[]);
    c.arg("-d");
    let o = run_bounded(c, LIMIT);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    out + &err
}

/// The lines of `ucx_info -d`'s section about memory domain `md`.
fn md_section<'a>(out: &'a str, md: &str) -> Vec<&'a str> {
    out.lines()
        .skip_while(|l| l.trim() != format!("# Memory domain: {md}"))
        .skip(1)
        .take_while(|l| !l.contains("Memory domain:"))
        .collect()
}

/// `ucx_info -d` lists both verbs transports on port 1 of sv_lo. When the test made the node
/// itself, it also shows that UCX ignores sv_lo without it.
#[test]
fn ucx_info_lists_rc_verbs_and_ud_verbs_on_sv_lo() {
    let ucx = Ucx::new();
    if ucx.node.added {
        dev_nodes(&["remove", "sv_lo"]);
        let out = ucx_info();
        dev_nodes(&["add", "sv_lo"]);
        assert!(
            md_section(&out, "sv_lo").is_empty() && !out.contains("sv_lo:1"),
            "UCX used sv_lo without {NODE}:\n{out}"
        );
    }
    let out = ucx_info();
    let domain = md_section(&out, "sv_lo");
    assert!(!domain.is_empty(), "no sv_lo memory domain:\n{out}");
    assert!(domain.iter().any(|l| l.contains("Component: ib")), "{out}");
    for tl in ["rc_verbs", "ud_verbs"] {
        let at = domain
            .iter()
            .position(|l| l.trim_start_matches('#').trim() == format!("Transport: {tl}"))
            .unwrap_or_else(|| panic!("no {tl} on sv_lo:\n{out}"));
        assert!(
            domain.get(at + 1).is_some_and(|l| l.contains("Device: sv_lo:1")),
            "{tl} not on sv_lo:1:\n{out}"
        );
    }
}

#[test]
fn ucx_perftest_tag_lat_over_rc_verbs() {
    ucp(RC, &[NO_DGID_CHECK], "tag_lat", "8", "tag(rc_verbs/sv_lo:1)");
}

#[test]
fn ucx_perftest_tag_bw_over_rc_verbs() {
    let row = ucp(RC, &[NO_DGID_CHECK], "tag_bw", "65536", "tag(rc_verbs/sv_lo:1)");
    assert!(row.bandwidth_avg_mb_s > 1.0, "{row:?}");
}

#[test]
fn ucx_perftest_ucp_put_bw_over_rc_verbs() {
    let row = ucp(
        RC,
        &[NO_DGID_CHECK],
        "ucp_put_bw",
        "65536",
        "rma(rc_verbs/sv_lo:1)",
    );
    assert!(row.bandwidth_avg_mb_s > 1.0, "{row:?}");
}

#[test]
fn ucx_perftest_tag_lat_over_ud_verbs() {
    ucp(UD, &[NO_DGID_CHECK], "tag_lat", "8", "tag(ud_verbs/sv_lo:1)");
}

#[test]
fn ucx_perftest_tag_bw_over_ud_verbs() {
    let row = ucp(UD, &[NO_DGID_CHECK], "tag_bw", "65536", "tag(ud_verbs/sv_lo:1)");
    assert!(row.bandwidth_avg_mb_s > 1.0, "{row:?}");
}

#[test]
fn ucx_perftest_ucp_put_bw_over_ud_verbs() {
    // ud_verbs has no RDMA: UCP emulates puts with active messages.
    let row = ucp(
        UD,
        &[NO_DGID_CHECK],
        "ucp_put_bw",
        "65536",
        "rma_am(ud_verbs/sv_lo:1)",
    );
    assert!(row.bandwidth_avg_mb_s > 1.0, "{row:?}");
}

/// With the IPv6 GID `::1`, UCX's destination-GID check of `ud_verbs` passes as it is (it takes
/// `wc.sl` 0 as "IPv6"), so no override is needed.
#[test]
fn ucx_perftest_over_ud_verbs_with_ipv6_gid_needs_no_override() {
    let ucx = Ucx::new();
    let mut c = command("/usr/bin/ibv_devinfo");
    c.args(["-v", "-d", "sv_lo"]);
    let (out, err) = text(&run_bounded(c, LIMIT));
    let index = out
        .lines()
        .find(|l| l.contains("GID[") && l.contains(":\t\t::1,"))
        .and_then(|l| l.split('[').nth(1))
        .and_then(|l| l.split(']').next())
        .map(|i| i.trim().to_string())
        .unwrap_or_else(|| panic!("no ::1 GID on sv_lo (is IPv6 enabled on lo?):\n{out}{err}"));
    drop(ucx);
    for (tls, lane) in [(UD, "tag(ud_verbs/sv_lo:1)"), (RC, "tag(rc_verbs/sv_lo:1)")] {
        ucp(tls, &[("UCX_IB_GID_INDEX", &index)], "tag_lat", "8", lane);
    }
}

/// UCT level: `ucx_perftest -d sv_lo:1 -x TL` drives one transport with no UCP and no wire-up
/// transport; `layout` is the data layout (`short`, `bcopy` or `zcopy`).
fn uct(tl: &str, test: &str, layout: &str, size: &str) -> Final {
    let _ucx = Ucx::new();
    let (row, _) = perftest(
        &[NO_DGID_CHECK],
        &[
            "-d", "sv_lo:1", "-x", tl, "-t", test, "-D", layout, "-s", size, "-n", "2000",
        ],
    );
    assert_sane(&row, 2000, test);
    row
}

#[test]
fn ucx_perftest_uct_am_lat_rc_verbs() {
    uct("rc_verbs", "am_lat", "short", "8");
}

#[test]
fn ucx_perftest_uct_put_bw_rc_verbs() {
    let row = uct("rc_verbs", "put_bw", "zcopy", "65536");
    assert!(row.bandwidth_avg_mb_s > 1.0, "{row:?}");
}

#[test]
fn ucx_perftest_uct_get_rc_verbs() {
    let row = uct("rc_verbs", "get", "zcopy", "65536");
    assert!(row.bandwidth_avg_mb_s > 1.0, "{row:?}");
}

#[test]
fn ucx_perftest_uct_am_lat_ud_verbs() {
    uct("ud_verbs", "am_lat", "short", "8");
}
