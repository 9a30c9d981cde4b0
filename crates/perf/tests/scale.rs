//! Runs of the `softverbs-scale` binary at reduced sizes: thousands of connected RC QPs in one
//! process, and several processes in pairs sharing the loopback device over UDP. The binary
//! itself fails on any unsuccessful or missing completion and on any byte of wrong data; the
//! tests check that it says so (exit status) and that the figures it reports are consistent.
//! Every run is bounded by a timeout; no figure is compared with a speed.

use std::collections::HashMap;
use std::net::UdpSocket;
use std::process::Command;
use std::time::Duration;

mod common;

const TIMEOUT: Duration = Duration::from_secs(180);

/// Runs the binary with `args` and `env`; returns (success, stdout, stderr), killing it after
/// [`TIMEOUT`].
fn scale(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_softverbs-scale"));
    // Every message of a burst waits behind all those in flight on every QP: in a debug build
    // on a loaded machine that exceeds the default 67 ms ACK timeout, and the retransmissions
    // (correct, but slow) could add up to a retry-exceeded error. 1.07 s keeps the test about
    // completions and data, not about the host's speed.
    cmd.arg("--ack-timeout=18")
        .args(args)
        .env("SOFTVERBS_INTERFACES", "lo")
        // The binary picks a private range of UDP ports itself.
        .env_remove("SOFTVERBS_UDP_PORT")
        .env_remove("SOFTVERBS_UDP_SLOTS")
        .env_remove("SOFTVERBS_LIMITS");
    if !args.contains(&"--processes") {
        // One process takes one slot; keep it off the standard port range so that the run
        // meets no other softverbs process.
        cmd.env("SOFTVERBS_UDP_PORT", free_base_port().to_string())
            .env("SOFTVERBS_UDP_SLOTS", "1");
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let (status, out, err) = common::run_bounded(cmd, TIMEOUT);
    (status.success(), out, err)
}

/// A base port with its first slot free now.
fn free_base_port() -> u16 {
    let free =
        |port: u16| UdpSocket::bind(("0.0.0.0", port)).is_ok() && UdpSocket::bind(("::", port)).is_ok();
    let seed = std::process::id() as u16;
    (0..1000u16)
        .map(|i| 20_000 + (seed.wrapping_add(i.wrapping_mul(89)) % 40_000))
        .find(|&base| (base..base + 2).all(free))
        .expect("a free range of UDP ports")
}

/// The `name value [unit]` lines of a successful run.
fn figures(args: &[&str]) -> HashMap<String, f64> {
    let (ok, out, err) = scale(args, &[]);
    assert!(ok, "softverbs-scale {args:?} failed:\n{out}\n{err}");
    let map: HashMap<String, f64> = out
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let name = w.next()?.to_string();
            let value = w.next()?.parse().ok()?;
            Some((name, value))
        })
        .collect();
    eprintln!("{out}");
    map
}

fn get(m: &HashMap<String, f64>, k: &str) -> f64 {
    *m.get(k).unwrap_or_else(|| panic!("no figure {k} in {m:?}"))
}

/// Idle CPU bound (% of one core): generous, since the machine is shared, yet far below what a
/// thread polling or waking per QP would use.
const IDLE_MAX: f64 = 5.0;

/// Wake-ups per second of the library's threads in an idle process: they block (today about
/// one a second, the receive thread's look at the standard port); a poller would show
/// thousands.
const WAKEUPS_MAX: f64 = 100.0;

#[test]
fn two_thousand_qps_in_one_process() {
    let m = figures(&["--qps", "2000", "--iters", "10", "--size", "64", "--idle", "1"]);
    assert_eq!(get(&m, "qps"), 2000.0);
    assert_eq!(get(&m, "messages"), 20_000.0);
    assert_eq!(get(&m, "completions_ok"), 20_000.0);
    assert_eq!(get(&m, "qps_verified"), 2000.0);
    let per_qp = get(&m, "bytes_per_qp");
    // Growth of the resident set over the QP count: a few kB for a connected, idle QP; a
    // megabyte would mean a queue or buffer allocated eagerly per QP.
    assert!(per_qp > 0.0 && per_qp < 64.0 * 1024.0, "bytes per QP: {per_qp}");
    for k in ["idle_cpu_connected", "idle_cpu_after_traffic"] {
        let v = get(&m, k);
        assert!((0.0..IDLE_MAX).contains(&v), "{k}: {v} % of a core");
    }
    for k in ["idle_wakeups_connected", "idle_wakeups_after_traffic"] {
        let v = get(&m, k);
        assert!((0.0..WAKEUPS_MAX).contains(&v), "{k}: {v} wake-ups/s");
    }
    assert!(get(&m, "msg_rate") > 0.0);
}

#[test]
fn sends_across_many_qps() {
    let m = figures(&[
        "--qps", "400", "--iters", "20", "--size", "100", "--depth", "3", "--test", "send", "--idle", "0",
    ]);
    assert_eq!(get(&m, "completions_ok"), 8000.0);
    assert_eq!(get(&m, "qps_verified"), 400.0);
}

#[test]
fn sixteen_processes_share_the_device() {
    let m = figures(&["--processes", "16", "--qps", "2", "--iters", "50", "--idle", "1"]);
    assert_eq!(get(&m, "processes"), 16.0);
    // Every process sends 50 messages on each of its 2 QPs, and checks what its peer wrote.
    assert_eq!(get(&m, "messages"), 1600.0);
    assert_eq!(get(&m, "completions_ok"), 1600.0);
    assert_eq!(get(&m, "qps_verified"), 32.0);
    let idle = get(&m, "idle_cpu_per_process_max");
    assert!((0.0..IDLE_MAX).contains(&idle), "idle CPU of a process: {idle} %");
    let w = get(&m, "idle_wakeups_per_process_max");
    assert!(
        (0.0..WAKEUPS_MAX).contains(&w),
        "wake-ups of an idle process: {w}/s"
    );
    assert!(get(&m, "rss_per_process_max") > 0.0);
}

#[test]
fn more_qps_than_the_device_allows_is_an_error() {
    let (ok, out, err) = scale(
        &["--qps", "200", "--iters", "1", "--idle", "0"],
        &[("SOFTVERBS_LIMITS", "max_qp=100")],
    );
    assert!(!ok, "200 QPs with max_qp=100 succeeded:\n{out}");
    assert!(err.contains("max_qp"), "{err}");
}

/// A network namespace of its own (removed on drop), so that no other process of the host holds
/// one of the ports the slots use. Needs root.
struct Netns(String);

impl Netns {
    fn new(tag: &str) -> Self {
        let ns = format!("sv{tag}{}", std::process::id() % 100_000);
        common::run("ip", &["netns", "add", &ns]);
        let me = Self(ns);
        common::run("ip", &["-n", &me.0, "link", "set", "lo", "up"]);
        me
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// More processes than a host has UDP slots for (255, the default and the most QP numbers can
/// carry): 255 processes hold a QP each, in distinct slots; the next one's QP creation fails
/// with ENOMEM, naming the slots; once a holder exits, a new process gets its slot.
#[test]
fn processes_beyond_the_slots_get_enomem_from_the_verb() {
    assert!(
        nix::unistd::Uid::effective().is_root(),
        "filling every slot needs root (a network namespace of its own)"
    );
    let ns = Netns::new("fill");
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &ns.0, env!("CARGO_BIN_EXE_softverbs-scale")])
        .args(["--fill-slots", "--processes", "300", "--timeout", "400"])
        .env("SOFTVERBS_INTERFACES", "lo")
        .env("SOFTVERBS_UDP_PORT", "4791")
        .env_remove("SOFTVERBS_UDP_SLOTS")
        .env_remove("SOFTVERBS_LIMITS")
        .env_remove("SOFTVERBS_SHM");
    let (status, out, err) = common::run_bounded(cmd, Duration::from_secs(450));
    eprintln!("{out}");
    assert!(
        status.success(),
        "softverbs-scale --fill-slots failed:\n{out}\n{err}"
    );
    let m: HashMap<String, f64> = out
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            Some((w.next()?.to_string(), w.next()?.parse().ok()?))
        })
        .collect();
    assert_eq!(get(&m, "processes_holding_qps"), 255.0);
    assert_eq!(get(&m, "distinct_slots"), 255.0);
    assert!(get(&m, "processes_refused") >= 1.0);
    assert_eq!(get(&m, "refused_errno"), 12.0, "ENOMEM");
    assert_eq!(get(&m, "slot_reused_after_exit"), 1.0);
    let refusal = out.lines().find(|l| l.starts_with("first_refusal")).unwrap();
    assert!(refusal.contains("UDP slot"), "{refusal}");
}
